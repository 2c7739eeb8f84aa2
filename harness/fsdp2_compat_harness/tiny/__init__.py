"""Tiny, download-free Hugging Face models for exercising FSDP2 wrapping.

Every family is built from its transformers config class (no hub access, no
weights) with 1-2 decoder layers, hidden size 32 and depth-1 vision/audio
towers, so a build plus one training step takes well under a second on CPU
once torch/transformers are imported.

Works with transformers 4.57.x and 5.x.  This package imports neither torch nor
transformers at import time; each function imports them when called.  The
configs live in ``configs``, the batches in ``batches``.

API::

    FAMILIES                        # tuple of family names
    unavailable(family)             # None, or why not (the harness's one convention: None = ok, else the reason)
    unwrappable(family)             # also: verl / SkyRL accept its layer classes
    untieable(family)               # also: tie_word_embeddings=True really ties its embeddings
    raw_read_removed(family)        # None, or why this transformers no longer reads it raw
    build(family, tie=False, seed=0)  # fp32 CPU model in train mode
    make_batch(family, model, seed=..., batch_size=2, media=("image",))  # kwargs for model(**batch)
    VIDEO_FAMILIES                  # families make_batch gives media=("video",) / ("image", "video")

Families whose vision/audio tower reads an auxiliary embedding's ``.weight``
directly in ``forward`` (the FSDP2 "mixed torch.Tensor and DTensor" class):
glm4v, glm4v_moe, glm46v (GLM4V vision ``position_embedding`` into
``F.grid_sample``), lfm2_vl (SigLIP2 ``position_embedding``), paddleocr_vl
(SigLIP-style ``position_embedding`` through ``interpolate_pos_encoding``),
qwen2_audio, voxtral, audioflamingo3 (Whisper-style ``embed_positions``).
qwen2, llama, qwen2_5_vl, qwen3_vl and qwen3_vl_moe are controls: their
auxiliary embeddings are called as modules (or there are none).

Observed with torch 2.13 CPU, one gloo rank, untied, every ``nn.Embedding``
plus the ``_no_split_modules`` classes wrapped (verl/SkyRL selection):
glm4v*/glm46v ``aten.grid_sampler_2d``; paddleocr_vl, qwen2_audio, voxtral,
audioflamingo3 ``aten.add.Tensor``; lfm2_vl ``aten.copy_`` (on 5.x only when
wrapped children-first: 5.x lists ``Siglip2VisionEmbeddings`` itself as a
no-split class).  ``glm46v``, ``paddleocr_vl`` and ``audioflamingo3`` need
transformers 5.x; ``unavailable()`` says so on 4.x.  From transformers 5.15.0
PaddleOCR-VL calls its ``position_embedding`` as a module (no raw read).

Families new in transformers 5.1x (hunyuan_vl, step3p7, glm_image,
cosmos3_edge, deepseek_ocr2, chameleon) are in ``recent``, with where each
reads an embedding's weight raw.

Tying: from transformers 5.10 the ``*ForConditionalGeneration`` classes of
qwen2_audio, voxtral and audioflamingo3 hold their own ``lm_head`` and declare
no tied-weight keys, so ``tie_word_embeddings=True`` ties nothing there (real
checkpoints of these classes cannot be tied either); ``untieable()`` says where.
"""

from __future__ import annotations

from . import moe, recent
from .batches import VIDEO_FAMILIES, make_batch
from .configs import CLASSES as _VLM_AND_TEXT_CLASSES
from .configs import FAMILIES
from .configs import tiny_config as _tiny_config

# Every buildable family: ``FAMILIES`` plus the text MoE families of ``moe`` (not in FAMILIES: see tiny.moe).
CLASSES = {**_VLM_AND_TEXT_CLASSES, **moe.CLASSES}


def tiny_config(family: str, tie: bool):
    """The tiny config of ``family`` (``configs``, ``recent`` or ``moe``)."""
    if family in moe.CLASSES:
        return moe.tiny_config(family, tie)
    return _tiny_config(family, tie)

__all__ = ["FAMILIES", "CLASSES", "VIDEO_FAMILIES", "available", "exports", "wrappable", "tieable", "raw_read_removed", "build",
           "make_batch", "tiny_config", "quiet"]


def exports(name: str) -> bool:
    """Whether the installed transformers exports ``name``, read from its lazy module's table when it has one:
    the attribute itself imports the modeling module (and torch._dynamo with it: seconds, at a test's collection)."""
    import transformers

    table = getattr(transformers, "_class_to_module", None)
    return (isinstance(table, dict) and name in table) or hasattr(transformers, name)


def unavailable(family: str) -> "str | None":
    """None when the installed transformers provides ``family``, else why not."""
    if family not in CLASSES:
        return f"unknown family {family!r}; known: {', '.join(FAMILIES)}"
    import transformers

    model_cls, config_cls = CLASSES[family]
    missing = [n for n in (model_cls, config_cls) if not exports(n)]
    if missing:
        return f"transformers {transformers.__version__} has no {' / '.join(missing)}"
    if family in recent.MIN_TRANSFORMERS:
        from packaging.version import Version

        first = recent.MIN_TRANSFORMERS[family]
        if Version(transformers.__version__) < Version(first):
            return f"the tiny {family} config and batch are written for transformers >= {first} " \
                   f"(found {transformers.__version__})"
    return None


