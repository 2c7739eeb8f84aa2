"""Mixed text/image micro-batches across data-parallel ranks: every rank runs the media tower's collectives.

The bug (FSDP2's third class; TRL #3934, miles #2406, torchtitan #4777): a transformers forward runs the vision
tower only when its micro-batch has media, so a text-only rank skips every vision unit's all-gather (and the
enclosing unit reduce-scatters fewer gradients) while an image rank issues them: NCCL hangs, gloo aborts ("Received
data size doesn't match expected size").

The fix: on a micro-batch without media, the model's own media path runs on a minimal dummy (per tower kind in
``media_towers``, which says why each dummy is valid) right where the real one runs, after the token embedding, and
``0 * sum(every floating output)`` joins the input embeddings: the same collectives in the same order as an image
rank, an exact zero in every gradient (what verl's own forwards do, "handle mixed text-image data").  From a
model's second text-only micro-batch on, ``unit_walk`` issues the recorded dummy's collectives without the tower's
code (a GPU tower call costs latency, not FLOPs: ``benchmarks/text_only_cost.py``, ``benchmarks/gpu_check.py``).

The seam is the transformers base model's ``forward`` (targets in ``integrations.transformers_media``): the one
function every trainer calls whatever wraps the model, where the tower is skipped (``get_image_features`` is never
called on text).  verl's ``apply_monkey_patch`` replaces it with its own forward, which runs its own dummy: ours is
then off the class (``needed_for``). lmms-engine's ``use_rmpad`` forwards replace it without one: the same wrapper
goes on lmms-engine's function before it is assigned.  For one call the wrapper hooks the token embedding the
forward calls first and adds the zero to its output (to ``inputs_embeds`` when the caller passes them).  It runs
only with more than one rank, no media, no cached decoding step, and a tower FSDP2 manages (units of its own or an
enclosing one).

A caller that runs the tower itself and passes ``inputs_embeds`` (ms-swift's Qwen2-VL templates) already keeps its
rank in the collectives: a forward hook counts the tower's calls outside backward, and such a micro-batch gets no
dummy when the tower ran since the model's previous forward returned (uniform from a model's second micro-batch
on).  Images *and* videos on one rank: one tower call for both (``media_merge``).  Step-3.7 / DeepSeek-OCR-2 run
the tower again for local crops: a micro-batch without crops runs a dummy crop (``Tower.pad``). GLM-Image runs its
tower and VQ tokenizer before the embedding: its dummy runs at the forward's entry and adds nothing
(``Tower.first``), and a media micro-batch tokenizes its images in one call (``Tower.around``, ``vq_tokens``).

By design (verl's forwards too): on a step where every rank is text-only the tower gets exact-zero gradients
instead of none (AdamW then updates it as on any step where another rank's image reached it).  Fails safe: targets
are fingerprinted per transformers release; a model whose tower or config ``media_towers`` does not know is left
alone with one warning per class naming why.  Details and proofs: docs/how-it-works.md.

Delete when: transformers (or every trainer you run) keeps every rank in the
vision tower's collectives on text-only micro-batches, or torch FSDP2 tolerates
a unit that one rank skips.
"""

import weakref

from . import media_merge, media_towers, unit_walk

# Inputs that carry media into a wrapped base model forward (every family; per family: media_towers).
MEDIA_INPUTS = media_towers.media_inputs()

# How many dummy vision forwards ran in this process, and how many were left out because the caller had
# already run the tower for the micro-batch (tests and benchmarks read them).
STATS = {"dummy_forwards": 0, "caller_ran_tower": 0}

_SHARDED = weakref.WeakKeyDictionary()  # tower -> True once found FSDP2-managed
_TOWER_CALLS = weakref.WeakKeyDictionary()  # tower -> [its forward calls outside backward, since counted]
_RETURNED_AT = weakref.WeakKeyDictionary()  # model -> its tower's call count when its last forward returned
_WARNED = set()


def _distributed_world():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def _enclosing_unit_manages(tower):
    """True when some ``fully_shard`` unit that contains ``tower`` (the root, say) manages its parameters."""
    from .units import live_units

    return any(any(sub is tower for sub in module.modules()) for module, _ in live_units())


