"""accelerate's FSDP2 tail unit: the output head shares a unit with the module whose forward unshards it.

accelerate's ``fsdp2_prepare_model`` (1.14.0+) carves the model's end into
one unit, ``fully_shard([final_norm, head...], reshard_after_forward=False)``:
the norm's forward pre-hook all-gathers the unit just before the head is
used, and because the unit is not resharded after forward, ``lm_head.weight``
stays a full tensor for the rest of the forward.  Any code that reads the
weight directly inside the model's forward (Liger-Kernel's fused linear
cross-entropy, ``use_liger_kernel=True`` in the HF Trainer and axolotl; TRL's
fused LM head; custom losses) then reads FSDP's unsharded parameter, and
FSDP's own post-backward averages its gradient.  Two releases get the unit
wrong:

1. ``prepare_model_seam`` (1.14.0 only, accelerate PR #4015): for *tied*
   weights the unit is ``[final_norm, input_embed]`` and the head is left in
   the root unit, so one parameter belongs to two FSDP groups.  torch 2.13
   refuses it at the first forward (``ValueError: Parameter
   'model.embed_tokens.weight' is shared with a parameter already managed by
   another FSDP group``); older torches silently untie the two.  The seam
   wraps ``fsdp2_prepare_model`` and, during that call only, the
   ``fully_shard`` it imports from ``torch.distributed.fsdp``: the one call
   whose module list holds the tied input embedding and not the head gets the
   head appended, which is exactly 1.15.0's unit (PR #4171: ``[final_norm,
   input_embed, output_embed]``).  Every other ``fully_shard`` call, and every
   call outside a tied preparation (other threads included: the plan is a
   context variable), goes to torch unchanged with upstream's arguments.
2. ``final_norm_seam`` (1.14.0-1.15.0): ``_find_final_norm`` scans only the
   base model's direct children.  A vision-language model's base
   (``visual``, ``language_model``) has no norm there, so the unit is
   ``[lm_head]`` alone, its forward never runs when the head is read
   directly, and the reader gets a sharded ``DTensor``: ``aten.mm.default
   got mixed torch.Tensor and DTensor``, or with ``full_tensor()`` a gradient
   that is each rank's own (never averaged).  The seam runs upstream's
   function and, only when it found nothing, returns the last norm among the
   direct children of the decoder (``model.get_decoder()``, else a
   ``language_model`` attribute): the rule accelerate applies to text
   models, applied to the text model inside the VLM.  The decoder's norm runs
   right before the head, as the base model's norm does in a text model.

Fails safe: a norm that already lives in another unit (an ancestor was
sharded, or it was itself) is not offered; a model without a decoder, or a
decoder without a norm, keeps upstream's answer; where the weights are untied
the prepare seam calls upstream's function untouched.  Both seams are
installed only on fingerprinted code (``fsdp2_compat.integrations.accelerate``).

Upstream: accelerate PR #4015 (the tail unit), PR #4171 (tied fix, 1.15.0);
the VLM norm has no accelerate issue yet.  Delete when every accelerate you
run is >= 1.15.0 and finds a VLM decoder's final norm.
"""

import contextvars
import threading

# During a tied 1.14.0 preparation: (input embedding, output embedding) of the model being prepared.
_tied = contextvars.ContextVar("fsdp2_compat_tied_tail", default=None)
_swap_lock = threading.Lock()
_swapped = {"depth": 0, "torch": None}  # tied preparations in progress; torch's fully_shard meanwhile


def _is_norm(module):
    return "Norm" in type(module).__name__  # accelerate's own test in _find_final_norm


def decoder_of(model):
    """The text decoder of ``model`` (``get_decoder()``, else ``language_model``), or None."""
    import torch.nn as nn

    get = getattr(model, "get_decoder", None)
    try:
        decoder = get() if callable(get) else None
    except Exception:  # some remote-code models raise instead of returning None
        decoder = None
    if not isinstance(decoder, nn.Module):
        for owner in (model, getattr(model, getattr(model, "base_model_prefix", "") or "_", None)):
            decoder = getattr(owner, "language_model", None) if owner is not None else None
            if isinstance(decoder, nn.Module):
                break
    return decoder if isinstance(decoder, nn.Module) else None


