"""Mixed text/image micro-batches across data-parallel ranks: every rank runs the media tower.

The bug (the third FSDP2 bug class; TRL issue #3934, miles #2406, torchtitan
#4777): FSDP2 all-gathers a unit's parameters in that unit's forward and
reduce-scatters its gradient in backward, and both are collectives every rank
must issue in the same order.  The frameworks give a VLM's vision blocks units
of their own (they are ``_no_split_modules`` layer classes), and the
transformers model forward runs the vision tower only when its micro-batch has
``pixel_values``.  When one rank's micro-batch is text-only and another's has
an image, the first skips every vision unit's all-gather: NCCL hangs until its
watchdog, gloo aborts ("Received data size doesn't match expected size").  Even
with no vision unit of its own, the enclosing unit reduce-scatters a shorter
gradient list on the text-only rank (its vision parameters have no gradient).

The fix: on a micro-batch without media, the model's own image path runs on a
minimal dummy image (zeros, one merged token: for the Qwen/GLM towers a
``[1, m, m]`` patch grid for spatial merge size ``m``; per tower kind in
``fixes.media_towers``, which says why each dummy is valid) and
``0 * sum(every floating output)`` is added to the input embeddings.  Every vision unit then all-gathers in forward and
reduce-scatters in backward exactly as on an image rank, in the same order
(the dummy runs right after the token embedding, where the real image path
runs, and it joins the graph at the input embeddings, as the real features
do), and it contributes an exact zero to every gradient, so the reduced
gradient is the data-parallel average of the real micro-batches.  This is
what verl's own model forwards do ("handle mixed text-image data" in
``verl/models/transformers/qwen2_vl.py``, ``qwen3_vl.py``, ``glm4v.py``).

Why the seam is the transformers base model's ``forward``
(``Qwen2_5_VLModel.forward`` and its siblings; targets in
``fsdp2_compat.integrations.transformers_media``): it is the one function
every trainer calls (TRL and the HF ``Trainer`` through accelerate, SkyRL's
``HFModelWrapper``, AReaL, LLaMA-Factory), whatever wraps the model, and it is
where the decision to skip the tower is made.  ``get_image_features`` is not
called at all on a text-only batch, and a hook installed where each framework
wraps the model would need one seam per framework.  verl replaces this
``forward`` with its own (``apply_monkey_patch``), which already runs the
dummy: there our wrapper is no longer on the class and does nothing (no second
dummy).  ``needed_for`` says so for a model instance.  lmms-engine's
``use_rmpad`` forwards replace it with their own too, *without* a dummy: there
the same wrapper is put on lmms-engine's function before it is assigned
(``integrations.lmms_engine``).

How, without re-implementing the forward: the wrapper (``wrapt``) leaves
transformers' code as released.  For the duration of one call it hooks the
token embedding module the forward calls first (``get_input_embeddings()``, or
the one ``media_towers`` names): the hook runs the dummy through the model's
own ``get_image_features`` and adds the zero to the embedding output.  A caller that passes ``inputs_embeds`` gets the zero added
to them before the call.  Cost: only when torch.distributed is initialised
with more than one rank, the micro-batch has no media, the call is not a
cached decoding step (every rank decodes without media), and the vision tower
holds FSDP2-sharded parameters (units of its own or an enclosing unit).  The
dummy's collectives are those of one image micro-batch.  Its compute is a few
patches through the tower, but on a GPU a tower call costs latency whatever
its input (per-block Python, launches, host syncs: 0.6 of an image step at
Qwen2.5-VL-7B geometry on an H200): so only a model's first text-only
micro-batch runs the real dummy, recorded, and every later one walks the
recorded units through FSDP2's own hooks without the tower's code
(``fixes.unit_walk``; ``benchmarks/text_only_cost.py`` times both).

A caller that runs the tower itself and passes ``inputs_embeds`` only (ms-swift's
Qwen2-VL / Qwen2.5-VL templates: image features, or a dummy image's for a
text-only sample, merged into the embeddings on every rank) already keeps every
rank in the tower's collectives; a dummy there would be a second tower call
per micro-batch (a second all-gather and reduce-scatter of every vision unit).
So a forward hook counts the tower's calls outside backward (a gradient
checkpoint's recompute is not a call), and a micro-batch with
``inputs_embeds`` and no media gets no dummy when the tower ran since this
model's previous forward returned: one tower call per micro-batch on every
rank, the caller's.  The decision is local and the outcome uniform: each rank
makes sure its tower ran exactly once for this micro-batch, whether the caller
ran it on every rank, on some, or on none.  The hook is installed at the first
distributed forward of a model whose tower is known, so that first micro-batch
runs the dummy as before (on every rank of an ms-swift-style caller alike);
a caller that runs the tower on *some* ranks only and passes ``inputs_embeds``
is uniform from its second micro-batch on.  Not counted as "this micro-batch":
a tower call by other code between two forwards of the model (its output
then never reaches this forward); such a caller must not rely on this.

A micro-batch with images *and* videos makes the Qwen forwards run the tower
twice (once per kind) where every other rank runs it once: on such a call the
wrapper hands it to ``fixes.media_merge`` (one tower call for both kinds).
Step-3.7's and DeepSeek-OCR-2's forwards run the tower a second time for local
crops: there every micro-batch runs it twice, a text-only one on a dummy view
and crop, one without crops on a dummy crop (``media_towers.Tower.pad``).
GLM-Image runs its tower and VQ tokenizer *before* the token embedding, and
only codebook ids reach the loss: its dummy runs at the forward's entry and
adds nothing (``Tower.first``), and a media micro-batch tokenizes all its
images in one call, as the dummy does (``Tower.around``, ``fixes.vq_tokens``).

Side effect, by design (verl's own forwards have it too): a rank cannot know
whether another rank has an image without a collective of its own, so a
text-only micro-batch always runs the dummy, and on a step where *every* rank
is text-only the tower's parameters get exactly-zero gradients instead of
none.  Plain SGD ignores the difference; an optimizer with weight decay or
momentum (AdamW) then updates the tower as it does on any step where some
other rank's image reached it.

Fails safe: the targets are fingerprinted per transformers release (the wrapper
relies on the embedding being called before the tower, on the media argument
names and on ``get_image_features``); a model whose tower or config
``media_towers`` does not know (no tower under the attribute its entry names,
a config without what the dummy needs) is left alone, with one warning per
class naming why.  Revert restores
transformers' methods.

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
