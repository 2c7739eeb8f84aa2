"""Tiny, download-free Hugging Face models for exercising FSDP2 wrapping.

Every family is built from its transformers config class (no hub access, no
weights) with 1-2 decoder layers, hidden size 32 and depth-1 vision/audio
towers, so a build plus one training step takes well under a second on CPU
once torch/transformers are imported.

Works with transformers 4.57.x and 5.x.  This module imports neither torch nor
transformers at import time; each function imports them when called.

API::

    FAMILIES                        # tuple of family names
    available(family)               # True, or a reason string
    wrappable(family)               # also: verl / SkyRL accept its layer classes
    build(family, tie=False, seed=0)  # fp32 CPU model in train mode
    make_batch(family, model, seed=..., batch_size=2)  # kwargs for model(**batch)
    real_size_config(family)        # full-size config for meta-device counting

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
transformers 5.x; ``available()`` says so on 4.x.
"""

from __future__ import annotations

FAMILIES: tuple[str, ...] = (
    "qwen2",
    "llama",
    "glm4v",
    "glm4v_moe",
    "glm46v",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "lfm2_vl",
    "paddleocr_vl",
    "qwen2_audio",
    "voxtral",
    "audioflamingo3",
)

# family -> (transformers model class, transformers config class)
_CLASSES: dict[str, tuple[str, str]] = {
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "glm4v": ("Glm4vForConditionalGeneration", "Glm4vConfig"),
    "glm4v_moe": ("Glm4vMoeForConditionalGeneration", "Glm4vMoeConfig"),
    "glm46v": ("Glm46VForConditionalGeneration", "Glm46VConfig"),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig"),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLConfig"),
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeConfig"),
    "lfm2_vl": ("Lfm2VlForConditionalGeneration", "Lfm2VlConfig"),
    "paddleocr_vl": ("PaddleOCRVLForConditionalGeneration", "PaddleOCRVLConfig"),
    "qwen2_audio": ("Qwen2AudioForConditionalGeneration", "Qwen2AudioConfig"),
    "voxtral": ("VoxtralForConditionalGeneration", "VoxtralConfig"),
    "audioflamingo3": ("AudioFlamingo3ForConditionalGeneration", "AudioFlamingo3Config"),
}

# ---------------------------------------------------------------------------
# tiny dimensions shared by all families

_VOCAB = 256
_HIDDEN = 32
_HEADS = 2
_KV_HEADS = 1
_HEAD_DIM = _HIDDEN // _HEADS  # 16 -> 8 rotary frequencies
_INTER = 64
_LAYERS = 2
_TEXT_TOKENS_MAX = 240  # ordinary text ids are drawn from [3, 240)

# special token ids (all inside the tiny vocab)
_IMG = 250  # image placeholder
_VID = 251
_VSTART = 252  # vision start / image start
_VEND = 253  # vision end / image end
_VIDSTART = 248
_VIDEND = 249
_AUDIO = 250  # audio placeholder
_AUDIO_BOS = 246
_AUDIO_EOS = 247

