"""Images and videos in one micro-batch: one tower call, so every rank runs the tower the same number of times.

The bug (issue #20's second half, the same collective mismatch as a text-only rank's): the Qwen forwards run the
vision tower once for the images (``get_image_features``) and again for the videos (``get_video_features``). A rank
whose micro-batch has both all-gathers every vision unit twice (and reduce-scatters twice in backward); a rank with
only images, only videos, or text only (``mixed_media``'s dummy) does it once.  NCCL hangs, gloo aborts.

The fix: on a micro-batch with both kinds, the first of the two feature calls the forward makes runs the model's own
``get_image_features`` once, on the images' and the videos' patches concatenated (grids concatenated in the same
order), and each call gets its own part of that output.  Every rank with media then runs the tower exactly once per
forward, as a text-only rank runs its one dummy.  It costs nothing extra (one tower call instead of two).

Why the parts equal two separate calls: these towers take a list of ``[t, h, w]`` grid items and treat each item on
its own: attention is block-diagonal per frame or window (``cu_seqlens``), rotary and interpolated position embeddings
are computed per item, the patch merger works within an item, and a video goes through exactly the code an image does
(Qwen3-VL and Qwen3.5's ``get_video_features`` *is* ``get_image_features``; Qwen2-VL and Qwen2.5-VL's differs only in
its argument names).  Only matmul blocking over more rows can differ, at the last bit.  The output is split back by
the items' sizes, whatever structure the release returns (``split``): a tuple of per-item tensors (4.57; and
Qwen3-VL's deepstack features from 5.x), whole tensors of merged tokens or of patches (``pooler_output`` before the
per-item split, ``last_hidden_state``, 4.57's Qwen3-VL deepstack list), ``ModelOutput``s and tuples of those.  A
structure it cannot split raises ``MergeError`` naming the field: a clear crash instead of a hang.

Which towers: ``media_towers.Tower.merge`` (the Qwen families of ``PATCH_GRID``, and Cosmos-3 Edge).  The
GLM-4.1V/4.5V/4.6V forwards cannot take an image and a video in one micro-batch at all (every release's
``get_placeholder_mask`` marks video tokens with the image token id, so the image features never match their tokens):
a rank has one kind or the other there, one tower call each, nothing to merge.

Fails safe: the merge runs only where the class's ``get_video_features`` is ``get_image_features`` (it calls it, or
its code is the same once the video names read as the image names: ``video_path_is_image_path``, read from the
installed release's source), so a release whose video path differs is never merged blind; the overrides live on the
model instance for one forward call and are removed after it; a call whose pixels are not the forward's own (a caller
that transforms them first) is passed to transformers' function unchanged. Each refusal warns once per class: the
tower then runs twice there, as released.

Delete with ``mixed_media``: when transformers runs one tower call per micro-batch, or FSDP2 tolerates a unit one rank
runs more often.
"""

import contextlib

# How many merged tower calls ran in this process (tests and benchmarks read it).
STATS = {"merged_forwards": 0}

_WARNED = set()


class MergeError(RuntimeError):
    """The feature output's structure is not one ``split`` knows; the message names the field."""


