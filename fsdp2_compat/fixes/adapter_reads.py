"""A LoRA kernel's read of a DoRA magnitude that is its own FSDP2 unit: unshard the unit, not ``full_tensor()``.

axolotl's fused LoRA kernels (``axolotl.kernels.lora``: ``LoRA_QKV``, ``LoRA_O``,
``LoRA_Embedding``, run from the forwards ``apply_lora_kernel_patches``
installs) take every adapter tensor as an argument of one
``torch.autograd.Function``, so no adapter module's own forward runs and FSDP2's
pre-forward unshard never happens for them.  axolotl's ``fsdp2_prepare_model``
makes ``lora_A[adapter]``, ``lora_B[adapter]`` and
``lora_magnitude_vector[adapter]`` units of their own; its readers then unshard
``lora_A`` / ``lora_B`` through FSDP (``linear_A.unshard()``: FSDP averages
their gradients) but read the DoRA magnitude with plain
``magnitude.full_tensor()``, whose backward only slices: each rank keeps its own
micro-batch's magnitude gradient, never the data-parallel average (the gradient
trap of ``fsdp2_compat.fixes.gather``).

Mechanism: before upstream's reader runs, ``gather.gather_param`` unshards the
magnitude's own unit (FSDP's unsharded parameter, ``param_dtype``, compute
device) and arms the early release: FSDP's own ``post_backward`` of that unit
reduce-scatters (averages) the gradient once it is complete.  Upstream's
``isinstance(magnitude, DTensor)`` test is then false and its own code reads
the unsharded parameter; nothing of axolotl's math is touched.  The DoRA norm
cache axolotl keeps on the magnitude tensor is dropped at each gathered read
(see ``gather_magnitude``): without that, the second step reuses the first
step's norm (measured: every adapter gradient off by up to 0.26 at step 2).

Fails safe: an adapter that is disabled or merged, a layer without DoRA, or a
magnitude that is not sharded (no FSDP, or already unsharded by an enclosing
unit's forward) is left to upstream's code as it is.  A sharded magnitude whose
module is not an FSDP2 unit (a wrapping this fix was not proven on) is left to
upstream's ``full_tensor()`` with one WARNING saying its gradient is not averaged.
"""

import logging

_warned = set()


def _active_adapter(layer):
    adapters = getattr(layer, "active_adapters", None)
    if adapters:
        return adapters[0]
    return getattr(layer, "active_adapter", None)


def gather_magnitude(layer):
    """Unshard the FSDP2 unit of ``layer``'s active DoRA magnitude, as the unit's forward would (see above)."""
    if not hasattr(layer, "disable_adapters") or layer.disable_adapters or getattr(layer, "merged", False):
        return  # upstream returns before reading any adapter tensor
    magnitudes = getattr(layer, "lora_magnitude_vector", None)
    adapter = _active_adapter(layer)
    if not magnitudes or adapter not in magnitudes:
        return
    owner = magnitudes[adapter]
    from torch.distributed.fsdp import FSDPModule

    from . import gather

    if not gather._is_dtensor(getattr(owner, "weight", None)):
        return
    if not isinstance(owner, FSDPModule):
        kind = type(layer).__name__
        if kind not in _warned:
            _warned.add(kind)
            logging.getLogger("fsdp2_compat").warning(
                "fsdp2-compat: the DoRA magnitude of a %s is sharded but is not an FSDP2 unit of its own; left to "
                "upstream's full_tensor(), whose gradient is each rank's own (not averaged)", kind)
        return
    value = gather.gather_param(owner, "weight")
    # axolotl caches ||W + s*B@A|| on the magnitude tensor (``_dora_cache``), keyed on ``A._version`` and
    # ``B._version``.  ``full_tensor()`` gave a new tensor per call, so under FSDP2 the cache never hit; FSDP's
    # unsharded parameter is the same object every step and its all-gather leaves those versions unchanged, so a
    # kept cache would reuse the first step's norm after the optimizer moved A and B.  Dropped: upstream recomputes
    # the norm on every gathered read, exactly as it did unpatched.
    value.__dict__.pop("_dora_cache", None)


def magnitude_reader_seam(module, attr):
    """Seam for axolotl's ``get_lora_parameters(proj)`` / ``get_embedding_lora_parameters(embed)``."""
    from ..core import calls

    return calls.before_each_call(module, attr, "a LoRA layer", gather_magnitude)
