"""Tiny configs and batches of the families new in transformers 5.1x.

Same geometry as ``configs`` (hidden 32, 2 heads, 1-2 layers, depth-1 towers,
4x4 patches of 4x4 pixels, vocab 256, placeholder ids near the top of the
vocab).  ``configs.tiny_config`` and ``batches.make_batch`` hand these
families over to ``tiny_config`` / ``make_batch`` here; ``unavailable()`` says
"transformers X has no ..." where the installed release lacks the classes
(hunyuan_vl, step3p7 and cosmos3_edge are not in 5.10.x).

Where each reads an embedding's ``.weight`` outside that embedding's forward
(transformers 5.16.1):

- hunyuan_vl    ``HunYuanVLVisionPatchEmbed.interpolate_pos_encoding`` slices
                ``position_embedding.weight[1:, :]`` on every forward, then adds it
- step3p7       ``Step3p7VisionModel`` always interpolates: ``position_embedding.weight``
                is unsqueezed and added to the patch embeddings
- glm_image     GLM4V-style ``grid_sample`` on the vision ``position_embedding.weight``;
                the VQ tokenizer normalises its codebook ``embedding.weight`` (a
                ``_no_split_modules`` class holding an ``nn.Embedding``)
- cosmos3_edge  SigLIP2-style ``position_embedding.weight.reshape``, then added
- deepseek_ocr2 the encoder's learned queries ``query_768_resolution.weight``, concatenated
- chameleon     the VQ codebook ``embedding.weight`` (a layer class holding an
                ``nn.Embedding``) when ``pixel_values`` are tokenized

Step-3.7's config class has no top-level ``tie_word_embeddings`` (only its
text config has one), and neither does this tiny config: SkyRL's
``apply_fsdp2`` reads that attribute without a default.
Nothing but ``text`` (a leaf of this package) is imported at module import.
"""

from __future__ import annotations

from .text import with_placeholders

FAMILIES: tuple[str, ...] = ("hunyuan_vl", "step3p7", "glm_image", "cosmos3_edge", "deepseek_ocr2", "chameleon")

# family -> (transformers model class, transformers config class)
CLASSES: dict[str, tuple[str, str]] = {
    "hunyuan_vl": ("HunYuanVLForConditionalGeneration", "HunYuanVLConfig"),
    "step3p7": ("Step3p7ForConditionalGeneration", "Step3p7Config"),
    "glm_image": ("GlmImageForConditionalGeneration", "GlmImageConfig"),
    "cosmos3_edge": ("Cosmos3EdgeForConditionalGeneration", "Cosmos3EdgeConfig"),
    "deepseek_ocr2": ("DeepseekOcr2ForConditionalGeneration", "DeepseekOcr2Config"),
    "chameleon": ("ChameleonForConditionalGeneration", "ChameleonConfig"),
}

# Oldest transformers each tiny config and batch were checked on, where older releases have the
# classes with another forward (GLM-Image's tiny batch does not fit 5.0.0rc3's vision tower).
MIN_TRANSFORMERS = {"glm_image": "5.8.0"}