class _Sizes:
    """Where the images end in the merged call: per-item merged-token and patch counts."""

    def __init__(self, image_grid, video_grid, merge):
        rows = [int(t) * int(h) * int(w) for t, h, w in image_grid.tolist()]
        video = [int(t) * int(h) * int(w) for t, h, w in video_grid.tolist()]
        self.images = len(rows)
        self.items = len(rows) + len(video)
        self.patches = rows + video
        self.tokens = [p // (merge * merge) for p in self.patches]
        self.image_patches, self.image_tokens = sum(rows), sum(self.tokens[: self.images])


def split(value, sizes, where="output"):
    """``(image part, video part)`` of one merged feature output (see the module docstring)."""
    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return value, value
    if isinstance(value, torch.Tensor):
        rows = value.shape[0] if value.dim() else None
        if rows == sum(sizes.tokens):
            return value[: sizes.image_tokens], value[sizes.image_tokens:]
        if rows == sum(sizes.patches):
            return value[: sizes.image_patches], value[sizes.image_patches:]
        raise MergeError("%s: a tensor of %s rows is neither the %d merged tokens nor the %d patches of the merged "
                         "call" % (where, rows, sum(sizes.tokens), sum(sizes.patches)))
    if isinstance(value, dict):  # ModelOutput is an OrderedDict of its set fields
        parts = {k: split(v, sizes, "%s.%s" % (where, k)) for k, v in value.items()}
        make = type(value)
        return make(**{k: p[0] for k, p in parts.items()}), make(**{k: p[1] for k, p in parts.items()})
    if isinstance(value, (tuple, list)):
        per_item = len(value) == sizes.items and all(
            isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n for v, n in zip(value, sizes.tokens))
        if per_item:
            return type(value)(value[: sizes.images]), type(value)(value[sizes.images:])
        parts = [split(v, sizes, "%s[%d]" % (where, i)) for i, v in enumerate(value)]
        return type(value)(p[0] for p in parts), type(value)(p[1] for p in parts)
    raise MergeError("%s: a %s, which the merge does not know how to split" % (where, type(value).__name__))


# The video path's names, as the image path spells them.
_AS_IMAGE = {"pixel_values_videos": "pixel_values", "video_grid_thw": "image_grid_thw", "video_embeds": "image_embeds"}
_SAME = {}


def video_path_is_image_path(cls):
    """``None`` when ``cls.get_video_features`` runs exactly what ``cls.get_image_features`` runs, else why not.

    True for a body that only returns ``self.get_image_features(...)`` (Qwen3-VL, Qwen3.5) and for a body
    whose code equals the image one's with the video names renamed (Qwen2-VL, Qwen2.5-VL): signatures and
    bodies compared without docstrings, annotations or decorators.  Read once per class.
    """
    if cls not in _SAME:
        _SAME[cls] = _compare(cls)
    return _SAME[cls]


def _compare(cls):
    import ast
    import inspect
    import textwrap

    def parsed(name):
        fn = getattr(cls, name, None)
        try:
            return ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
        except Exception as exc:  # no source (a C or runtime-built function), an unparsable cut
            raise LookupError("%s.%s has no readable source (%s)" % (cls.__name__, name, exc)) from None

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node):
            return ast.copy_location(ast.Name(_AS_IMAGE.get(node.id, node.id), node.ctx), node)

        def visit_arg(self, node):
            return ast.copy_location(ast.arg(_AS_IMAGE.get(node.arg, node.arg)), node)

    def statements(fn):  # the body without its docstring
        return [n for i, n in enumerate(fn.body) if not (i == 0 and isinstance(n, ast.Expr) and isinstance(
            n.value, ast.Constant) and isinstance(n.value.value, str))]

    def code(fn):
        return ast.dump(Rename().visit(ast.Module(body=[fn.args] + statements(fn), type_ignores=[])))

    try:
        video, image = parsed("get_video_features"), parsed("get_image_features")
    except LookupError as exc:
        return str(exc)
    body = statements(video)
    if len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, ast.Call) and \
            ast.unparse(body[0].value.func) == "self.get_image_features":
        return None
    for fn in (video, image):  # annotations are not code that runs
        for a in fn.args.args + fn.args.kwonlyargs + [fn.args.vararg, fn.args.kwarg]:
            if a is not None:
                a.annotation = None
        fn.returns = None
    if code(video) != code(image):
        return "%s.get_video_features is not get_image_features with the video names" % cls.__name__
    return None


def warn_once(seen, model, line):
    """Log and warn ``line`` (``%s``: the model's class) once per class in ``seen``: what the fixes leave alone."""
    cls = type(model).__name__
    if cls in seen:
        return
    seen.add(cls)
    import logging
    import warnings

    logging.getLogger("fsdp2_compat").warning(line % cls)
    warnings.warn(line % cls, UserWarning, stacklevel=5)  # the caller of the fix that warns


