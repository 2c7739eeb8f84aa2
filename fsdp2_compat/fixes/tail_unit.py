"""The FSDP2 tail unit (accelerate's, transformers' native): the output head shares a unit with the module whose
forward unshards it.

accelerate's ``fsdp2_prepare_model`` (1.14.0+) shards the model's end as one unit, ``fully_shard([final_norm,
head...], reshard_after_forward=False)``: the norm's pre-hook all-gathers it just before the head is used and it stays
full for the rest of the forward, so code that reads ``lm_head.weight`` inside the forward (Liger-Kernel's fused
linear cross-entropy, TRL's fused head, custom losses) reads FSDP's unsharded parameter and FSDP averages its
gradient. Three seams fix the releases that get the unit wrong:

1. ``prepare_model_seam`` (accelerate 1.14.0 only, PR #4015): tied weights give ``[final_norm, input_embed]`` and
   leave the head in the root unit, one parameter in two groups (torch 2.13: ``ValueError: Parameter
   'model.embed_tokens.weight' is shared with a parameter already managed by another FSDP group``; older torches
   untie silently). During that call only (a context variable: other threads untouched), the ``fully_shard`` it
   imports gets the head appended to the one call holding the tied input embedding: 1.15.0's unit (PR #4171).
2. ``final_norm_seam`` (1.14.0-1.15.0): ``_find_final_norm`` scans only the base model's direct children; a VLM's
   base (``visual``, ``language_model``) has no norm there, the unit is ``[lm_head]`` alone, its forward never runs
   when the head is read directly: ``aten.mm.default got mixed torch.Tensor and DTensor``, or with ``full_tensor()``
   each rank's own gradient. When upstream finds nothing, the seam returns the last norm among the decoder's direct
   children (``get_decoder()``, else ``language_model``): accelerate's text-model rule, applied inside the VLM.
3. ``native_apply_seam`` (transformers 5.15.0+ native FSDP2): ``apply_fully_sharded_data_parallelism`` pairs a kept
   head with the final norm only when that is called ``norm``; Phi (``final_layernorm``), dbrx, jamba, lfm2 keep
   the head alone (2's bug). Its module-global ``fully_shard`` is wrapped during that call and the lone-head call
   with ``reshard_after_forward=False`` shards ``[decoder_norm(model), head]``. A head a user plan frees, or a tied
   head, is left as transformers shards it.

Fails safe: a norm already in another unit is not offered; no decoder or no norm keeps upstream's answer; untied
weights call upstream's prepare untouched; every seam is installed only on fingerprinted code
(``integrations.accelerate``, ``integrations.transformers_fsdp``).

Upstream: accelerate PR #4015 (the tail unit), PR #4171 (tied fix, 1.15.0); no upstream issue yet for the VLM norm
nor transformers' lone head. Delete when every accelerate you run is >= 1.15.0 and finds a VLM decoder's final norm,
and transformers pairs any final norm with a kept head.
"""

import contextlib
import contextvars
import threading

# While a seam's call runs: how a ``fully_shard(modules, **kwargs)`` call is rewritten (None: unchanged).
_rewrite = contextvars.ContextVar("fsdp2_compat_tail_rewrite", default=None)
_swap_lock = threading.Lock()
_swapped = {}  # namespace module name -> [calls in progress, the fully_shard it held before]
STATS = {"native_pairs": 0}  # transformers' lone heads given their decoder's norm (tests read it)


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
    """``fully_shard`` while a seam's call runs: the module list the context's rule returns, if any."""
    rule = _rewrite.get()
    modules = args[0] if args else kwargs.get("module")
    modules = rule(modules, kwargs) if rule is not None else None
    if modules is None:
        return wrapped(*args, **kwargs)
    if args:
        return wrapped(modules, *args[1:], **kwargs)
    return wrapped(*args, **dict(kwargs, module=modules))


@contextlib.contextmanager
def _tail_calls(namespace, rule):
    """During the block, ``namespace.fully_shard`` rewritten by ``rule`` in this context (others: unchanged)."""
    import wrapt

    token = _rewrite.set(rule)
    with _swap_lock:
        entry = _swapped.setdefault(namespace.__name__, [0, None])
        if entry[0] == 0:
            entry[1] = namespace.__dict__["fully_shard"]
            namespace.fully_shard = wrapt.FunctionWrapper(entry[1], _tail_call)
        entry[0] += 1
    try:
        yield
    finally:
        with _swap_lock:
            entry[0] -= 1
            if entry[0] == 0:
                if getattr(namespace.__dict__.get("fully_shard"), "__wrapped__", None) is entry[1]:
                    namespace.fully_shard = entry[1]  # still ours: give the original back
                entry[1] = None
        _rewrite.reset(token)


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
        embed, head = tied

        def rule(modules, _kwargs):  # the tail list [norm, embed] gets the head as well
            if isinstance(modules, (list, tuple)) and any(m is embed for m in modules) \
                    and not any(m is head for m in modules):
                return list(modules) + [head]
            return None

        with _tail_calls(fsdp, rule):
            return wrapped(*args, **kwargs)

    return {attr: wrapt.FunctionWrapper(module.__dict__[attr], prepare)}


def native_apply_seam(module, attr):
    """Seam for ``transformers.distributed.fsdp:apply_fully_sharded_data_parallelism`` (a lone kept head)."""
    import wrapt

    from ..core.guards import Drift

    if not callable(module.__dict__.get("fully_shard")):
        raise Drift("%s has no module-global fully_shard" % module.__name__)

    def apply(wrapped, instance, args, kwargs):
        from .selection import _call_optional

        model = args[0] if args else kwargs.get("model")
        head = None if tied_embeddings(model) else _call_optional(model, "get_output_embeddings")  # tied: as is

        def rule(modules, kwargs_):  # the head alone, kept through the forward: shard [final norm, head]
            if head is None or modules is not head or kwargs_.get("reshard_after_forward") is not False:
                return None
            norm = decoder_norm(model)
            if norm is None:
                return None
            STATS["native_pairs"] += 1
            return [norm, head]

        with _tail_calls(module, rule):
            return wrapped(*args, **kwargs)

    return {attr: wrapt.FunctionWrapper(module.__dict__[attr], apply)}