def tower_is_sharded(tower):
    """True when FSDP2 manages parameters of ``tower``: units inside it, or a unit around it."""
    if _SHARDED.get(tower):
        return True
    from torch.distributed.fsdp import FSDPModule

    found = any(isinstance(m, FSDPModule) for m in tower.modules()) or _enclosing_unit_manages(tower)
    if found:
        _SHARDED[tower] = True
    return found


def _tower(model):
    return getattr(model, media_towers.for_model(model).attr, None)


def unknown_tower(model):
    """Why the dummy cannot be built for ``model`` (None when it can): ``media_towers.reason``."""
    return media_towers.reason(model)


def _warn_unknown(model, why):
    media_merge.warn_once(_WARNED, model, "fsdp2-compat: mixed text/image ranks: %%s is left alone (%s); a text-only "
                          "micro-batch on one rank and an image on another will stall its FSDP2 collectives"
                          % why.replace("%", "%%"))


def needed_for(model):
    """Whether a text-only micro-batch of ``model`` gets the dummy vision forward now, and why (a string).

    ``(True, "")`` or ``(False, reason)``: not distributed, the tower is not
    sharded, the class's forward is not ours (verl installed its own, which
    runs its own dummy), or the tower is unknown.
    """
    from ..core import engine

    forward = type(model).__dict__.get("forward")
    if forward is None or not engine.is_ours(forward):
        return False, "%s.forward is not fsdp2-compat's (verl's apply_monkey_patch installs its own, which runs its " \
                      "own dummy vision forward), or the patch is off" % type(model).__name__
    why = unknown_tower(model)
    if why:
        return False, why
    if _distributed_world() <= 1:
        return False, "torch.distributed is not initialised with more than one rank"
    if not tower_is_sharded(_tower(model)):
        return False, "no FSDP2 unit manages the vision tower"
    return True, ""


def zero_contribution(model, device, run=None):
    """``0 * sum(every floating output)`` of the model's own media path on its tower's minimal dummy
    (``media_towers``: one merged image token), a 0-dim tensor (or None: nothing of it needs a gradient).
    ``run``: another dummy run of the tower's (its ``pad``), instead of ``Tower.run``.  From the second
    training micro-batch of a model on, ``unit_walk`` issues the same collectives without the tower's code."""
    STATS["dummy_forwards"] += 1
    return unit_walk.zero(model, run or media_towers.for_model(model).run, device, _zero_of_output)


def _zero_of_output(out):
    total = None
    for t in unit_walk.floating(out):
        term = (t * 0).sum()
        total = term if total is None else total + term
    return total


def _with_zero(embeds, zero):
    return embeds if zero is None else embeds + zero.to(embeds.dtype)


def _decoding(past_key_values):
    """A cached decoding step (every rank decodes without media: nothing to align)."""
    get = getattr(past_key_values, "get_seq_length", None)
    try:
        return bool(get and get() > 0)
    except Exception:
        return False


_SIGNATURES = {}


def _bound(wrapped, bound_method, args, kwargs):
    """``inspect.signature(wrapped).bind_partial`` (cached per function; a bound method has no ``self``)."""
    import inspect

    key = (getattr(wrapped, "__func__", wrapped), bound_method)
    sig = _SIGNATURES.get(key)
    if sig is None:
        sig = _SIGNATURES[key] = inspect.signature(wrapped)
    return sig.bind_partial(*args, **kwargs)


def _count_tower_calls(tower):
    """The tower's call counter, installing its forward hook on first use (``None`` on that first use: the
    calls before it are unknown)."""
    calls = _TOWER_CALLS.get(tower)
    if calls is not None:
        return calls
    calls = _TOWER_CALLS[tower] = [0]

    def count(module, inputs, output):
        if not unit_walk.in_backward():  # a gradient checkpoint's recompute is no call of the caller's
            calls[0] += 1

    tower.register_forward_hook(count)
    return None


def caller_ran_tower(model):
    """True when ``model``'s tower ran (outside backward) since its previous forward returned: a caller that
    passes ``inputs_embeds`` ran it for this micro-batch."""
    tower = _tower(model)
    calls = _count_tower_calls(tower) if tower is not None else None
    returned_at = _RETURNED_AT.get(model)
    return calls is not None and returned_at is not None and calls[0] > returned_at


