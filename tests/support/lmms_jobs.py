"""Rank functions for lmms-engine's own VLM forwards (``tests/integrations/test_lmms_engine_forwards.py``).

lmms-engine 0.1.4 with ``use_rmpad`` (and ``use_liger_kernel``) installs its
own padding-free forwards through its Liger monkey patch
(``apply_liger_kernel_to_<family>``, the function its runner's
``MONKEY_PATCHER`` calls); the model is then sharded by its ``apply_fsdp2``.
Both run here as released.  Stand-ins, each for a CUDA-only kernel and named
here, never for the code under test or the code that wraps the model:

- ``flash_attn.bert_padding.index_first_axis`` (the ops modules import it only
  where flash-attn is installed, a CUDA build): ``x[indices]``, what it computes;
- ``flash_attn_varlen_func`` (Qwen2.5-VL's ops call it directly):
  lmms-engine's own ``kernels.attention.sdpa_varlen_attn``, its portable
  fallback with the same signature;
- Liger's ``LigerFusedLinearCrossEntropyLoss`` (a Triton kernel) in the
  ``*_liger`` forwards: the same cross entropy of ``hidden @ weight.T``.

Everything else the forward runs (unpadding, rope index, tower, deepstack
merge, varlen SDPA attention, the per-sequence label shift) is lmms-engine's.
"""

# family -> (monkey patch module, its Liger patch function, the ops module, the liger forward module)
FAMILIES = {
    "qwen3_vl": ("lmms_engine.models.qwen3_vl.monkey_patch", "apply_liger_kernel_to_qwen3_vl",
                 "lmms_engine.models.qwen3_vl.qwen3_vl_ops", "lmms_engine.models.qwen3_vl.qwen3_vl_liger"),
    "qwen3_vl_moe": ("lmms_engine.models.qwen3_vl_moe.monkey_patch", "apply_liger_kernel_to_qwen3_vl_moe",
                     "lmms_engine.models.qwen3_vl_moe.qwen3_vl_moe_ops",
                     "lmms_engine.models.qwen3_vl_moe.qwen3_vl_moe_liger"),
    "qwen2_5_vl": ("lmms_engine.models.qwen2_5_vl.monkey_patch", "apply_liger_kernel_to_qwen2_5_vl",
                   "lmms_engine.models.qwen2_5_vl.qwen2_5_vl_ops", "lmms_engine.models.qwen2_5_vl.qwen2_5_vl_liger"),
}
# What lmms_engine/models/__init__.py imports (every model lmms-engine ships) and the set does not install.
MODELS_INIT_DEPS = ("deepspeed", "datasets", "librosa", "diffusers", "timm", "decord", "cv2", "torchvision",
                    "qwen_vl_utils", "qwen_omni_utils", "jsonlines", "yaml", "rich", "pandas")


class CpuFusedLinearCrossEntropy:
    """Stand-in for Liger's Triton ``LigerFusedLinearCrossEntropyLoss``: ``lce(weight, hidden, labels)``."""

    def __init__(self, reduction="mean", **_):
        self.reduction = reduction

    def __call__(self, weight, hidden, labels):
        import torch.nn.functional as F

        return F.cross_entropy(hidden @ weight.t(), labels, ignore_index=-100, reduction=self.reduction)


def _index_first_axis(x, indices):
    return x[indices]


def import_models_package():
    """``lmms_engine.models`` without its ``__init__`` (it imports every model and their deps; the ops
    modules under test need torch, transformers, einops, loguru and liger-kernel)."""
    import importlib
    import sys

    from fsdp2_compat.tooling import frameworks

    frameworks.ensure_lmms_engine_utils_package()
    if "lmms_engine.models" in sys.modules:
        return
    try:
        importlib.import_module("lmms_engine.models")
    except ImportError:  # a missing dep, or a name the bare lmms_engine.utils lacks (TrainUtilities)
        for name in [m for m in sys.modules if m == "lmms_engine.models" or m.startswith("lmms_engine.models.")]:
            del sys.modules[name]
        frameworks._bare_package("lmms_engine.models", "lmms_engine.models, __init__ skipped (deps not installed)")


