"""Real-size configs, for counting parameters and bytes on the meta device (benchmarks, tests).

Numbers are hand-copied from the checkpoints' config.json / model cards (named
per family below); they are for meta-device counting, never for loading
weights.  Same family names as ``fsdp2_compat_harness.tiny``.
"""

from fsdp2_compat_harness import tiny
from fsdp2_compat_harness.tiny.configs import CLASSES, rope as _rope, tf_major as _tf_major


# Families whose config class's defaults are, by its docstring, the named checkpoint ("a similar configuration to
# that of ..."): transformers itself carries the published dimensions, so they are not copied here.
DEFAULTS_ARE = {
    "step3p7": "stepfun-ai/Step-3.7-Flash",
    "glm_image": "zai-org/GLM-Image",
    "cosmos3_edge": "nvidia/Cosmos3-Edge",
    "chameleon": "facebook/chameleon-7b",
}
# Catalogued families without a real-size config, and why (benchmarks print these rather than guess numbers).
MISSING = {
    "hunyuan_vl": "HunYuanVLConfig's defaults build no model (no rope parameters) and name no checkpoint; "
                  "HunyuanOCR's dimensions are not copied here yet",
    "deepseek_ocr2": "DeepseekOcr2Config's defaults build no model (no vision sub-configs); "
                     "DeepSeek-OCR-2's dimensions are not copied here yet",
}


# Text MoE checkpoints with transformers 4.x's per-expert ``nn.ModuleList`` (the MoE experts fix); family names of
# ``fsdp2_compat_harness.tiny.moe``.
MOE = {
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3_moe": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
}


def real_size_moe_config(family: str, **overrides):
    """The published config of the text MoE ``family`` (``MOE``), with ``overrides`` (fewer layers, experts...)."""
    import transformers as T

    from fsdp2_compat_harness.tiny import moe

    values = dict(MOE[family], **_rope(1000000.0))
    values.update(overrides)
    return tiny.quiet(lambda: getattr(T, moe.CLASSES[family][1])(**values))


def real_size_config(family: str):
    """Config with the published dimensions of a named checkpoint.

    Numbers are hand-copied from the checkpoints' config.json / model cards
    (named per family below), or transformers' own defaults where its
    docstring names the checkpoint (``DEFAULTS_ARE``); they are for counting
    parameters on the meta device, not for loading weights.  A family in
    ``MISSING`` raises ``LookupError`` with the reason.
    """
    if family in MISSING:
        raise LookupError(f"no real-size config for {family!r}: {MISSING[family]}")
    tiny._require(family)
    return tiny.quiet(_real_config, family)


def _real_config(family: str):
    import transformers as T

    major = _tf_major()
    cfg_cls = getattr(T, CLASSES[family][1])

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
    if family in DEFAULTS_ARE:
        if family == "chameleon":
            # The model maps every codebook entry to a BPE token by name; the ids do not change any size.
            codes = cfg_cls().vq_config.num_embeddings
            vocab = {"<image>": 8711}
            vocab.update(("IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(i)) + "Z", 4 + i) for i in range(codes))
            return cfg_cls(vocabulary_map=vocab)
        return cfg_cls()
    raise ValueError(f"unknown family {family!r}")