def _warn_once(model, why):
    warn_once(_WARNED, model, "fsdp2-compat: images and videos in one micro-batch: %%s's tower runs twice (%s); a "
              "rank with one kind runs it once, so FSDP2's collectives can stall" % why.replace("%", "%%"))


@contextlib.contextmanager
def one_tower_call(model, arg):
    """For one forward call of ``model`` whose arguments (``arg(name)``: the bound value) carry images and
    videos: ``get_image_features`` / ``get_video_features`` share one tower call."""
    pixels, image_grid = arg("pixel_values"), arg("image_grid_thw")
    videos, video_grid = arg("pixel_values_videos"), arg("video_grid_thw")
    cls = type(model)
    parts = {}  # kind -> its part of the merged output, until the forward asks for it
    state = {"merged": False, "released": False}

    def part(kind, args, kwargs):
        own = pixels if kind == "image" else videos
        first = args[0] if args else kwargs.get("pixel_values" if kind == "image" else "pixel_values_videos")
        if state["released"] or first is not own or state["merged"] and kind not in parts:
            # not the call this merge was built for: transformers' own function, for the rest of this forward
            # too (a merged call after a released one would run the tower a third time)
            if not state["released"]:
                _warn_once(model, "the forward passed %s pixels that are not its own argument, or asked twice" % kind)
            state["released"] = True
            return getattr(cls, "get_%s_features" % kind)(model, *args, **kwargs)
        if not state["merged"]:
            import torch

            rest = {k: v for k, v in kwargs.items() if k not in ("pixel_values", "image_grid_thw",
                                                                  "pixel_values_videos", "video_grid_thw")}
            sizes = _Sizes(image_grid, video_grid, model.config.vision_config.spatial_merge_size)
            out = cls.get_image_features(model, torch.cat([pixels, videos.to(pixels.dtype)]),
                                         torch.cat([image_grid, video_grid]), **rest)
            STATS["merged_forwards"] += 1
            parts["image"], parts["video"] = split(out, sizes, "%s.get_image_features()" % cls.__name__)
            state["merged"] = True
        return parts.pop(kind)

    with for_this_call(model, get_image_features=lambda *a, **k: part("image", a, k),
                       get_video_features=lambda *a, **k: part("video", a, k)):
        yield
    if not state["merged"] and not state["released"]:
        # A forward that runs its tower without these two methods (lmms-engine's Qwen2.5-VL use_rmpad forward
        # calls ``self.visual`` once per kind) cannot be merged here: say so rather than pass for fixed.
        _warn_once(model, "its forward (%s) never called get_image_features / get_video_features: the images and "
                   "the videos ran the tower its own way, once per kind, where a rank with one kind runs it once"
                   % _forward_name(cls))


def _forward_name(cls):
    import inspect

    forward = inspect.unwrap(cls.__dict__.get("forward", cls.forward))
    return "%s.%s" % (getattr(forward, "__module__", "?"), getattr(forward, "__qualname__", "forward"))


@contextlib.contextmanager
def for_this_call(obj, **replacements):
    """Set ``obj``'s instance attributes to ``replacements`` until the block ends, then restore what the instance
    had (an override someone installed before us), or delete them so the class's own show through again."""
    saved = {name: obj.__dict__[name] for name in replacements if name in obj.__dict__}
    for name, value in replacements.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name in replacements:
            if name in saved:
                setattr(obj, name, saved[name])
            else:
                delattr(obj, name)


def carries_both(model, tower, arg):
    """Whether the call's arguments (``arg(name)``) carry every media kind ``tower.merge`` merges (images and
    videos, with their grids) and the merge applies to ``model``'s class (else a warning, once per class)."""
    if not tower.merge or any(arg(n) is None for n in tower.merge):
        return False
    why = video_path_is_image_path(type(model))
    if why:
        _warn_once(model, why)
    return why is None
