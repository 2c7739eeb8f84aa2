"""ms-swift 4.6.0's own loader, templates and GRPO Liger loss on accelerate's FSDP2, 2 CPU gloo ranks.

Used by ``fsdp2-compat check`` (its "ms-swift ..." rows: ``check.ms_swift``) and by
``tests/integrations/test_ms_swift.py`` / ``test_ms_swift_liger.py``, which run more families and cases.

``swift_cases`` (the loader's forward): per case, on every rank: a tiny model (``fsdp2_compat_harness.tiny``;
Qwen3.5, which it lacks, from ``qwen3_5_config`` below in its geometry) is saved with ``save_pretrained`` and
loaded back through ms-swift's own loader (``get_model_info_meta`` -> the model type's ``ModelLoader``
subclass -> its ``get_model``: for Qwen3-VL that is where ``_compat_qwen3_vl_mixed_data`` replaces the
base model's instance ``forward`` and saves ``origin_forward``), twice: the model trained on FSDP2 and the
unsharded reference trained on the data-parallel average (``scenarios.train_against_reference``).  The
model type's own template (``TEMPLATE_MAPPING[...].template_cls``) is put in training mode and its
``register_post_encode_hook`` installs ``pre_forward_hook`` -> ``_post_encode`` on both models, as ms-swift's
trainer does: for Qwen2.5-VL and GLM-4.1V it runs the tower on every micro-batch (a 32x32 black image's
features joined ``0 *`` for a text-only one) and calls the model with ``inputs_embeds``; Qwen3-VL's passes the
media on.  accelerate's ``Accelerator.prepare`` shards the model (FSDP2, ``TRANSFORMER_BASED_WRAP``: what
``swift sft --fsdp fsdp2`` configures).  Step s gives rank ``s % world`` media (an image, or an image and a
video), the other ranks text only; every batch differs per rank.

``grpo_liger`` (GRPO's Liger loss): ``GRPOTrainer.compute_loss`` with ``use_liger_loss`` (its body as released,
past the ``profiling_decorator``): ``_ForwardRedirection`` routes ``compute_liger_loss`` through the root unit's
forward, which runs the base model for the last hidden state and hands ``unwrapped_model.lm_head.weight`` to
liger-kernel's ``LigerFusedLinearGRPOLoss`` (built as ``GRPOTrainer.__init__`` builds it).  The trainer is a
real instance whose ``__init__`` is skipped (it needs datasets, a rollout engine, reward functions), with the
attributes the method reads set as ``__init__`` sets them (``args``: a namespace with the field read;
``fsdp2_compat_harness.trl_scenarios`` does the same for TRL's trainers).  ``read`` records, through a forward pre-hook on
the liger loss module, the type of the head weight that reached it.  (GKD's Liger path, which fails before
any head read patched or not: ``tests/support/swift_rl_jobs.py``.)

Stand-ins, named: ``trl_scenarios.cpu_fsdp`` (accelerate selects FSDP only for GPU-like devices), and the
template's ``processor``: ms-swift's loader builds it with ``AutoProcessor``, whose Qwen/GLM classes need
torchvision for their video half (no CPU build of it for torch 2.13.0 here), and ``_post_encode`` reads only
``processor.image_processor``: the template gets a namespace holding transformers' real
``Qwen2VLImageProcessorPil`` with the tiny tower's patch geometry.  The batches come from ``tiny.make_batch``
(ms-swift's collator output for these models is the same tensors: ``input_ids``, ``labels``,
``attention_mask``, ``pixel_values``, ``image_grid_thw``...), not from ``template.encode``, which needs the
tokenizer ms-swift would load with that processor.  Nothing of ms-swift's, accelerate's, liger-kernel's or
transformers' model code is replaced.
"""

import copy
import gc
import os

# tiny family -> (ms-swift model type, ms-swift template type)
SWIFT = {
    "qwen3_vl": ("qwen3_vl", "qwen3_vl"),
    "qwen2_5_vl": ("qwen2_5_vl", "qwen2_5_vl"),
    "glm4v": ("glm4v", "glm4v"),
    "qwen3_5": ("qwen3_5", "qwen3_5"),
    "qwen2": ("qwen2", "qwen2_5"),  # GRPO's text control
}
# Families ``fsdp2_compat_harness.tiny`` does not build: the config here, the batches of the family named
BATCHES_OF = {"qwen3_5": "qwen3_vl"}  # Qwen3.5's tower and media inputs are Qwen3-VL's (no deepstack)


