"""Read an FSDP2-sharded parameter outside its own module's forward, correctly.

verl's fused-kernel forwards hand ``self.lm_head.weight`` straight to a
kernel instead of calling ``self.lm_head(...)``.  When ``lm_head`` is its own
FSDP2 unit (verl >= 0.7.1, untied), that weight is a sharded ``DTensor`` at
that point.  Reading it raw crashes (mixed Tensor/DTensor); the tempting fix,
``weight.full_tensor()``, runs but its backward only *slices* the gradient,
so each rank keeps its own micro-batch gradient and the data-parallel
average never happens (verl 0.9.x Qwen3-VL, verl issue #4756 / PR #6659).

Mechanism chosen: unshard the owning FSDP unit (``owner.unshard()``), i.e. do
exactly what FSDP2 does in that unit's own forward pre-hook, then read the
attribute.  Why this rather than ``full_tensor(grad_placements=Partial("avg"))``:
- the value is FSDP's own unsharded parameter, so it already has the
  mixed-precision ``param_dtype`` and lives on the compute device, and the
  all-gather moves ``param_dtype`` bytes (half of an fp32 ``full_tensor``);
- the gradient lands on FSDP's unsharded parameter, and FSDP's root
  post-backward callback (which runs ``post_backward`` for every group that
  did not finish backward) reduce-scatters it with the unit's own settings:
  average over every data-parallel mesh dimension (FSDP and HSDP alike),
  ``reduce_dtype``, gradient-accumulation and ``set_requires_gradient_sync``
  flags, CPU offload: the same reduction FSDP performs when the weight is
  used through ``owner(...)``;
- nothing of upstream's math is re-implemented.

The unit stays unsharded until that callback reshards it after backward,
just as a unit whose forward ran with ``reshard_after_forward=False``.  When
autograd is off (rollout log-probs under ``no_grad``), ``gathered`` reshards
on exit instead.

Refused, with ``GatherError``: a sharded parameter whose module is not an
FSDP2 unit, one that unit does not manage, and one that is still a DTensor
after unsharding (FSDP + tensor parallel: its full value is not ours to build).

The forward wrappers also warn, once per model class, when verl's text-only
``dense_common`` forward is handed images or audio (GLM-4.5V / 4.6V with fused
kernels): that forward drops them, an upstream limitation left unchanged.

Upstream: verl issue #4756, PR #6659.
Fails safe: the forward wrappers are installed only on fingerprinted releases
of verl's fused forwards; where ``lm_head`` is not sharded (its weight is a
plain tensor: no FSDP, or ``lm_head`` in the root unit) they change nothing.
Delete when: verl's fused forwards read ``lm_head.weight`` through FSDP (or
with an averaged gradient) in every release you run.
"""

import contextlib


class GatherError(RuntimeError):
    """The parameter cannot be gathered safely; the message says why and what to do."""


def _is_dtensor(value):
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def gather_param(owner, name="weight"):
    """Return ``getattr(owner, name)`` ready to use outside ``owner.forward``.

    A plain tensor (not sharded, or ``owner`` already unsharded) is returned
    untouched.  A sharded DTensor parameter of an FSDP2 unit is unsharded
    through FSDP (see the module docstring) and the full, ``param_dtype``
    tensor on the compute device is returned; its gradient reaches the shard
    averaged over the data-parallel ranks.
    """
    value = getattr(owner, name)
    if not _is_dtensor(value):
        return value
    from torch.distributed.fsdp import FSDPModule

    where = "%s.%s" % (type(owner).__name__, name)
    if not isinstance(owner, FSDPModule):
        raise GatherError(
            "%s is a sharded DTensor but %s is not an FSDP2 unit (fully_shard), so its "
            "owner cannot be unsharded here; gather through the FSDP unit that owns it, "
            "or wrap the module that reads it." % (where, type(owner).__name__)
        )
    group = owner._get_fsdp_state()._fsdp_param_group
    if group is None or not any(fp.sharded_param is value for fp in group.fsdp_params):
        raise GatherError(
            "%s is a DTensor that %s's own FSDP2 group does not manage (tensor "
            "parallel or another unit); fsdp2-compat only gathers FSDP-managed "
            "parameters." % (where, type(owner).__name__)
        )
    owner.unshard()
    value = getattr(owner, name)
    if _is_dtensor(value):
        raise GatherError(
            "%s is still a DTensor after unsharding (FSDP combined with tensor "
            "parallelism: placements %s); fsdp2-compat does not gather across "
            "tensor-parallel meshes." % (where, value.placements)
        )
    return value


@contextlib.contextmanager
def gathered(owner, name="weight"):
    """``with gathered(model.lm_head): ...``: reads of ``owner.<name>`` inside see the full weight.

    Reshards on exit when autograd was off (no backward will); otherwise
    FSDP's post-backward reshards after reducing the gradient.
    """
    import torch

    was_sharded = _is_dtensor(getattr(owner, name))
    value = gather_param(owner, name)
    grad_enabled = torch.is_grad_enabled()
    try:
        yield value
    finally:
        if was_sharded and not grad_enabled:
            owner.reshard()


# Inputs verl's text-only fused forward (dense_common) swallows into **loss_kwargs.
_MEDIA_INPUTS = ("pixel_values", "pixel_values_videos", "input_features")
_warned_media = set()


def _warn_dropped_media(model, kwargs):
    """Say once per model class that verl's text-only fused forward ignores its images.

    verl installs ``dense_common``'s fused forward on every model type it has no
    dedicated forward for, vision-language ones included (GLM-4.5V / 4.6V,
    ``glm4v_moe`` / ``glm46v``).  That forward never passes ``pixel_values`` on,
    so the model trains on the text alone, silently.  Not an FSDP2 bug and not
    ours to change; a warning is the honest help (use ``use_fused_kernels=False``).
    Called only for ``dense_common``'s forwards (decided once, at wrap time).
    """
    given = [k for k in _MEDIA_INPUTS if kwargs.get(k) is not None]
    cls = type(model).__name__
    if given and cls not in _warned_media:
        import warnings

        _warned_media.add(cls)
        warnings.warn(
            "fsdp2-compat: verl's text-only fused forward (dense_common) is installed on %s and ignores %s: "
            "the model trains without its images/audio. Set use_fused_kernels=False for this model "
            "(an upstream verl limitation; fsdp2-compat only fixes the lm_head read)." % (cls, ", ".join(given)),
            UserWarning,
            stacklevel=3,
        )


def wrap_lm_head_reader(original):
    """Wrap a forward ``f(self, ...)`` that reads ``self.lm_head.weight`` directly."""
    import wrapt

    drops_media = getattr(original, "__module__", "").endswith(".dense_common")

    def forward(wrapped, instance, args, kwargs):
        model = instance if instance is not None else (args[0] if args else None)
        if drops_media:
            _warn_dropped_media(model, kwargs)
        lm_head = getattr(model, "lm_head", None)
        if lm_head is None:
            return wrapped(*args, **kwargs)
        with gathered(lm_head):
            return wrapped(*args, **kwargs)

    return wrapt.FunctionWrapper(original, forward)


def lm_head_reader_seam(module, attr):
    """Seam for verl's ``forward_with_{torch,triton}_backend`` functions."""
    return {attr: wrap_lm_head_reader(module.__dict__[attr])}