def _returned(model):
    tower = _tower(model) if not unknown_tower(model) else None
    if tower is None:
        return
    calls = _count_tower_calls(tower)
    if calls is not None:
        _RETURNED_AT[model] = calls[0]


def _forward(wrapped, instance, args, kwargs):
    """Around ``<Family>Model.forward(self, ...)``: a text-only micro-batch runs the dummy image path.

    Called through an instance, ``wrapped`` is bound; through the class
    (``Cls.forward(model, ...)``), ``self`` is ``args[0]``.
    """
    if instance is None and not args:
        return wrapped(*args, **kwargs)
    model = instance if instance is not None else args[0]
    if _distributed_world() <= 1:
        return wrapped(*args, **kwargs)
    try:
        return _distributed_forward(wrapped, instance, model, args, kwargs)
    finally:
        _returned(model)


def _distributed_forward(wrapped, instance, model, args, kwargs):
    try:
        bound = _bound(wrapped, instance is not None, args, kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)  # let transformers report the bad call
    given = bound.arguments
    extra = given.get("kwargs") or {}

    def arg(name):
        return given.get(name, extra.get(name))

    tower = media_towers.for_model(model)
    media = any(arg(n) is not None for n in tower.media)
    # transformers 5.24+: features computed before the call (the tower ran elsewhere: nothing to align here)
    media = media or bool(arg("mm_encoder_outputs"))
    cache = next((arg(n) for n in ("past_key_values", "cache") if arg(n) is not None), None)  # "cache": 5.24+
    both = media and media_merge.carries_both(model, tower, arg)
    if both and not unknown_tower(model) and tower_is_sharded(_tower(model)):
        with media_merge.one_tower_call(model, arg):  # images and videos: one tower call, as on every rank
            return wrapped(*args, **kwargs)
    if media and tower.around and not _decoding(cache) and not unknown_tower(model) \
            and tower_is_sharded(_tower(model)):
        with tower.around(model):  # (GLM-Image: one tokenizer call for every image, as the dummy makes)
            return wrapped(*args, **kwargs)
    # media without the optional input that makes the tower run once more (Step-3.7's crops): that call on a dummy
    pad = tower.pad if tower.pad and arg(tower.media[0]) is not None and arg(tower.pad[0]) is None else None
    if (media and pad is None) or _decoding(cache):
        return wrapped(*args, **kwargs)
    run = pad[1] if pad else None
    why = unknown_tower(model)
    if why:
        _warn_unknown(model, why)
        return wrapped(*args, **kwargs)
    if not tower_is_sharded(_tower(model)):
        return wrapped(*args, **kwargs)
    embeds = given.get("inputs_embeds")
    if tower.first:  # the tower runs before the embedding, and nothing of it reaches the loss: no zero to add
        ids = arg("input_ids")
        zero_contribution(model, (ids if ids is not None else embeds).device, run)
        return wrapped(*args, **kwargs)
    if embeds is not None:
        if run is None and caller_ran_tower(model):  # the caller ran the tower for this micro-batch itself
            STATS["caller_ran_tower"] += 1
            return wrapped(*args, **kwargs)
        given["inputs_embeds"] = _with_zero(embeds, zero_contribution(model, embeds.device, run))
        return wrapped(*bound.args, **bound.kwargs)
    done = []

    def add_zero(module, inputs, output):
        if done:
            return None
        done.append(True)
        return _with_zero(output, zero_contribution(model, output.device, run))

    handle = tower.embed(model).register_forward_hook(add_zero)
    try:
        return wrapped(*args, **kwargs)
    finally:
        handle.remove()


def forward_seam(module, attr):
    """Seam for ``<transformers model module>:<Family>Model.forward``, or for a module-level function a
    trainer assigns over it (lmms-engine's ``model_forward``: ``integrations.lmms_engine``); both take the
    model first."""
    import wrapt

    from ..core import calls

    return {attr: wrapt.FunctionWrapper(calls.lookup(module, attr), _forward)}
