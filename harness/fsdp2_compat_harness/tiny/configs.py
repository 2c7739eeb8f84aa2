"""Tiny configs: 1-2 decoder layers, hidden size 32, depth-1 vision/audio towers.

``tiny_config(family, tie)`` builds the config of one family from its
transformers config class, in the spelling of the installed transformers major
(4.57.x and 5.x); families new in transformers 5.1x live in ``recent``.  The geometry constants are shared with ``batches``, which
builds inputs that fit them.
"""

from __future__ import annotations

from . import recent

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
) + recent.FAMILIES

# family -> (transformers model class, transformers config class)
CLASSES: dict[str, tuple[str, str]] = {
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
    **recent.CLASSES,
}

# tiny dimensions shared by all families

_VOCAB = 256
_HIDDEN = 32
_HEADS = 2
_KV_HEADS = 1
_HEAD_DIM = _HIDDEN // _HEADS  # 16 -> 8 rotary frequencies
_INTER = 64
_LAYERS = 2

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


def tf_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def rope(theta: float = 10000.0, mrope_section=None, **extra) -> dict:
    """Rotary kwargs in the spelling of the installed transformers major."""
    if tf_major() >= 5:
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


def tiny_config(family: str, tie: bool):
    if family in recent.CLASSES:
        return recent.tiny_config(family, tie)
    import transformers as T

    major = tf_major()
    cfg_cls = getattr(T, CLASSES[family][1])

    if family == "qwen2":
        return cfg_cls(**_text(tie, **rope()))
    if family == "llama":
        return cfg_cls(**_text(tie, **rope()))

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
                **rope(mrope_section=[1, 1, 2], partial_rotary_factor=0.5)
                if major >= 5
                else rope(mrope_section=[1, 1, 2]),
            )
        else:
            text = _text(tie, **rope(mrope_section=[2, 3, 3]))
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
        text = _text(tie, **rope(mrope_section=[2, 3, 3]))
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
            **rope(mrope_section=[2, 3, 3], mrope_interleaved=True),
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
            **rope(),
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
        text = _text(tie, head_dim=_HEAD_DIM, **rope(mrope_section=[2, 3, 3]))
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
        text = _text(tie, model_type="qwen2", **rope())
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
        text = _text(tie, model_type="llama", head_dim=_HEAD_DIM, **rope())
        return cfg_cls(
            audio_config=audio, text_config=text, audio_token_id=_AUDIO, tie_word_embeddings=tie
        )

    raise ValueError(f"unknown family {family!r}")