_WRAPPABLE: dict = {}


def unwrappable(family: str) -> "str | None":
    """None when verl's and SkyRL's ``apply_fsdp2`` can take ``family`` here, else why not.

    Both assert on an empty layer-class list before sharding anything, and some
    transformers releases ship an empty ``_no_split_modules`` (LFM2-VL and
    Voxtral on 4.57, GLM-4.6V on 5.0.0rc3).  Cached: it builds the model once.
    """
    if family not in _WRAPPABLE:
        reason = unavailable(family)
        if reason is None and not build(family)._no_split_modules:
            reason = "%s has an empty _no_split_modules in this transformers: upstream refuses it" % family
        _WRAPPABLE[family] = reason
    return _WRAPPABLE[family]


# Families whose raw read the installed transformers may no longer have:
# {family: (first release without it, what changed)}.
RAW_READ_REMOVED = {
    "paddleocr_vl": ("5.15.0", "PaddleOCRVisionEmbeddings calls its position_embedding as a module"),
}


def raw_read_removed(family: str):
    """A reason when the installed transformers no longer reads ``family``'s auxiliary embedding
    weight raw (so upstream FSDP2 does not crash on it), else None."""
    if family not in RAW_READ_REMOVED:
        return None
    import transformers
    from packaging.version import Version

    first, what = RAW_READ_REMOVED[family]
    if Version(transformers.__version__) >= Version(first):
        return "transformers %s: %s (from %s): no raw read left" % (transformers.__version__, what, first)
    return None


_TIEABLE: dict = {}


def untieable(family: str) -> "str | None":
    """None when ``tie_word_embeddings=True`` makes ``family``'s input and output embeddings
    one weight in the installed transformers, else why not.  Cached: it builds the model once."""
    if family not in _TIEABLE:
        reason = unavailable(family)
        if reason is None:
            model = _construct(family, True, 0)
            if model.get_input_embeddings().weight is not model.get_output_embeddings().weight:
                import transformers

                why = ("its config class has no top-level tie_word_embeddings"
                       if not hasattr(model.config, "tie_word_embeddings") else
                       "%s declares _tied_weights_keys=%r" % (type(model).__name__,
                                                              getattr(type(model), "_tied_weights_keys", None)))
                reason = "%s: tie_word_embeddings=True does not tie its embeddings in transformers %s (%s)" % (
                    family, transformers.__version__, why)
        _TIEABLE[family] = reason
    return _TIEABLE[family]


def _require(family: str) -> None:
    why = unavailable(family)
    if why is not None:
        raise RuntimeError(why)


def quiet(fn, *args):
    """Call ``fn`` with transformers logging at ERROR (PaddleOCR-VL's config
    validator warns about its own ``mrope_section`` key on every build)."""
    from transformers.utils import logging as hf_logging

    old = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return fn(*args)
    finally:
        hf_logging.set_verbosity(old)


def build(family: str, *, tie: bool | str = False, seed: int = 0, vision: dict | None = None, experts: bool = False):
    """Tiny fp32 CPU model of ``family`` in train mode, weights from ``seed``.

    ``tie``: False (untied), True (tied, flags agree; ``RuntimeError`` with the
    reason where the family cannot tie, see ``tieable``), or ``"weights-only"``:
    tied weights under a top-level ``tie_word_embeddings=False``, as a Qwen3-VL
    checkpoint loads in transformers 4.57 (the flag that ties lives in
    ``text_config``); the frameworks read the top-level flag.  ``vision``:
    ``vision_config`` attributes to set (a real model's patch geometry where
    upstream code hard-codes it); ``make_batch`` reads the config, so it fits.
    ``experts``: a MoE VLM (``moe.VLM_EXPERT_KEYS``) with ``moe.EXPERTS`` routed
    experts, ``moe.TOP_K`` per token (the text MoE families always have them).
    """
    _require(family)
    tied = bool(tie)
    if tied and untieable(family) is not None:
        raise RuntimeError(untieable(family))
    model = _construct(family, tied, seed, vision, experts)
    inp = model.get_input_embeddings().weight
    out = model.get_output_embeddings().weight
    if (inp is out) != tied:
        import transformers as T

        raise AssertionError(
            f"{family}: tie={tie} requested but get_input_embeddings().weight is "
            f"get_output_embeddings().weight == {inp is out} "
            f"(transformers {T.__version__})"
        )
    if tie == "weights-only":
        model.config.tie_word_embeddings = False
    return model


def _construct(family: str, tied: bool, seed: int, vision=None, experts=False):
    import torch
    import transformers as T

    config = quiet(tiny_config, family, tied)
    if experts:
        config = moe.with_experts(config, family)
    for key, value in (vision or {}).items():
        setattr(config.vision_config, key, value)
    model_cls = getattr(T, CLASSES[family][0])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model = model.to(dtype=torch.float32, device="cpu")
    model.train()
    return model


