"""Read an FSDP2-sharded parameter outside its own module's forward, correctly.

verl's fused-kernel forwards hand ``self.lm_head.weight`` straight to a kernel instead of calling
``self.lm_head(...)``.  When ``lm_head`` is its own FSDP2 unit (verl >= 0.7.1, untied), that weight is a
sharded ``DTensor`` there: read raw it crashes (mixed Tensor/DTensor); ``weight.full_tensor()`` runs, but its
backward only *slices* the gradient, so each rank keeps its own micro-batch gradient and the data-parallel
average never happens (verl 0.9.x Qwen3-VL, verl issue #4756 / PR #6659).

Mechanism: unshard the owning FSDP unit (``owner.unshard()``, what its own forward pre-hook does), then read
the attribute.  The value is FSDP's unsharded parameter (``param_dtype``, compute device; the all-gather moves
``param_dtype`` bytes), and its gradient is reduced by the unit's own ``FSDPParamGroup.post_backward`` with the
unit's settings (average over every data-parallel mesh dimension, ``reduce_dtype``, deferred sync, offload):
nothing of upstream's math is re-implemented.  With autograd on, the unit is released as soon as the weight's
gradient is complete (a post-accumulate-grad hook on the unsharded parameter calls the group's
``post_backward()`` when every trainable parameter of an otherwise idle unit was read this way: ``lm_head``),
before the decoder layers' backward; FSDP's root post-backward callback stays the fallback (a unit that also
holds parameters used by module forwards, a read autograd never uses).  Under ``no_grad`` ``gathered``
reshards on exit.  Not supported: ``retain_graph=True`` backward through a released unit; mixing ``owner(x)``
and a raw read of the same unit in one graph (unsafe in FSDP itself).  docs/how-it-works.md has the details.

Refused, with ``GatherError``: a sharded parameter whose module is not an FSDP2 unit, one that unit does not
manage, one still a DTensor after unsharding (FSDP + TP).  The forward wrappers also warn, once per model
class, when verl's text-only ``dense_common`` forward drops images or audio (GLM-4.5V / 4.6V; upstream's).

Ulysses SP labels (verl 0.6.0-0.7.1; 0.8.0 passes ``shift_labels``, PR #6268): the forwards without that
parameter roll ``labels or input_ids`` as their callers pass them, a VLM's full padded sequence (hidden states
sliced after the embedding: every SP rank uses SP rank 0's labels) or a text shard (its last label wrong),
silently.  Inside the callers ``sp_caller_seam`` wraps (fingerprinted: they pad and slice as
``_global_labels`` assumes) the forward gets ``labels`` whose own roll is this rank's slice of the global roll.

Fails safe: the wrappers are installed only on fingerprinted releases; where ``lm_head`` is not sharded they
change nothing.  Delete when: verl's fused forwards read ``lm_head.weight`` through FSDP (or with an averaged
gradient) and take SP-sliced labels in every release you run.
"""

import contextlib
import threading
import weakref

# group -> ids of its FSDPParams read with autograd on whose gradient is not complete yet
_PENDING = weakref.WeakKeyDictionary()
# group -> ids of every FSDPParam read with autograd on since the group was last released
_READ = weakref.WeakKeyDictionary()
# FSDPParam -> (weak reference to the unsharded parameter the hook is on, hook handle)
_HOOKED = weakref.WeakKeyDictionary()
# how many units were released early by the hook (tests and benchmarks read it)
STATS = {"early_releases": 0}


class GatherError(RuntimeError):
    """The parameter cannot be gathered safely; the message says why and what to do."""


def _is_dtensor(value):
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _groups(state):
    groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13+: several per state
    if groups is None:
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return groups


def _owning(owner, value):
    """``(group, FSDPParam)`` of ``owner``'s FSDP2 state that manages the sharded ``value``."""
    for group in _groups(owner._get_fsdp_state()):
        for fsdp_param in group.fsdp_params:
            if fsdp_param.sharded_param is value:
                return group, fsdp_param
    return None, None


