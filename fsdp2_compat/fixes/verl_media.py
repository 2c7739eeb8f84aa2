"""verl's own Qwen-VL forwards: one vision-tower call for a micro-batch with images and videos.

The bug (issue #20, the mixed-kinds half, inside verl): ``apply_monkey_patch`` replaces transformers' Qwen2-VL /
Qwen2.5-VL / Qwen3-VL(-MoE) model forwards with verl's own (``qwen2_vl_base_forward``, ``qwen3_vl_base_forward``,
0.6.0+), whose ``_get_input_embeds`` calls ``model.visual`` itself: once for the images, once more for the videos.
A rank whose micro-batch carries both kinds all-gathers every vision unit twice (and reduce-scatters twice in
backward); a rank with one kind, or text only (verl's own dummy), once.  NCCL hangs, gloo aborts ("Received data
size doesn't match expected size"). fsdp2-compat's transformers-level merge (``fixes.media_merge``) never sees
these calls: verl's forward replaced the one it wraps.

The fix: for one call of verl's ``_get_input_embeds`` whose arguments carry images and videos, the vision tower's
``forward`` (an instance attribute for the duration of the call, so ``nn.Module.__call__`` and every hook run as
usual) runs once, on both kinds' patches concatenated with their grids concatenated in the same order, when verl
asks for the first kind; each of verl's two calls gets its part of that one output (``media_merge.split``, whatever
structure the release returns).  Why the parts equal two calls: the Qwen towers treat each ``[t, h, w]`` grid item
on its own (``media_merge``'s docstring).  The second call issues no collective, which needs the tower module
itself to be no FSDP unit (its blocks are: verl wraps ``_no_split_modules``); a tower that is a unit is left as
released, with a warning.

Why this seam: ``_get_input_embeds`` is the one function of verl's forwards
that calls the tower, with the grids that tell the two kinds apart; wrapping
it covers the fused and unfused forwards and every verl trainer that runs
them.  verl's Qwen2-VL ``_get_input_embeds`` also needs, on transformers >=
5.0.0, ``glm4v_forward``'s pooled-output rule for its text-only dummy
(``.mean()`` on the output object): ``qwen2_vl_seam`` applies both, and the
rule alone where a call has one kind.

Fails safe: both targets are fingerprinted per verl release; the merge runs
only where torch.distributed has more than one rank and FSDP2 manages the
tower (an unsharded reference runs as released); a call the merge was not
built for (pixels of another shape, a third call, a grid that is not the
forward's own) runs the tower as released for the rest of that call, with one
warning per class.  Delete when verl's ``_get_input_embeds`` runs the tower
once per micro-batch in every release you run, or FSDP2 tolerates a unit
that one rank runs more often.
"""

import contextlib

from . import media_merge

_WARNED = set()


def _warn_once(model, why):
    media_merge.warn_once(_WARNED, model, "fsdp2-compat: images and videos in one micro-batch through verl's forward: "
                          "%%s's tower runs twice (%s); a rank with one kind runs it once, so FSDP2's collectives can "
                          "stall" % why.replace("%", "%%"))


def refusal(model, visual):
    """Why a both-kinds call of ``model`` runs its tower twice, as released (None when the merge runs)."""
    from torch.distributed.fsdp import FSDPModule

    from . import mixed_media

    if mixed_media._distributed_world() <= 1 or not mixed_media.tower_is_sharded(visual):
        return "not a sharded run"  # nothing to align: no warning
    if isinstance(visual, FSDPModule):
        return "the vision tower is an FSDP unit of its own: a second call would all-gather it again"
    vision_config = getattr(getattr(model, "config", None), "vision_config", None)
    if not isinstance(getattr(vision_config, "spatial_merge_size", None), int):
        return "its config has no vision_config.spatial_merge_size to split the merged output by"
    return None


@contextlib.contextmanager
def one_visual_call(model, visual, images, image_grid, videos, video_grid):
    """For one call of verl's ``_get_input_embeds``: ``visual(images, grid_thw=image_grid)`` and
    ``visual(videos, grid_thw=video_grid)`` share one run of the tower (see the module docstring)."""
    import torch

    original = visual.forward  # the class's, or an instance override someone installed before us
    own = {"image": (images, image_grid), "video": (videos, video_grid)}
    parts = {}
    state = {"merged": False, "released": False}

    def forward(pixels, *args, **kwargs):
        grid = kwargs.get("grid_thw", args[0] if args else None)
        kind = next((k for k, (_, g) in own.items() if grid is g), None)
        fits = kind is not None and tuple(pixels.shape) == tuple(own[kind][0].shape) and len(args) <= 1
        if state["released"] or not fits or state["merged"] and kind not in parts:
            if not state["released"]:
                _warn_once(model, "verl called the tower with pixels or a grid that are not the call's own, or "
                                  "asked twice")
            state["released"] = True
            return original(pixels, *args, **kwargs)
        if not state["merged"]:
            rest = {k: v for k, v in kwargs.items() if k != "grid_thw"}
            sizes = media_merge._Sizes(image_grid, video_grid, model.config.vision_config.spatial_merge_size)
            both = torch.cat([images.to(pixels.dtype), videos.to(pixels.dtype)])
            out = original(both, grid_thw=torch.cat([image_grid, video_grid]), **rest)
            media_merge.STATS["merged_forwards"] += 1
            parts["image"], parts["video"] = media_merge.split(out, sizes, "%s()" % type(visual).__name__)
            state["merged"] = True
        return parts.pop(kind)

    with media_merge.for_this_call(visual, forward=forward):
        yield


def _seam(module, attr, pooled):
    import wrapt

    from ..core import calls
    from .glm4v_forward import pooled_output

    signature = calls.signature_of(module, attr)

    def _get_input_embeds(wrapped, instance, args, kwargs):
        def arg(name):
            return signature.argument(name, instance, args, kwargs)

        model = arg("model")
        visual = getattr(model, "visual", None)
        if visual is None or not hasattr(visual, "register_forward_hook"):
            calls.missing(signature.where, "a model with a vision tower (got %s)" % type(model).__name__)
            return wrapped(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            if pooled:
                stack.callback(visual.register_forward_hook(pooled_output).remove)
            kinds = [arg(n) for n in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")]
            if all(k is not None for k in kinds):
                why = refusal(model, visual)
                if why is None:
                    stack.enter_context(one_visual_call(model, visual, *kinds))
                elif why != "not a sharded run":
                    _warn_once(model, why)
            return wrapped(*args, **kwargs)

    return {attr: wrapt.FunctionWrapper(module.__dict__[attr], _get_input_embeds)}


def qwen2_vl_seam(module, attr):
    """verl's Qwen2-VL ``_get_input_embeds``: one tower call for both kinds, and, on transformers >= 5.0.0,
    the tower's pooled tensor for verl's text-only dummy (``glm4v_forward.vision_output_seam``'s rule)."""
    from .glm4v_forward import VISION_OUTPUT_OBJECT, _transformers_in

    return _seam(module, attr, pooled=_transformers_in(VISION_OUTPUT_OBJECT)[1])


def qwen3_vl_seam(module, attr):
    """verl's Qwen3-VL ``_get_input_embeds``: one tower call for both kinds (verl unpacks every output)."""
    return _seam(module, attr, pooled=False)
