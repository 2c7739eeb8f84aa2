"""lmms-engine's own padding-free VLM forwards (``use_rmpad``), installed on CPU as its runner installs them.

lmms-engine 0.1.4 with ``trainer_args.use_rmpad`` (and ``use_liger_kernel``)
runs its Liger monkey patch (``apply_liger_kernel_to_<family>``, what its
runner's ``MONKEY_PATCHER`` calls), which assigns its own base-model forward
over transformers' (``integrations.lmms_engine``).  ``install_own_forwards``
runs that monkey patch as released, with three stand-ins, each for a CUDA-only
kernel, none for code fsdp2-compat patches or code that wraps the model:

- ``flash_attn.bert_padding.index_first_axis`` (the ops modules import it only
  where flash-attn is installed, a CUDA build): ``x[indices]``, what it computes;
- ``flash_attn_varlen_func`` (Qwen2.5-VL's ops call it directly):
  lmms-engine's own ``kernels.attention.sdpa_varlen_attn``, its portable
  fallback with the same signature;
- Liger's ``LigerFusedLinearCrossEntropyLoss`` (a Triton kernel) in the
  ``*_liger`` forwards: the same cross entropy of ``hidden @ weight.T``.

Liger's rope / RMSNorm / SwiGLU kernels are turned off through the patch
function's own arguments.  Everything else the forward runs (unpadding, rope
index, tower, deepstack merge, varlen SDPA attention, the per-sequence label
shift) is lmms-engine's.  Used by ``fsdp2-compat check`` (``fsdp2_compat_harness.mixed``)
and ``tests/integrations/test_lmms_engine_forwards.py``.
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


def unavailable():
    """Why lmms-engine's own forwards cannot run here, or None."""
    import importlib.util

    missing = [m for m in ("lmms_engine", "liger_kernel", "einops", "loguru") if importlib.util.find_spec(m) is None]
    return "needs %s" % ", ".join(missing) if missing else None


def import_models_package():
    """``lmms_engine.models`` without its ``__init__`` (it imports every model and their deps; the ops
    modules under test need torch, transformers, einops, loguru and liger-kernel)."""
    import importlib
    import sys

    from .. import frameworks

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
    from lmms_engine.kernels.attention import sdpa_varlen_attn

    # Only where flash-attn is absent (its names then undefined in the ops module); a module that never
    # calls one of them ignores it.
    ops.__dict__.setdefault("index_first_axis", _index_first_axis)
    ops.__dict__.setdefault("rearrange", rearrange)
    ops.__dict__.setdefault("flash_attn_varlen_func", sdpa_varlen_attn)
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
