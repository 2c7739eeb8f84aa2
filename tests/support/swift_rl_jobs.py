"""ms-swift 4.6.0's Liger losses on accelerate's FSDP2, 2 CPU gloo ranks (tests/integrations/test_ms_swift_liger.py).

- ``grpo``: ``GRPOTrainer.compute_loss`` with ``use_liger_loss`` (its body as released, past the
  ``profiling_decorator``): ``_ForwardRedirection`` routes ``compute_liger_loss`` through the root unit's
  forward, which runs the base model for the last hidden state and hands ``unwrapped_model.lm_head.weight``
  to liger-kernel's ``LigerFusedLinearGRPOLoss`` (built as ``GRPOTrainer.__init__`` builds it).
- ``gkd``: ``GKDTrainer._compute_liger_loss`` through the same redirection, in the four lines of its
  ``compute_loss``'s liger branch (the rest of ``compute_loss`` needs a ``GKDBatch`` from its rollout): student
  and teacher base models, then liger-kernel's ``LigerFusedLinearJSDLoss`` on ``student_head.weight`` and
  ``teacher_head.weight`` (the teacher through ms-swift's own ``prepare_fsdp``, as its rollout mixin prepares
  a local teacher under FSDP).

The trainers are real instances whose ``__init__`` is skipped (it needs datasets, a rollout engine, reward
functions), with the attributes these methods read set as ``__init__`` sets them (``args``: a namespace with the
two fields read; ``tooling/trl_scenarios`` does the same for TRL's trainers). ``read`` records, through a
forward pre-hook on the liger loss module, the type of the head weight(s) that reached it. The unsharded
reference runs the same method on the same batches and trains on the data-parallel average. Stand-in:
``trl_scenarios.cpu_fsdp`` only.
"""

import copy

K = 6  # completion tokens: the last K of each row
TEMPLATES = {"qwen2": "qwen2_5", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl"}  # ms-swift's template types


def _template(family):
    """ms-swift's template of ``family`` (``compute_liger_loss`` reads only its ``padding_free``)."""
    from swift.template.register import TEMPLATE_MAPPING

    meta = TEMPLATE_MAPPING[TEMPLATES[family]]
    return meta.template_cls(None, meta)


def _metrics():
    import collections

    return {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}


def _grpo_trainer(model, acc, template, multimodal):
    import inspect
    import types

    import transformers
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    from swift.rlhf_trainers.grpo_trainer import GRPOTrainer
    from swift.rlhf_trainers.utils import _ForwardRedirection

    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.model, trainer.accelerator, trainer.template = model, acc, template
    trainer.use_liger_loss, trainer.chord_sft_iterator = True, None
    trainer.advantage_estimator, trainer.beta, trainer.is_multimodal = "grpo", 0.0, multimodal
    trainer.rollout_importance_sampling_mode, trainer.disable_rollout_importance_sampling = None, True
    trainer.model_kwarg_keys = inspect.signature(type(model).forward).parameters.keys()
    trainer.control, trainer._metrics = transformers.TrainerControl(), _metrics()
    trainer.args = types.SimpleNamespace(report_to=[])  # what profiling_context reads of GRPOConfig
    trainer.liger_grpo_loss = LigerFusedLinearGRPOLoss(  # GRPOTrainer.__init__'s arguments, GRPOConfig's defaults
        beta=0.0, compiled=False, epsilon_low=0.2, epsilon_high=0.2, temperature=1.0, use_ref_model=False,
        loss_type="grpo", max_completion_length=K, importance_sampling_level="token")
    trainer._forward_redirection = _ForwardRedirection()
    return trainer


def _grpo_inputs(family, reference, seed):
    import torch
    from swift.rl_core.data import GRPOBatch

    from fsdp2_compat.tooling import tiny

    batch = tiny.make_batch(family, reference, seed=seed)
    batch.pop("labels")
    rows = batch["input_ids"].shape[0]
    gen = torch.Generator().manual_seed(seed)
    grpo = GRPOBatch(completion_mask=torch.ones(rows, K), truncated_mask=torch.zeros(rows, dtype=torch.bool),
                     seq_lengths=torch.full((rows,), batch["input_ids"].shape[1]),
                     advantages=torch.randn(rows, K, generator=gen), logits_to_keep=K)
    return {"model_inputs": batch, "grpo_batch": grpo}


def grpo_liger(rank, world, family, patches, steps=2, lr=0.05):
    """``GRPOTrainer.compute_loss`` (Liger) on accelerate's FSDP2 against the DP reference."""
    import torch
    from swift.rlhf_trainers.grpo_trainer import GRPOTrainer

    from fsdp2_compat.tooling import subset, tiny
    from fsdp2_compat.tooling.scenarios import train_against_reference
    from fsdp2_compat.tooling.trl_scenarios import cpu_fsdp, make_accelerator, rank_env

    rank_env(rank, world)
    subset.apply(patches)
    compute_loss = GRPOTrainer.compute_loss.__wrapped__  # past profiling_decorator (it logs timings)
    with cpu_fsdp():
        model = tiny.build(family, tie=False, seed=0)
        reference = copy.deepcopy(model)
        template, multimodal = _template(family), hasattr(model.config, "vision_config")
        acc = make_accelerator()
        model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=lr))
        trainer = _grpo_trainer(model, acc, template, multimodal)
        seen = []  # instrumentation: the type of the head weight reaching liger's loss
        trainer.liger_grpo_loss.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(type(kwargs["lin_weight"]).__name__), with_kwargs=True)
        ref_trainer = _grpo_trainer(reference, acc, template, multimodal)
        result = {"error": None, "losses": [], "loss_err": 0.0, "grad_err": 0.0, "worst_grad": None,
                  "param_err": 0.0, "grads_checked": 0, "head": type(model.lm_head.weight).__name__,
                  "head_unit": _unit_of(model, model.lm_head), "read": seen}

        def loss_of(module, inputs):
            if module is model:
                return compute_loss(trainer, model, inputs), None
            return ref_trainer.compute_liger_loss(reference, inputs["model_inputs"], inputs["grpo_batch"]), None

        def batches_for(step):
            return [_grpo_inputs(family, reference, seed=1 + 10 * step + r) for r in range(world)]

        return train_against_reference(model, reference, rank, world, result, batches_for, loss_of, steps, lr)


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

    from fsdp2_compat.tooling import subset, tiny
    from fsdp2_compat.tooling.scenarios import train_against_reference
    from fsdp2_compat.tooling.trl_scenarios import cpu_fsdp, make_accelerator, rank_env

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
                  "param_err": 0.0, "grads_checked": 0, "head_unit": _unit_of(model, model.lm_head),
                  "teacher_head_unit": _unit_of(teacher, teacher.lm_head), "read": seen}

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


def _unit_of(model, module):
    """The name of the FSDP2 unit whose parameters include ``module``'s (its own, or an enclosing one)."""
    from torch.distributed.fsdp import FSDPModule

    owned = {id(p) for p in module.parameters()}
    units = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    for name, unit in sorted(units, key=lambda u: -len(u[0])):
        state = unit._get_fsdp_state()
        group = state._fsdp_param_group
        if group is not None and owned & {id(fp.sharded_param) for fp in group.fsdp_params}:
            return name or "<root>"
    return None


def liger_cases(rank, world, cases):
    """``grpo_liger`` / ``gkd_liger`` per ``(trainer, family, patches)`` (``"grpo"`` / ``"gkd"``), reverting in
    between."""
    import fsdp2_compat
    from accelerate.state import AcceleratorState

    from fsdp2_compat.tooling import subset

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