def install_own_forwards(family):
    """Run lmms-engine's Liger monkey patch for ``family`` with ``use_rmpad=True`` (its runner's call for
    ``use_liger_kernel`` + ``use_rmpad``; rope / RMSNorm / SwiGLU kernels off: Triton), the stand-ins in
    place.  Returns ``restore()``, which puts back every transformers class attribute and module global it
    replaced (the next case in the process starts from transformers as released)."""
    import importlib

    from einops import rearrange

    patch_module, patch_name, ops_name, liger_name = FAMILIES[family]
    import_models_package()
    ops = importlib.import_module(ops_name)
    ops.__dict__.setdefault("index_first_axis", _index_first_axis)
    ops.__dict__.setdefault("rearrange", rearrange)
    if "flash_attn_varlen_func" in ops.__dict__ or family == "qwen2_5_vl":
        from lmms_engine.kernels.attention import sdpa_varlen_attn

        ops.flash_attn_varlen_func = sdpa_varlen_attn
    importlib.import_module(liger_name).LigerFusedLinearCrossEntropyLoss = CpuFusedLinearCrossEntropy
    modeling = importlib.import_module("transformers.models.%s.modeling_%s" % (family, family))
    saved_globals = dict(vars(modeling))
    saved_forwards = {name: value.__dict__.get("forward") for name, value in saved_globals.items()
                      if isinstance(value, type) and value.__module__ == modeling.__name__}
    getattr(importlib.import_module(patch_module), patch_name)(
        rope=False, rms_norm=False, swiglu=False, fused_linear_cross_entropy=True, use_rmpad=True,
        **({"layer_norm": False} if family == "qwen3_vl_moe" else {}))

    def restore():
        for name, forward in saved_forwards.items():
            if saved_globals[name].__dict__.get("forward") is not forward and forward is not None:
                setattr(saved_globals[name], "forward", forward)
        for name, value in saved_globals.items():
            if modeling.__dict__.get(name) is not value:
                setattr(modeling, name, value)

    return restore


def own_forward_of(model):
    """The module of the function the base model's class runs as ``forward`` (wrappers unwrapped)."""
    import inspect

    return inspect.unwrap(type(model.model).__dict__["forward"]).__module__


def _case(rank, world, family, patches, steps):
    """One training run of ``family`` through lmms-engine's own forwards and ``apply_fsdp2``."""
    import copy

    import fsdp2_compat
    from fsdp2_compat.fixes import media_merge, mixed_media
    from fsdp2_compat.tooling import frameworks, tiny
    from fsdp2_compat.tooling.scenarios import train_against_reference, wrapped_module_names
    from fsdp2_compat.tooling.tiny.text import text_only

    if patches:
        fsdp2_compat.apply(patches)  # before lmms-engine's monkey patch, as the bootstrap is
    frameworks.import_fsdp_utils("lmms-engine")
    restore = install_own_forwards(family)
    try:
        model = tiny.build(family, tie=False, seed=0)
        reference = copy.deepcopy(model)
        frameworks.shard("lmms-engine", model, world, "fp32")
        result = {"wrapped": wrapped_module_names(model), "error": None, "losses": [], "loss_err": 0.0,
                  "grad_err": 0.0, "worst_grad": None, "param_err": 0.0, "grads_checked": 0,
                  "lm_head_grad_err": 0.0, "forward": own_forward_of(model)}
        dummies, merged = mixed_media.STATS["dummy_forwards"], media_merge.STATS["merged_forwards"]

        def batch(kind, seed):
            if kind == "text":
                return text_only(tiny.make_batch(family, reference, seed=seed), seed + 1000)
            return tiny.make_batch(family, reference, seed=seed, media=tuple(kind.split("+")))

        def batches_for(step):
            return [batch(steps[step][r], 1 + 10 * step + r) for r in range(world)]

        def loss_of(module, b):
            out = module(**b)
            return out.loss, out

        train_against_reference(model, reference, rank, world, result, batches_for, loss_of, steps=len(steps))
        result["dummy_forwards"] = mixed_media.STATS["dummy_forwards"] - dummies
        result["merged_forwards"] = media_merge.STATS["merged_forwards"] - merged
        return result
    finally:
        restore()
        fsdp2_compat.revert()


def patched_then_unpatched(rank, world, directory, cases, unpatched):
    """Every patched case ``[(name, family, patches, steps)]``, written to ``directory/rank<N>.json``, then the
    ``unpatched`` case (whose gloo abort ends the process); this rank's stderr in ``directory/rank<N>.err``."""
    import json
    import os

    from fsdp2_compat.tooling.mixed import stderr_to_file
    from support import accum_jobs

    stderr_to_file(directory, rank)
    accum_jobs.register_test_patches()
    out = {name: _case(rank, world, family, patches, steps) for name, family, patches, steps in cases}
    with open(os.path.join(directory, "rank%d.json" % rank), "w", encoding="utf-8") as fh:
        json.dump(out, fh, default=str)
    name, family, patches, steps = unpatched
    return _case(rank, world, family, patches, steps)