def _release_when_complete(group, fsdp_param):
    """Arm the post-accumulate-grad hook of ``fsdp_param``'s unsharded parameter (once per object)."""
    param = fsdp_param._unsharded_param
    hooked = _HOOKED.get(fsdp_param)
    if hooked is None or hooked[0]() is not param:
        group_ref, fsdp_param_ref = weakref.ref(group), weakref.ref(fsdp_param)

        def gradient_complete(_param):
            g, fp = group_ref(), fsdp_param_ref()
            pending = _PENDING.get(g) if g is not None else None
            if not pending or fp is None or id(fp) not in pending:
                return  # not read through gather_param in this graph: FSDP's own hooks own it
            pending.discard(id(fp))
            if pending:
                return  # another gathered parameter of the group still owes its gradient
            del _PENDING[g]
            read = _READ.pop(g, set())
            if g._training_state.name != "IDLE" or any(
                    id(other) not in read and other.sharded_param.requires_grad for other in g.fsdp_params):
                # The unit's own forward ran in this graph (FSDP's hooks own its post-backward), or it
                # holds parameters used elsewhere (a tail unit with the final norm): releasing it now
                # would free weights their backward still needs.  FSDP's root callback releases it.
                return
            STATS["early_releases"] += 1
            g.post_backward()  # the call RegisterPostBackwardFunction makes for owner(x)

        _HOOKED[fsdp_param] = (weakref.ref(param), param.register_post_accumulate_grad_hook(gradient_complete))
    _PENDING.setdefault(group, set()).add(id(fsdp_param))
    _READ.setdefault(group, set()).add(id(fsdp_param))