def qwen3_5_config():
    """A tiny Qwen3.5 (one linear-attention and one full-attention layer) in ``tiny.configs``' geometry."""
    import transformers

    from fsdp2_compat_harness.tiny import configs as c

    text = c._text(False, head_dim=c._HEAD_DIM, layer_types=["linear_attention", "full_attention"],
                   linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                   linear_num_value_heads=2,
                   **c.rope(mrope_section=[2, 3, 3], mrope_interleaved=True, partial_rotary_factor=1.0))
    vision = dict(depth=1, hidden_size=c._HIDDEN, intermediate_size=c._INTER, num_heads=c._HEADS, in_channels=3,
                  patch_size=c._PATCH, spatial_merge_size=c._MERGE, temporal_patch_size=c._TPATCH,
                  out_hidden_size=c._HIDDEN, num_position_embeddings=c._GRID * c._GRID)
    return transformers.Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=c._IMG,
                                      video_token_id=c._VID, vision_start_token_id=c._VSTART,
                                      vision_end_token_id=c._VEND, tie_word_embeddings=False)


def build(family, seed=0):
    """The tiny fp32 model of ``family`` (``tiny.build``, or the config above), weights from ``seed``."""
    import torch
    import transformers

    from fsdp2_compat_harness import tiny

    if family != "qwen3_5":
        return tiny.build(family, tie=False, seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen3_5ForConditionalGeneration(qwen3_5_config())
    return model.to(dtype=torch.float32, device="cpu").train()


def swift_load(family, directory):
    """The model ms-swift's loader builds from the checkpoint in ``directory``, and that loader's class name."""
    import torch
    from swift.model import get_model_info_meta

    info, meta = get_model_info_meta(directory, model_type=SWIFT[family][0], torch_dtype=torch.float32)
    loader = meta.loader(info, meta, load_model=True, model_kwargs={"device_map": "cpu"})
    model = loader.get_model(directory, loader.get_config(directory), None, loader.model_kwargs)
    model.train()
    return model, type(loader).__name__


def swift_template(family, model):
    """ms-swift's template of ``family`` in training mode (see the module docstring for its processor)."""
    import types

    import transformers

    template = _template(family)
    template.set_mode("train")
    vision = model.config.vision_config
    image_processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.spatial_merge_size)
    template.processor = types.SimpleNamespace(image_processor=image_processor)
    return template


def _template(family):
    """ms-swift's template of ``family``, as its registry builds it (no processor yet)."""
    from swift.template.register import TEMPLATE_MAPPING

    meta = TEMPLATE_MAPPING[SWIFT[family][1]]
    return meta.template_cls(None, meta)


def _tower(model):
    inner = getattr(model, "model", model)
    return inner.visual


def swift_case(rank, world, directory, family, patches, media=("image",), late=False, steps=3, lr=0.05):
    """One case: ms-swift's loader and template, accelerate's FSDP2, ``steps`` SGD steps against the DP
    reference.  ``directory``: where rank 0 saves the checkpoint every rank loads (transformers saves on
    rank 0 only once a process group is up).  ``late``: the patches are requested after ms-swift loaded
    both models."""
    import torch
    import torch.distributed as dist

    import fsdp2_compat
    from fsdp2_compat.fixes import mixed_media, unit_walk
    from fsdp2_compat_harness import subset, tiny
    from fsdp2_compat_harness.scenarios import train_against_reference
    from fsdp2_compat_harness.tiny.text import count_forwards, counted_loss, one_rank_with_media
    from fsdp2_compat_harness.trl_scenarios import cpu_fsdp, make_accelerator, rank_env

    rank_env(rank, world)
    if not late:
        subset.apply(patches)
    with cpu_fsdp():
        if rank == 0:
            build(family).save_pretrained(directory)
        dist.barrier()
        model, loader = swift_load(family, directory)
        reference, _ = swift_load(family, directory)
        swapped = "origin_forward" in vars(model.model)
        if late:
            subset.apply(patches)
        rows = [row for row in fsdp2_compat.status() if "origin_forward" in (row.get("detail") or "")]
        template = swift_template(family, model)
        template.register_post_encode_hook([model, reference])
        acc = make_accelerator()
        model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=lr))
        calls = count_forwards(_tower(model))
        result = {"error": None, "losses": [], "loss_err": 0.0, "grad_err": 0.0, "worst_grad": None,
                  "param_err": 0.0, "grads_checked": 0, "tower_calls": calls, "loader": loader,
                  "origin_forward": swapped, "status_rows": rows, "template": type(template).__name__}
        before, walks = dict(mixed_media.STATS), unit_walk.STATS["walks"]

        def batches_for(step):
            kind = BATCHES_OF.get(family, family)
            return one_rank_with_media(lambda seed: tiny.make_batch(kind, reference, seed=seed, media=media), step, world)

        torch.manual_seed(0)
        try:
            result = train_against_reference(model, reference, rank, world, result, batches_for,
                                             counted_loss(model, calls, keep_output=False), steps, lr)
        finally:
            template.remove_post_encode_hook()
        result["stats"] = {k: mixed_media.STATS[k] - before.get(k, 0) for k in mixed_media.STATS}
        result["walks"] = unit_walk.STATS["walks"] - walks  # text-only dummies walked (fixes.unit_walk)
    return result


