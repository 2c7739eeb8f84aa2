"""ms-swift 4.6.0's GKD Liger loss on accelerate's FSDP2, 2 CPU gloo ranks (tests/integrations/test_ms_swift_liger.py).

``gkd``: ``GKDTrainer._compute_liger_loss`` through ``_ForwardRedirection``, in the four lines of its
``compute_loss``'s liger branch (the rest of ``compute_loss`` needs a ``GKDBatch`` from its rollout): student and
teacher base models, then liger-kernel's ``LigerFusedLinearJSDLoss`` on ``student_head.weight`` and
``teacher_head.weight`` (the teacher through ms-swift's own ``prepare_fsdp``, as its rollout mixin prepares a
local teacher under FSDP).  The trainer is a real instance whose ``__init__`` is skipped, with the attributes the
method reads set as ``__init__`` sets them; ``read`` records, through a forward pre-hook on the liger loss module,
the types of the head weights that reached it.  GRPO's Liger loss, which ``fsdp2-compat check`` runs too, lives in
``harness/fsdp2_compat_harness/engines/ms_swift.py`` (``grpo_liger``); ``liger_cases`` runs either.  Stand-in:
``trl_scenarios.cpu_fsdp`` only.
"""

import copy

from fsdp2_compat_harness.engines.ms_swift import grpo_liger, unit_of


def _gkd_trainer(student, acc, teacher):
    import types

    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
    from swift.rlhf_trainers.gkd_trainer import GKDTrainer
    from swift.rlhf_trainers.utils import _ForwardRedirection

    trainer = GKDTrainer.__new__(GKDTrainer)
    trainer.model, trainer.accelerator, trainer.teacher_model = student, acc, teacher
    trainer.args = types.SimpleNamespace(offload_teacher_model=False, gradient_checkpointing_kwargs=None)
    trainer.beta, trainer.temperature = 0.5, 1.0
    trainer.liger_jsd_loss = LigerFusedLinearJSDLoss(  # GKDTrainer._prepare_liger_loss's arguments
        weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.5, ignore_index=-100, temperature=1.0, compiled=False)
    trainer._forward_redirection = _ForwardRedirection()
    trainer.use_liger_gkd_loss, trainer.is_teacher_ds3 = True, False
    return trainer


def gkd_liger(rank, world, family, patches, steps=2, lr=0.05):
    """``GKDTrainer._compute_liger_loss`` on accelerate's FSDP2 (the teacher through ms-swift's ``prepare_fsdp``)
    against the DP reference (an unsharded student and teacher)."""
    import torch
    from swift.rlhf_trainers.utils import prepare_fsdp

    from fsdp2_compat_harness import subset, tiny
    from fsdp2_compat_harness.scenarios import train_against_reference
    from fsdp2_compat_harness.trl_scenarios import cpu_fsdp, make_accelerator, rank_env

    rank_env(rank, world)
    subset.apply(patches)
    with cpu_fsdp():
        model = tiny.build(family, tie=False, seed=0)
        reference = copy.deepcopy(model)
        teacher = tiny.build(family, tie=False, seed=1)
        ref_teacher = copy.deepcopy(teacher).eval().requires_grad_(False)
        acc = make_accelerator()
        model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=lr))
        teacher = prepare_fsdp(teacher, acc)  # what GKDTrainer does with a local teacher under FSDP
        teacher.eval()
        trainer = _gkd_trainer(model, acc, teacher)
        ref_trainer = _gkd_trainer(reference, acc, ref_teacher)
        seen = []  # instrumentation: the types of the student and teacher head weights reaching liger's loss
        trainer.liger_jsd_loss.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append((type(kwargs["student_weight"]).__name__,
                                                 type(kwargs["teacher_weight"]).__name__)), with_kwargs=True)
        result = {"error": None, "losses": [], "loss_err": 0.0, "grad_err": 0.0, "worst_grad": None,
                  "param_err": 0.0, "grads_checked": 0, "head_unit": unit_of(model, model.lm_head),
                  "teacher_head_unit": unit_of(teacher, teacher.lm_head), "read": seen}

        def loss_of(module, batch):
            forward_inputs = {k: v for k, v in batch.items() if k != "labels"}
            if module is model:  # GKDTrainer.compute_loss's liger branch
                unwrapped = acc.unwrap_model(model)
                return trainer._forward_redirection(
                    model, unwrapped, lambda *_, **__: trainer._compute_liger_loss(unwrapped, batch, forward_inputs),
                    **forward_inputs), None
            return ref_trainer._compute_liger_loss(reference, batch, forward_inputs), None

        def batches_for(step):
            return [tiny.make_batch(family, reference, seed=1 + 10 * step + r) for r in range(world)]

        return train_against_reference(model, reference, rank, world, result, batches_for, loss_of, steps, lr)


def liger_cases(rank, world, cases):
    """``grpo_liger`` / ``gkd_liger`` per ``(trainer, family, patches)`` (``"grpo"`` / ``"gkd"``), reverting in
    between."""
    import fsdp2_compat
    from accelerate.state import AcceleratorState

    from fsdp2_compat_harness import subset

    out = []
    jobs = {"grpo": grpo_liger, "gkd": gkd_liger}
    for trainer, family, patches in cases:
        subset.forget()
        fsdp2_compat.revert()
        AcceleratorState._reset_state(reset_partial_state=True)
        out.append(jobs[trainer](rank, world, family, patches))
    subset.forget()
    fsdp2_compat.revert()
    return out