_VOCAB = 256
_HIDDEN = 32
_HEADS = 2
_KV_HEADS = 1
_HEAD_DIM = _HIDDEN // _HEADS
_INTER = 64
_LAYERS = 2
_NEWLINE = 249
_IMG = 250
_VID = 251
_START = 252
_END = 253
_PATCH = 4
_GRID = 4  # patches per side of one image
_MERGE = 2
_CODEBOOK = 16  # VQ codebook entries (glm_image, chameleon)
_DEEPSEEK_QUERIES = 144  # rows of DeepSeek-OCR-2's query_768_resolution table
_VQ_TOKENS = (_GRID * _PATCH // 4) ** 2  # chameleon: 16x16 px, downsampled 4x -> 16 image tokens


def _text(tie: bool, **over) -> dict:
    d = dict(
        vocab_size=_VOCAB, hidden_size=_HIDDEN, intermediate_size=_INTER, num_hidden_layers=_LAYERS,
        num_attention_heads=_HEADS, num_key_value_heads=_KV_HEADS, max_position_embeddings=256,
        tie_word_embeddings=tie, pad_token_id=0,
    )
    d.update(over)
    return d


def _rope(**extra) -> dict:
    return {"rope_parameters": dict({"rope_type": "default", "rope_theta": 10000.0}, **extra)}


def tiny_config(family: str, tie: bool):
    import transformers as T

    cfg_cls = getattr(T, CLASSES[family][1])
    if family == "hunyuan_vl":
        vision = dict(
            hidden_size=_HIDDEN, intermediate_size=_INTER, num_attention_heads=_HEADS, num_hidden_layers=1,
            num_channels=3, patch_size=_PATCH, spatial_merge_size=_MERGE, out_hidden_size=_HIDDEN,
            text_hidden_size=_HIDDEN, max_image_size=_GRID * _PATCH, min_image_size=_GRID * _PATCH,
        )
        text = _text(tie, head_dim=_HEAD_DIM, **_rope(mrope_section=[2, 2, 2, 2]))
        return cfg_cls(text_config=text, vision_config=vision, image_token_id=_IMG, im_start_id=_START,
                       im_end_id=_END, im_newline_id=_NEWLINE, tie_word_embeddings=tie)
    if family == "step3p7":
        vision = dict(
            hidden_size=_HIDDEN, intermediate_size=_INTER, num_hidden_layers=1, num_attention_heads=_HEADS,
            num_channels=3, image_size=_GRID * _PATCH, patch_size=_PATCH, mlp_ratio=_INTER / _HIDDEN,
            max_position_embeddings=_GRID * _GRID,
        )
        text = _text(
            tie, head_dim=_HEAD_DIM, layer_types=["full_attention"] * _LAYERS, mlp_layer_types=["dense", "sparse"],
            moe_intermediate_size=32, n_routed_experts=4, num_local_experts=4, num_experts_per_tok=2,
            share_expert_dim=32, sliding_window=64,  # the model builds a sliding mask even if no layer uses it
        )
        # No top-level tie_word_embeddings, as the config class declares none.
        return cfg_cls(text_config=text, vision_config=vision, image_token_id=_IMG)
    if family == "glm_image":
        vision = dict(
            depth=1, hidden_size=_HIDDEN, intermediate_size=_INTER, num_heads=_HEADS, in_channels=3,
            image_size=_GRID * _PATCH, patch_size=_PATCH, spatial_merge_size=1,
        )
        # The VQ tokenizer quantizes the vision tower's output: latent_channels = vision hidden size.
        vq = dict(embed_dim=_HIDDEN, num_embeddings=_CODEBOOK, latent_channels=_HIDDEN, in_channels=3)
        text = _text(tie, vision_vocab_size=_VOCAB, attention_bias=True, eos_token_id=_END,
                     **_rope(mrope_section=[2, 3, 3]))
        return cfg_cls(text_config=text, vision_config=vision, vq_config=vq, image_token_id=_IMG,
                       image_start_token_id=_START, image_end_token_id=_END, tie_word_embeddings=tie)
    if family == "cosmos3_edge":
        vision = dict(
            hidden_size=_HIDDEN, intermediate_size=_INTER, num_hidden_layers=1, num_attention_heads=_HEADS,
            num_channels=3, patch_size=_PATCH, num_patches=_GRID * _GRID, spatial_merge_size=_MERGE,
        )
        text = _text(tie, head_dim=_HEAD_DIM, **_rope(mrope_section=[2, 3, 3]))
        return cfg_cls(text_config=text, vision_config=vision, projector_hidden_size=_HIDDEN, image_token_id=_IMG,
                       video_token_id=_VID, vision_start_token_id=_START, vision_end_token_id=_END,
                       tie_word_embeddings=tie)
    if family == "deepseek_ocr2":
        # SAM (4x4 patches of 16 px, one global-attention layer), then two stride-2 convolutions: one
        # patch, so the encoder appends its 144-row query table (query_768_resolution, read as .weight).
        sam = dict(
            hidden_size=_HIDDEN, output_channels=_HIDDEN, num_hidden_layers=1, num_attention_heads=_HEADS,
            image_size=64, patch_size=16, window_size=2, global_attn_indexes=[0],
            downsample_channels=[_HIDDEN, _HIDDEN],
        )
        encoder = dict(
            hidden_size=_HIDDEN, intermediate_size=_INTER, num_hidden_layers=1, num_attention_heads=_HEADS,
            num_key_value_heads=_KV_HEADS, vocab_size=_VOCAB,
        )
        text = _text(tie, mlp_layer_types=["dense"] * _LAYERS, **_rope())
        return cfg_cls(text_config=text, vision_config=dict(sam_config=sam, encoder_config=encoder),
                       image_token_id=_IMG, tie_word_embeddings=tie)
    if family == "chameleon":
        # VQ tokenizer: 16x16 px, two 2x downsamplings -> 4x4 = 16 image tokens from a 16-entry codebook.
        # The vocabulary map names codebook entry i "IMGIMG<digits of i as letters A-J>Z" at BPE id 256 + i,
        # above the text ids (Chameleon masks image-token logits: a text label there would be an infinite loss).
        vq = dict(embed_dim=_HIDDEN, num_embeddings=_CODEBOOK, latent_channels=_HIDDEN, resolution=_GRID * _PATCH,
                  base_channels=32, channel_multiplier=[1, 1, 1], num_res_blocks=1, attn_resolutions=[])
        vocab_map = {"<image>": _IMG}
        for i in range(_CODEBOOK):
            vocab_map["IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(i)) + "Z"] = _VOCAB + i
        return cfg_cls(**_text(tie, vocab_size=_VOCAB + _CODEBOOK, **_rope()), vq_config=vq,
                       vocabulary_map=vocab_map, image_token_id=_IMG)
    raise ValueError(f"unknown family {family!r}")


def make_batch(family: str, model, *, seed: int, batch_size: int = 2, crops: bool = False) -> dict:
    """Deterministic kwargs for ``model(**batch)`` (with labels -> scalar loss).  ``crops`` (Step-3.7,
    DeepSeek-OCR-2): each image also brings one local crop (``pixel_values_local``), whose tokens come before
    the global view's."""
    import torch

    gen = torch.Generator().manual_seed(int(seed))
    n = _GRID * _GRID
    grid = torch.tensor([[1, _GRID, _GRID]] * batch_size, dtype=torch.long)
    if family in ("hunyuan_vl", "cosmos3_edge"):
        patch_dim = 3 * _PATCH * _PATCH
        if family == "hunyuan_vl":  # merged grid, a newline token per merged row, begin / end
            span = [_IMG] * ((_GRID // _MERGE) * (_GRID // _MERGE + 1) + 2)
        else:
            span = [_START] + [_IMG] * (n // _MERGE ** 2) + [_END]
        ids, attn, labels = with_placeholders(gen, batch_size, 5, span, 6)
        return {"input_ids": ids, "attention_mask": attn, "labels": labels, "image_grid_thw": grid,
                "pixel_values": torch.randn(batch_size * n, patch_dim, generator=gen),
                "mm_token_type_ids": (ids == _IMG).to(torch.int32)}
    if family == "step3p7":
        # Two stride-2 convolutions after the patch embedding: one token per 4x4-patch image.
        ids, attn, labels = with_placeholders(gen, batch_size, 5, [_IMG] * (2 if crops else 1), 6)
        side = _GRID * _PATCH
        batch = {"input_ids": ids, "attention_mask": attn, "labels": labels,
                 "pixel_values": torch.randn(batch_size, 3, side, side, generator=gen)}
        if crops:
            batch.update(pixel_values_local=torch.randn(batch_size, 3, side, side, generator=gen),
                         num_local_patches=[1] * batch_size)
        return batch
    if family == "glm_image":
        # Image-to-image: each sample's source image (tokenized by the VQ model), then the target grid.
        ids, attn, labels = with_placeholders(gen, batch_size, 5, [_START] + [_IMG] * n + [_END], 6)
        ids = torch.cat([ids, torch.full((batch_size, 1), _START, dtype=torch.long)], dim=1)
        labels = torch.cat([labels, torch.full((batch_size, 1), -100, dtype=torch.long)], dim=1)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
                "pixel_values": torch.randn(batch_size * n, 3 * _PATCH * _PATCH, generator=gen),
                "image_grid_thw": torch.tensor([[1, _GRID, _GRID]] * (2 * batch_size), dtype=torch.long),
                "images_per_sample": torch.tensor([2] * batch_size)}
    if family == "deepseek_ocr2":
        # + view separator; a 64-px crop is one patch after the convolutions too: the same 144 queries
        span = [_IMG] * (_DEEPSEEK_QUERIES * (2 if crops else 1) + 1)
        ids, attn, labels = with_placeholders(gen, batch_size, 5, span, 6)
        batch = {"input_ids": ids, "attention_mask": attn, "labels": labels,
                 "pixel_values": torch.randn(batch_size, 3, 64, 64, generator=gen)}
        if crops:
            batch.update(pixel_values_local=torch.randn(batch_size, 3, 64, 64, generator=gen),
                         num_local_patches=[1] * batch_size)
        return batch
    if family == "chameleon":
        ids, attn, labels = with_placeholders(gen, batch_size, 5, [_START] + [_IMG] * _VQ_TOKENS + [_END], 6)
        return {"input_ids": ids, "attention_mask": attn, "labels": labels,
                "pixel_values": torch.randn(batch_size, 3, _GRID * _PATCH, _GRID * _PATCH, generator=gen)}
    raise ValueError(f"unknown family {family!r}")