def swift_cases(rank, world, directory, cases):
    """``swift_case(rank, world, ..., **case)`` for each case dict, in this rank process, reverting in between;
    case i's checkpoint is saved under ``directory``/i, and each rank's stderr goes to ``directory``/rank<N>.err."""
    import fsdp2_compat
    from accelerate.state import AcceleratorState

    from fsdp2_compat_harness import subset
    from fsdp2_compat_harness.mixed import stderr_to_file

    stderr_to_file(directory, rank)  # gloo's abort message lands there (rank<N>.err)
    out = []
    for i, case in enumerate(cases):
        gc.collect()  # the previous case's models: a late apply would rebind them too
        subset.forget()
        fsdp2_compat.revert()
        AcceleratorState._reset_state(reset_partial_state=True)
        out.append(swift_case(rank, world, os.path.join(directory, str(i)), **case))
    subset.forget()
    fsdp2_compat.revert()
    return out


# --- GRPO's Liger loss: GRPOTrainer.compute_liger_loss reads unwrapped_model.lm_head.weight ----------------------

K = 6  # completion tokens: the last K of each row


def _grpo_trainer(model, acc, template, multimodal):
    import collections
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
    trainer.control = transformers.TrainerControl()
    trainer._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    trainer.args = types.SimpleNamespace(report_to=[])  # what profiling_context reads of GRPOConfig
    trainer.liger_grpo_loss = LigerFusedLinearGRPOLoss(  # GRPOTrainer.__init__'s arguments, GRPOConfig's defaults
        beta=0.0, compiled=False, epsilon_low=0.2, epsilon_high=0.2, temperature=1.0, use_ref_model=False,
        loss_type="grpo", max_completion_length=K, importance_sampling_level="token")
    trainer._forward_redirection = _ForwardRedirection()
    return trainer


def _grpo_inputs(family, reference, seed):
    import torch
    from swift.rl_core.data import GRPOBatch

    from fsdp2_compat_harness import tiny

    batch = tiny.make_batch(family, reference, seed=seed)
    batch.pop("labels")
    rows = batch["input_ids"].shape[0]
    gen = torch.Generator().manual_seed(seed)
    grpo = GRPOBatch(completion_mask=torch.ones(rows, K), truncated_mask=torch.zeros(rows, dtype=torch.bool),
                     seq_lengths=torch.full((rows,), batch["input_ids"].shape[1]),
                     advantages=torch.randn(rows, K, generator=gen), logits_to_keep=K)
    return {"model_inputs": batch, "grpo_batch": grpo}


def grpo_liger(rank, world, family, patches, steps=2, lr=0.05):
    """``GRPOTrainer.compute_loss`` (Liger) on accelerate's FSDP2 against the DP reference (``compute_liger_loss``
    of an unsharded twin), with ms-swift's template of ``family`` (``compute_liger_loss`` reads only its
    ``padding_free``)."""
    import torch
    from swift.rlhf_trainers.grpo_trainer import GRPOTrainer

    from fsdp2_compat_harness import subset, tiny
    from fsdp2_compat_harness.scenarios import train_against_reference
    from fsdp2_compat_harness.trl_scenarios import cpu_fsdp, make_accelerator, rank_env

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
                  "head_unit": unit_of(model, model.lm_head), "read": seen}

        def loss_of(module, inputs):
            if module is model:
                return compute_loss(trainer, model, inputs), None
            return ref_trainer.compute_liger_loss(reference, inputs["model_inputs"], inputs["grpo_batch"]), None

        def batches_for(step):
            return [_grpo_inputs(family, reference, seed=1 + 10 * step + r) for r in range(world)]

        return train_against_reference(model, reference, rank, world, result, batches_for, loss_of, steps, lr)


def unit_of(model, module):
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


# --- fsdp2-compat check's rows: one step each, unpatched and with the family's patch --------------------------------