def gather_param(owner, name="weight"):
    """Return ``getattr(owner, name)`` ready to use outside ``owner.forward``.

    A plain tensor (not sharded, or ``owner`` already unsharded) is returned
    untouched.  A sharded DTensor parameter of an FSDP2 unit is unsharded
    through FSDP (see the module docstring) and the full, ``param_dtype``
    tensor on the compute device is returned; its gradient reaches the shard
    averaged over the data-parallel ranks, and with autograd on the unit is
    released as soon as that gradient is complete.
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
    group, fsdp_param = _owning(owner, value)
    if group is None:
        raise GatherError(
            "%s is a DTensor that %s's own FSDP2 group does not manage (tensor "
            "parallel or another unit); fsdp2-compat only gathers FSDP-managed "
            "parameters." % (where, type(owner).__name__)
        )
    return _unshard_then_read(owner, owner, name, group, fsdp_param, where)


def _unshard_then_read(unit, owner, name, group, fsdp_param, where):
    """Unshard ``unit`` (the FSDP2 unit whose ``group`` manages ``owner.<name>``) and return the full value."""
    import torch

    unit.unshard()
    value = getattr(owner, name)
    if _is_dtensor(value):
        raise GatherError(
            "%s is still a DTensor after unsharding (FSDP combined with tensor "
            "parallelism: placements %s); fsdp2-compat does not gather across "
            "tensor-parallel meshes." % (where, value.placements)
        )
    if torch.is_grad_enabled() and value.requires_grad and value is fsdp_param._unsharded_param:
        _release_when_complete(group, fsdp_param)
    return value


def gather_enclosed(owner, name="weight"):
    """``gather_param`` for a module that is not a unit itself: its parameter is managed by an enclosing
    FSDP2 unit (``lm_head`` in the root unit, resharded after forward).  That unit is unsharded, as its own
    forward pre-hook would; a unit that holds other parameters is released by FSDP's own post-backward (the
    early release above only fires for a unit every trainable parameter of which was read this way).

    Before the first forward (FSDP initialises its units lazily there) the value is returned as it is:
    unsharding an uninitialised root unit leaves the optimizer's parameters apart from what later
    all-gathers read (measured: the root's parameters off after the first step)."""
    from torch.distributed.fsdp import FSDPModule

    from .units import live_units

    value = getattr(owner, name)
    if not _is_dtensor(value) or isinstance(owner, FSDPModule):
        return gather_param(owner, name)
    where = "%s.%s" % (type(owner).__name__, name)
    for unit, _state in live_units():
        group, fsdp_param = _owning(unit, value)
        if group is not None:
            if unit._get_fsdp_state()._is_root is None:  # no forward ran through the root yet
                return value
            return _unshard_then_read(unit, owner, name, group, fsdp_param, where)
    raise GatherError(
        "%s is a sharded DTensor that no live FSDP2 unit manages (tensor parallel, or a "
        "distributed tensor of its own); fsdp2-compat only gathers FSDP-managed parameters." % where
    )


@contextlib.contextmanager
def gathered(owner, name="weight"):
    """``with gathered(model.lm_head): ...``: reads of ``owner.<name>`` inside see the full weight.

    Reshards on exit when autograd was off (no backward will); otherwise
    the unit's own post-backward reduces the gradient and reshards, as soon
    as the weight's gradient is complete (see the module docstring).
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
    """Wrap a forward ``f(self, ...)`` that reads ``self.lm_head.weight`` directly (and, without a
    ``shift_labels`` parameter, rolls its labels itself: ``_global_labels`` inside an SP caller)."""
    import wrapt

    from ..core import calls

    drops_media = getattr(original, "__module__", "").endswith(".dense_common")
    signature = calls.Signature(original)
    rolls_locally = "shift_labels" not in signature._known and "labels" in signature._known

    def forward(wrapped, instance, args, kwargs):
        model = signature.receiver(instance, args, kwargs)
        if drops_media:
            _warn_dropped_media(model, kwargs)
        lm_head = getattr(model, "lm_head", None)
        if lm_head is None:
            calls.missing(signature.where, "a model with an lm_head (got %s)" % type(model).__name__)
            return wrapped(*args, **kwargs)
        if rolls_locally and getattr(_SP_CALLER, "depth", 0):
            args, kwargs = _global_labels(model, signature, instance, args, kwargs)
        with gathered(lm_head):
            return wrapped(*args, **kwargs)

    return wrapt.FunctionWrapper(original, forward)


_SP_CALLER = threading.local()


def _global_labels(model, signature, instance, args, kwargs):
    """``(args, kwargs)`` with ``labels`` whose roll by -1 is this SP rank's slice of the global roll: a VLM's
    full sequence rolled and sliced (verl's ``slice_input_tensor``); a text shard's last label the next rank's
    first token (one all-gather of one token per row: every SP rank runs this forward, as the callers do)."""
    import torch
    from verl.utils import ulysses

    sp = ulysses.get_ulysses_sequence_parallel_world_size()
    labels = signature.argument("labels", instance, args, kwargs)
    source = labels if labels is not None else signature.argument("input_ids", instance, args, kwargs)
    if sp <= 1 or source is None or source.size(0) != 1:  # SP runs on verl's packed (1, tokens) layout only
        return args, kwargs
    if hasattr(model.config, "vision_config"):  # the callers' own test: a VLM is handed the full sequence
        local = ulysses.slice_input_tensor(torch.roll(source, -1, -1), dim=-1, padding=False)
    else:
        firsts = [torch.empty_like(source[..., :1]) for _ in range(sp)]
        group = ulysses.get_ulysses_sequence_parallel_group()
        torch.distributed.all_gather(firsts, source[..., :1].contiguous(), group=group)
        local = torch.cat([source[..., 1:], firsts[(ulysses.get_ulysses_sequence_parallel_rank() + 1) % sp]], -1)
    index = signature._index.get("labels", -1) - (instance is not None)
    if 0 <= index < len(args):
        return args[:index] + (torch.roll(local, 1, -1),) + args[index + 1:], kwargs
    return args, dict(kwargs, labels=torch.roll(local, 1, -1))


def sp_caller_seam(module, attr):
    """Seam for verl 0.6.0-0.7.1's Ulysses callers of the fused forwards: marks the call (see the docstring)."""
    import wrapt

    from ..core import calls

    def call(wrapped, instance, args, kwargs):
        _SP_CALLER.depth = getattr(_SP_CALLER, "depth", 0) + 1
        try:
            return wrapped(*args, **kwargs)
        finally:
            _SP_CALLER.depth -= 1

    return {attr: wrapt.FunctionWrapper(calls.lookup(module, attr), call)}


def lm_head_reader_seam(module, attr):
    """Seam for verl's ``forward_with_{torch,triton}_backend`` functions."""
    return {attr: wrap_lm_head_reader(module.__dict__[attr])}