# vision geometry: 4x4 patches of 4x4 pixels, merged 2x2 -> 4 image tokens
_PATCH = 4
_TPATCH = 2  # temporal patch for Qwen/GLM Conv3d patch embedders
_GRID = 4  # patches per side of one image
_MERGE = 2
_IMAGE_TOKENS = (_GRID // _MERGE) ** 2

# audio geometry: Whisper-style encoder with max_source_positions 16
_MEL = 16
_SRC_POS = 16
_MEL_LEN = 2 * _SRC_POS  # conv2 has stride 2


def _tf_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def available(family: str) -> bool | str:
    """True when the installed transformers provides ``family``, else a reason."""
    if family not in _CLASSES:
        return f"unknown family {family!r}; known: {', '.join(FAMILIES)}"
    import transformers

    model_cls, config_cls = _CLASSES[family]
    missing = [n for n in (model_cls, config_cls) if not hasattr(transformers, n)]
    if missing:
        return f"transformers {transformers.__version__} has no {' / '.join(missing)}"
    return True


_WRAPPABLE: dict = {}


def wrappable(family: str) -> bool | str:
    """True when verl's and SkyRL's ``apply_fsdp2`` can take ``family`` here, else a reason.

    Both assert on an empty layer-class list before sharding anything, and some
    transformers releases ship an empty ``_no_split_modules`` (LFM2-VL and
    Voxtral on 4.57, GLM-4.6V on 5.0.0rc3).  Cached: it builds the model once.
    """
    if family not in _WRAPPABLE:
        reason = available(family)
        if reason is True and not build(family)._no_split_modules:
            reason = "%s has an empty _no_split_modules in this transformers: upstream refuses it" % family
        _WRAPPABLE[family] = reason
    return _WRAPPABLE[family]


def _require(family: str) -> None:
    ok = available(family)
    if ok is not True:
        raise RuntimeError(ok)


def _rope(theta: float = 10000.0, mrope_section=None, **extra) -> dict:
    """Rotary kwargs in the spelling of the installed transformers major."""
    if _tf_major() >= 5:
        params = {"rope_type": "default", "rope_theta": theta}
        if mrope_section is not None:
            params["mrope_section"] = list(mrope_section)
        params.update(extra)
        return {"rope_parameters": params}
    out: dict = {"rope_theta": theta}
    if mrope_section is not None:
        scaling = {"rope_type": "default", "mrope_section": list(mrope_section)}
        scaling.update(extra)
        out["rope_scaling"] = scaling
    return out


def _text(tie: bool, **overrides) -> dict:
    """Common tiny decoder kwargs (works for qwen2/llama/glm4v_text/...)."""
    d = dict(
        vocab_size=_VOCAB,
        hidden_size=_HIDDEN,
        intermediate_size=_INTER,
        num_hidden_layers=_LAYERS,
        num_attention_heads=_HEADS,
        num_key_value_heads=_KV_HEADS,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        attention_dropout=0.0,
        pad_token_id=0,
    )
    d.update(overrides)
    return d


def _tiny_config(family: str, tie: bool):
    import transformers as T

    major = _tf_major()
    cfg_cls = getattr(T, _CLASSES[family][1])

    if family == "qwen2":
        return cfg_cls(**_text(tie, **_rope()))
    if family == "llama":
        return cfg_cls(**_text(tie, **_rope()))

    if family in ("glm4v", "glm4v_moe", "glm46v"):
        vision = dict(
            depth=1,
            hidden_size=_HIDDEN,
            intermediate_size=_INTER,
            num_heads=_HEADS,
            in_channels=3,
            image_size=_GRID * _PATCH,  # position table: (16/4)^2 = 16 rows
            patch_size=_PATCH,
            spatial_merge_size=_MERGE,
            temporal_patch_size=_TPATCH,
            out_hidden_size=_HIDDEN,
            attention_dropout=0.0,
        )
        if family == "glm4v_moe":
            # partial_rotary_factor 0.5 (default): 8 rotary dims -> 4 freqs
            text = _text(
                tie,
                head_dim=_HEAD_DIM,
                partial_rotary_factor=0.5,
                moe_intermediate_size=32,
                n_routed_experts=4,
                num_experts_per_tok=2,
                n_shared_experts=1,
                first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE
                n_group=1,
                topk_group=1,
                **_rope(mrope_section=[1, 1, 2], partial_rotary_factor=0.5)
                if major >= 5
                else _rope(mrope_section=[1, 1, 2]),
            )
        else:
            text = _text(tie, **_rope(mrope_section=[2, 3, 3]))
        if family == "glm46v":
            vision["model_type"] = "glm4v_vision"
            text["model_type"] = "glm4v_text"
        return cfg_cls(
            text_config=text,
            vision_config=vision,
            image_token_id=_IMG,
            video_token_id=_VID,
            image_start_token_id=_VSTART,
            image_end_token_id=_VEND,
            video_start_token_id=_VIDSTART,
            video_end_token_id=_VIDEND,
            tie_word_embeddings=tie,
        )

    if family == "qwen2_5_vl":
        vision = dict(
            depth=1,
            hidden_size=_HIDDEN,
            intermediate_size=_INTER,
            num_heads=_HEADS,
            in_channels=3,
            patch_size=_PATCH,
            spatial_merge_size=_MERGE,
            temporal_patch_size=_TPATCH,
            window_size=_PATCH * _MERGE * 2,  # 2x2 merged-patch windows
            out_hidden_size=_HIDDEN,
            fullatt_block_indexes=[0],
        )
        text = _text(tie, **_rope(mrope_section=[2, 3, 3]))
        return cfg_cls(
            text_config=text,
            vision_config=vision,
            image_token_id=_IMG,
            video_token_id=_VID,
            vision_start_token_id=_VSTART,
            vision_end_token_id=_VEND,
            tie_word_embeddings=tie,
        )

    if family in ("qwen3_vl", "qwen3_vl_moe"):
        vision = dict(
            depth=1,
            hidden_size=_HIDDEN,
            intermediate_size=_INTER,
            num_heads=_HEADS,
            in_channels=3,
            patch_size=_PATCH,
            spatial_merge_size=_MERGE,
            temporal_patch_size=_TPATCH,
            out_hidden_size=_HIDDEN,
            num_position_embeddings=_GRID * _GRID,
            deepstack_visual_indexes=[0],
        )
        text = _text(
            tie,
            head_dim=_HEAD_DIM,
            **_rope(mrope_section=[2, 3, 3], mrope_interleaved=True),
        )
        if family == "qwen3_vl_moe":
            text.update(
                moe_intermediate_size=32,
                num_experts=4,
                num_experts_per_tok=2,
                decoder_sparse_step=1,
                norm_topk_prob=True,
            )
        return cfg_cls(
            text_config=text,
            vision_config=vision,
            image_token_id=_IMG,
            video_token_id=_VID,
            vision_start_token_id=_VSTART,
            vision_end_token_id=_VEND,
            tie_word_embeddings=tie,
        )

    if family == "lfm2_vl":
        vision = dict(
            model_type="siglip2_vision_model",
            hidden_size=_HIDDEN,
            intermediate_size=_INTER,
            num_hidden_layers=1,
            num_attention_heads=_HEADS,
            num_channels=3,
            patch_size=_PATCH,
            num_patches=_GRID * _GRID,
            attention_dropout=0.0,
            vision_use_head=False,  # as LFM2-VL checkpoints: no unused pooling head
        )
        text = _text(
            tie,
            model_type="lfm2",
            layer_types=["conv", "full_attention"],
            block_auto_adjust_ff_dim=False,
            **_rope(),
        )
        text.pop("attention_dropout")
        kw = dict(
            text_config=text,
            vision_config=vision,
            image_token_id=_IMG,
            projector_hidden_size=_HIDDEN,
            downsample_factor=_MERGE,
            tie_word_embeddings=tie,
        )
        return cfg_cls(**kw)

    if family == "paddleocr_vl":
        vision = dict(
            hidden_size=_HIDDEN,
            intermediate_size=_INTER,
            num_hidden_layers=1,
            num_attention_heads=_HEADS,
            num_channels=3,
            image_size=_GRID * _PATCH,
            patch_size=_PATCH,
            spatial_merge_size=_MERGE,
            attention_dropout=0.0,
        )
        text = _text(tie, head_dim=_HEAD_DIM, **_rope(mrope_section=[2, 3, 3]))
        text.pop("attention_dropout")
        return cfg_cls(
            text_config=text,
            vision_config=vision,
            image_token_id=_IMG,
            video_token_id=_VID,
            vision_start_token_id=_VSTART,
            vision_end_token_id=_VEND,
            tie_word_embeddings=tie,
        )

    if family in ("qwen2_audio", "audioflamingo3"):
        if family == "qwen2_audio":
            audio = dict(
                num_mel_bins=_MEL,
                encoder_layers=1,
                encoder_attention_heads=_HEADS,
                encoder_ffn_dim=_INTER,
                d_model=_HIDDEN,
                max_source_positions=_SRC_POS,
                dropout=0.0,
                attention_dropout=0.0,
                activation_dropout=0.0,
                encoder_layerdrop=0.0,
            )
            token_kw = {"audio_token_index": _AUDIO}
        else:
            audio = dict(
                num_mel_bins=_MEL,
                num_hidden_layers=1,
                num_attention_heads=_HEADS,
                intermediate_size=_INTER,
                hidden_size=_HIDDEN,
                max_source_positions=_SRC_POS,
                dropout=0.0,
                attention_dropout=0.0,
                activation_dropout=0.0,
                layerdrop=0.0,
            )
            token_kw = {"audio_token_id": _AUDIO}
        text = _text(tie, model_type="qwen2", **_rope())
        # 4.57 ties by text_config and defaults the top-level flag to True:
        # set both so every reader of the config sees the real tying.
        return cfg_cls(audio_config=audio, text_config=text, tie_word_embeddings=tie, **token_kw)

    if family == "voxtral":
        audio = dict(
            hidden_size=_HIDDEN,
            intermediate_size=4 * _HIDDEN,  # 4 encoder frames per audio token
            num_hidden_layers=1,
            num_attention_heads=_HEADS,
            num_mel_bins=_MEL,
            max_source_positions=_SRC_POS,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            layerdrop=0.0,
        )
        text = _text(tie, model_type="llama", head_dim=_HEAD_DIM, **_rope())
        return cfg_cls(
            audio_config=audio, text_config=text, audio_token_id=_AUDIO, tie_word_embeddings=tie
        )

    raise ValueError(f"unknown family {family!r}")


def _quiet(fn, *args):
    """Call ``fn`` with transformers logging at ERROR (PaddleOCR-VL's config
    validator warns about its own ``mrope_section`` key on every build)."""
    from transformers.utils import logging as hf_logging

    old = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return fn(*args)
    finally:
        hf_logging.set_verbosity(old)


def build(family: str, *, tie: bool | str = False, seed: int = 0):
    """Tiny fp32 CPU model of ``family`` in train mode, weights from ``seed``.

    ``tie``: False (untied), True (tied, flags agree), or ``"weights-only"``:
    tied weights under a top-level ``tie_word_embeddings=False``, as a Qwen3-VL
    checkpoint loads in transformers 4.57 (the flag that ties lives in
    ``text_config``); the frameworks read the top-level flag.
    """
    _require(family)
    import torch
    import transformers as T

    tied = bool(tie)
    config = _quiet(_tiny_config, family, tied)
    model_cls = getattr(T, _CLASSES[family][0])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model = model.to(dtype=torch.float32, device="cpu")
    model.train()
    inp = model.get_input_embeddings().weight
    out = model.get_output_embeddings().weight
    if (inp is out) != tied:
        raise AssertionError(
            f"{family}: tie={tie} requested but get_input_embeddings().weight is "
            f"get_output_embeddings().weight == {inp is out} "
            f"(transformers {T.__version__})"
        )
    if tie == "weights-only":
        model.config.tie_word_embeddings = False
    return model


# ---------------------------------------------------------------------------
# batches


def _text_ids(gen, n: int):
    import torch

    return torch.randint(3, _TEXT_TOKENS_MAX, (n,), generator=gen)


def _with_placeholders(gen, batch_size: int, pre: int, span: list[int], post: int):
    """input_ids rows: text[pre] + span + text[post]; labels mask the span."""
    import torch

    rows, labels = [], []
    for _ in range(batch_size):
        a, b = _text_ids(gen, pre), _text_ids(gen, post)
        mid = torch.tensor(span, dtype=torch.long)
        ids = torch.cat([a, mid, b])
        lab = ids.clone()
        lab[pre : pre + len(span)] = -100
        rows.append(ids)
        labels.append(lab)
    input_ids = torch.stack(rows)
    return input_ids, torch.ones_like(input_ids), torch.stack(labels)


def _accepts(fn, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def make_batch(family: str, model, *, seed: int, batch_size: int = 2) -> dict:
    """Deterministic kwargs for ``model(**batch)`` (with labels -> scalar loss)."""
    import torch

    gen = torch.Generator().manual_seed(int(seed))
    cfg = model.config

    if family in ("qwen2", "llama"):
        ids = torch.stack([_text_ids(gen, 12) for _ in range(batch_size)])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    if family in ("glm4v", "glm4v_moe", "glm46v", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "paddleocr_vl"):
        # Patchified pixels plus a (t, h, w) grid per image; only the patch layout differs.
        vcfg = cfg.vision_config
        n_patches = _GRID * _GRID
        if family == "paddleocr_vl":
            patch_shape = (vcfg.num_channels, vcfg.patch_size, vcfg.patch_size)
        else:
            patch_shape = (vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size**2,)
        pixel_values = torch.randn(batch_size * n_patches, *patch_shape, generator=gen)
        grid = torch.tensor([[1, _GRID, _GRID]] * batch_size, dtype=torch.long)
        span = [_VSTART] + [_IMG] * _IMAGE_TOKENS + [_VEND]
        input_ids, attn, labels = _with_placeholders(gen, batch_size, 5, span, 6)
        batch = {
            "input_ids": input_ids,
            "attention_mask": attn,
            "pixel_values": pixel_values,
            "image_grid_thw": grid,
            "labels": labels,
        }
        _add_mm_token_type_ids(model, batch)
        return batch

    if family == "lfm2_vl":
        vcfg = cfg.vision_config
        n_patches = _GRID * _GRID
        patch_dim = vcfg.num_channels * vcfg.patch_size**2
        pixel_values = torch.randn(batch_size, n_patches, patch_dim, generator=gen)
        pixel_attention_mask = torch.ones(batch_size, n_patches, dtype=torch.long)
        spatial_shapes = torch.tensor([[_GRID, _GRID]] * batch_size, dtype=torch.long)
        span = [_IMG] * _IMAGE_TOKENS
        input_ids, attn, labels = _with_placeholders(gen, batch_size, 5, span, 6)
        return {
            "input_ids": input_ids,
            "attention_mask": attn,
            "pixel_values": pixel_values,
            "pixel_attention_mask": pixel_attention_mask,
            "spatial_shapes": spatial_shapes,
            "labels": labels,
        }

    if family in ("qwen2_audio", "audioflamingo3"):
        n_audio = _SRC_POS // 2  # conv stride 2 then avg-pool stride 2
        input_features = torch.randn(batch_size, _MEL, _MEL_LEN, generator=gen)
        feat_mask = torch.ones(batch_size, _MEL_LEN, dtype=torch.long)
        span = [_AUDIO_BOS] + [_AUDIO] * n_audio + [_AUDIO_EOS]
        input_ids, attn, labels = _with_placeholders(gen, batch_size, 4, span, 6)
        mask_key = "feature_attention_mask" if family == "qwen2_audio" else "input_features_mask"
        return {
            "input_ids": input_ids,
            "attention_mask": attn,
            "input_features": input_features,
            mask_key: feat_mask,
            "labels": labels,
        }

    if family == "voxtral":
        acfg = cfg.audio_config
        frames_per_token = acfg.intermediate_size // acfg.hidden_size
        n_audio = _SRC_POS // frames_per_token
        input_features = torch.randn(batch_size, _MEL, _MEL_LEN, generator=gen)
        span = [_AUDIO_BOS] + [_AUDIO] * n_audio + [_AUDIO_EOS]
        input_ids, attn, labels = _with_placeholders(gen, batch_size, 4, span, 6)
        return {
            "input_ids": input_ids,
            "attention_mask": attn,
            "input_features": input_features,
            "labels": labels,
        }

    raise ValueError(f"unknown family {family!r}")


def _add_mm_token_type_ids(model, batch: dict) -> None:
    """transformers 5.x computes 3D (M-RoPE) positions only when given
    ``mm_token_type_ids`` (0 text, 1 image, 2 video); 4.x derives them from ids."""
    import torch

    inner = getattr(model, "model", model)
    fn = getattr(inner, "get_rope_index", None)
    if fn is None or not _accepts(fn, "mm_token_type_ids"):
        return
    ids = batch["input_ids"]
    tt = torch.zeros_like(ids, dtype=torch.int32)
    tt[ids == _IMG] = 1
    tt[ids == _VID] = 2
    batch["mm_token_type_ids"] = tt


# ---------------------------------------------------------------------------
# real-size configs (for meta-device parameter counting only)


def real_size_config(family: str):
    """Config with the published dimensions of a named checkpoint.

    Numbers are hand-copied from the checkpoints' config.json / model cards
    (named per family below); they are for counting parameters on the meta
    device, not for loading weights.
    """
    _require(family)
    return _quiet(_real_config, family)


def _real_config(family: str):
    import transformers as T

    major = _tf_major()
    cfg_cls = getattr(T, _CLASSES[family][1])

    if family == "qwen2":
        # Qwen/Qwen2.5-7B-Instruct config.json
        return cfg_cls(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
            rms_norm_eps=1e-6, tie_word_embeddings=False, **_rope(1000000.0),
        )
    if family == "llama":
        # meta-llama/Llama-3.1-8B-Instruct config.json
        return cfg_cls(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
            rms_norm_eps=1e-5, tie_word_embeddings=False, **_rope(500000.0),
        )
    if family in ("glm4v", "glm46v"):
        # zai-org/GLM-4.1V-9B-Thinking config.json (GLM-4.6V-Flash reuses this
        # 9B architecture; glm46v wraps the same glm4v_text / glm4v_vision)
        vision = dict(
            depth=24, hidden_size=1536, intermediate_size=13696, num_heads=12, in_channels=3,
            image_size=336, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
            out_hidden_size=4096,
        )
        text = dict(
            vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
            num_attention_heads=32, num_key_value_heads=2, max_position_embeddings=65536,
            rms_norm_eps=1e-5, partial_rotary_factor=0.5,
            **_rope(10000.0, mrope_section=[8, 12, 12]),
        )
        if family == "glm46v":
            vision["model_type"] = "glm4v_vision"
            text["model_type"] = "glm4v_text"
        return cfg_cls(text_config=text, vision_config=vision, tie_word_embeddings=False)
    if family == "glm4v_moe":
        # zai-org/GLM-4.5V config.json
        vision = dict(
            depth=24, hidden_size=1536, intermediate_size=10944, num_heads=12, in_channels=3,
            image_size=336, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
            out_hidden_size=4096,
        )
        text = dict(
            vocab_size=151424, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
            num_attention_heads=96, num_key_value_heads=8, head_dim=128, partial_rotary_factor=0.5,
            max_position_embeddings=65536, moe_intermediate_size=1408, n_routed_experts=128,
            n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1, attention_bias=True,
            **(_rope(10000.0, mrope_section=[8, 12, 12], partial_rotary_factor=0.5) if major >= 5
               else _rope(10000.0, mrope_section=[8, 12, 12])),
        )
        return cfg_cls(text_config=text, vision_config=vision, tie_word_embeddings=False)
    if family == "qwen2_5_vl":
        # Qwen/Qwen2.5-VL-7B-Instruct config.json
        vision = dict(
            depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3,
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
            out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31],
        )
        text = dict(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
            rms_norm_eps=1e-6, tie_word_embeddings=False,
            **_rope(1000000.0, mrope_section=[16, 24, 24]),
        )
        return cfg_cls(text_config=text, vision_config=vision, tie_word_embeddings=False)
    if family == "qwen3_vl":
        # Qwen/Qwen3-VL-8B-Instruct config.json
        vision = dict(
            depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3,
            patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=4096,
            num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
        )
        text = dict(
            vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128,
            max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
            **_rope(5000000.0, mrope_section=[24, 20, 20], mrope_interleaved=True),
        )
        return cfg_cls(text_config=text, vision_config=vision, tie_word_embeddings=False)
    if family == "qwen3_vl_moe":
        # Qwen/Qwen3-VL-30B-A3B-Instruct config.json
        vision = dict(
            depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3,
            patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2048,
            num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
        )
        text = dict(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
            num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
            decoder_sparse_step=1, max_position_embeddings=262144, rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            **_rope(5000000.0, mrope_section=[24, 20, 20], mrope_interleaved=True),
        )
        return cfg_cls(text_config=text, vision_config=vision, tie_word_embeddings=False)
    if family == "lfm2_vl":
        # LiquidAI/LFM2-VL-1.6B config.json: SigLIP2-NaFlex so400m tower (last
        # layer dropped: 26 layers), LFM2-1.2B text backbone (tied)
        vision = dict(
            model_type="siglip2_vision_model", hidden_size=1152, intermediate_size=4304,
            num_hidden_layers=26, num_attention_heads=16, num_channels=3, patch_size=16,
            num_patches=256, vision_use_head=False,
        )
        full = {2, 5, 8, 10, 12, 14}
        text = dict(
            model_type="lfm2", vocab_size=65536, hidden_size=2048, intermediate_size=12288,
            num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
            max_position_embeddings=128000, norm_eps=1e-5, block_auto_adjust_ff_dim=True,
            block_ffn_dim_multiplier=1.0, block_multiple_of=256, tie_word_embeddings=True,
            layer_types=["full_attention" if i in full else "conv" for i in range(16)],
            **_rope(1000000.0),
        )
        return cfg_cls(
            text_config=text, vision_config=vision, image_token_id=396,
            projector_hidden_size=2560, downsample_factor=2, tie_word_embeddings=True,
        )
    if family == "paddleocr_vl":
        # PaddlePaddle/PaddleOCR-VL (NaViT SigLIP tower + ERNIE-4.5-0.3B); numbers
        # are transformers' PaddleOCRVLConfig defaults, which name that
        # checkpoint.  Tied as those defaults are: ~0.80B on meta (the card
        # says "0.9B"; an untied lm_head would add 0.106B) - tying unverified.
        vision = dict(
            hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
            num_channels=3, image_size=384, patch_size=14, spatial_merge_size=2,
        )
        text = dict(
            vocab_size=103424, hidden_size=1024, intermediate_size=3072, num_hidden_layers=18,
            num_attention_heads=16, num_key_value_heads=2, head_dim=128,
            max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
            **_rope(500000.0, mrope_section=[16, 24, 24]),
        )
        return cfg_cls(text_config=text, vision_config=vision, tie_word_embeddings=True)
    if family == "qwen2_audio":
        # Qwen/Qwen2-Audio-7B-Instruct config.json (Whisper-large-v3 encoder + Qwen-7B)
        audio = dict(
            num_mel_bins=128, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
            d_model=1280, max_source_positions=1500,
        )
        text = dict(
            model_type="qwen2", vocab_size=156032, hidden_size=4096, intermediate_size=11008,
            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
            max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
            **_rope(10000.0),
        )
        return cfg_cls(
            audio_config=audio, text_config=text, audio_token_index=151646, tie_word_embeddings=False
        )
    if family == "voxtral":
        # mistralai/Voxtral-Mini-3B-2507 config.json (Whisper-large-v3 encoder + Ministral-3B)
        audio = dict(
            hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
            num_mel_bins=128, max_source_positions=1500, vocab_size=51866,
        )
        text = dict(
            model_type="llama", vocab_size=131072, hidden_size=3072, intermediate_size=8192,
            num_hidden_layers=30, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
            max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
            **_rope(100000000.0),
        )
        return cfg_cls(audio_config=audio, text_config=text, audio_token_id=24, tie_word_embeddings=False)
    if family == "audioflamingo3":
        # nvidia/audio-flamingo-3-hf (Whisper-large-v3 encoder + Qwen2.5-7B text);
        # vocab 151672 (Qwen2.5 plus added audio tokens) is from memory, unverified
        audio = dict(
            num_mel_bins=128, num_hidden_layers=32, num_attention_heads=20, intermediate_size=5120,
            hidden_size=1280, max_source_positions=1500,
        )
        text = dict(
            model_type="qwen2", vocab_size=151672, hidden_size=3584, intermediate_size=18944,
            num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
            max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
            **_rope(1000000.0),
        )
        return cfg_cls(
            audio_config=audio, text_config=text, audio_token_id=151669, tie_word_embeddings=False
        )
    raise ValueError(f"unknown family {family!r}")