def _inside_a_unit(model, module):
    """True when ``module`` or one of its ancestors below ``model`` is already an FSDP2 unit."""
    from torch.distributed.fsdp import FSDPModule

    for name, candidate in model.named_modules():
        if candidate is module:
            parts = name.split(".") if name else []
            return any(isinstance(model.get_submodule(".".join(parts[:i])), FSDPModule)
                       for i in range(1, len(parts) + 1))
    return True  # not in the model at all: never offer it


def decoder_norm(model):
    """The final norm of ``model``'s decoder that may join the tail unit, or None."""
    decoder = decoder_of(model)
    if decoder is None:
        return None
    norm = None
    for _, child in decoder.named_children():
        if _is_norm(child):
            norm = child
    if norm is None or _inside_a_unit(model, norm):
        return None
    return norm


def final_norm_seam(module, attr):
    """Seam for ``accelerate.utils.fsdp_utils:_find_final_norm``."""
    import wrapt

    def find_final_norm(wrapped, instance, args, kwargs):
        found = wrapped(*args, **kwargs)
        if found is not None:
            return found
        model = args[0] if args else kwargs.get("model")
        return decoder_norm(model) if model is not None else None

    return {attr: wrapt.FunctionWrapper(module.__dict__[attr], find_final_norm)}


def tied_embeddings(model):
    """``(input, output)`` embedding modules when they share their weight (``selection``'s rule), else None."""
    from .selection import _call_optional, embeddings_tied, input_embedding

    if not embeddings_tied(model):
        return None
    return input_embedding(model), _call_optional(model, "get_output_embeddings")


def _tail_call(wrapped, instance, args, kwargs):
    """``fully_shard`` while a tied preparation runs: the tail list gets the head as well."""
    plan = _tied.get()
    modules = args[0] if args else kwargs.get("module")
    if plan is None or not isinstance(modules, (list, tuple)):
        return wrapped(*args, **kwargs)
    embed, head = plan
    if any(m is embed for m in modules) and not any(m is head for m in modules):
        modules = list(modules) + [head]
        if args:
            args = (modules,) + tuple(args[1:])
        else:
            kwargs = dict(kwargs, module=modules)
    return wrapped(*args, **kwargs)


def _install_tail_call():
    import torch.distributed.fsdp as fsdp
    import wrapt

    with _swap_lock:
        if _swapped["depth"] == 0:
            _swapped["torch"] = fsdp.__dict__["fully_shard"]
            fsdp.fully_shard = wrapt.FunctionWrapper(_swapped["torch"], _tail_call)
        _swapped["depth"] += 1


def _remove_tail_call():
    import torch.distributed.fsdp as fsdp

    with _swap_lock:
        _swapped["depth"] -= 1
        if _swapped["depth"] == 0:
            current = fsdp.__dict__.get("fully_shard")
            if getattr(current, "__wrapped__", None) is _swapped["torch"]:  # still ours: restore torch's
                fsdp.fully_shard = _swapped["torch"]
            _swapped["torch"] = None


def prepare_model_seam(module, attr):
    """Seam for ``accelerate.utils.fsdp_utils:fsdp2_prepare_model`` (1.14.0: the tied head in the root)."""
    import torch.distributed.fsdp as fsdp
    import wrapt

    from ..core.guards import Drift

    if not callable(fsdp.__dict__.get("fully_shard")):
        raise Drift("torch.distributed.fsdp has no fully_shard (torch < 2.6?)")

    def prepare(wrapped, instance, args, kwargs):
        model = args[1] if len(args) > 1 else kwargs.get("model")
        tied = tied_embeddings(model) if model is not None else None
        if tied is None:
            return wrapped(*args, **kwargs)
        token = _tied.set(tied)
        _install_tail_call()
        try:
            return wrapped(*args, **kwargs)
        finally:
            _remove_tail_call()
            _tied.reset(token)

    return {attr: wrapt.FunctionWrapper(module.__dict__[attr], prepare)}
