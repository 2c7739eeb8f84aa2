"""Deterministic tiny batches: kwargs for ``model(**batch)`` that exercise every tower.

Token ids, image grids and audio lengths fit the geometry of ``configs``.
"""

from __future__ import annotations

from . import moe, recent
from .configs import (
    _AUDIO,
    _AUDIO_BOS,
    _AUDIO_EOS,
    _GRID,
    _IMAGE_TOKENS,
    _IMG,
    _MEL,
    _MEL_LEN,
    _SRC_POS,
    _VEND,
    _VID,
    _VSTART,
)
from .text import text_ids, with_placeholders


def _accepts(fn, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# Families whose forward takes an image and a video in one micro-batch (``make_batch(media=...)``); GLM-4.1V's
# cannot (its placeholder mask gives video tokens the image token id).
VIDEO_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "cosmos3_edge")
_VIDEO_FRAMES = 2  # temporal grid of a tiny video: 2 x temporal_patch_size frames (Qwen2-VL, Qwen2.5-VL)


def make_batch(family: str, model, *, seed: int, batch_size: int = 2, media=("image",)) -> dict:
    """Deterministic kwargs for ``model(**batch)`` (with labels -> scalar loss).

    ``media``: the kinds each row carries, for ``VIDEO_FAMILIES``: ``("image",)`` (the default, every
    family), ``("video",)`` or ``("image", "video")`` (one image then one video per row); Step-3.7:
    ``("image", "crops")`` (Step-3.7, DeepSeek-OCR-2: each image with one local crop)."""
    if tuple(media) == ("image", "crops") and family in ("step3p7", "deepseek_ocr2"):  # each image with one local crop
        return recent.make_batch(family, model, seed=seed, batch_size=batch_size, crops=True)
    if tuple(media) != ("image",):
        return _with_videos(family, model, seed, batch_size, tuple(media))
    if family in recent.CLASSES:
        return recent.make_batch(family, model, seed=seed, batch_size=batch_size)
    if family in moe.CLASSES:
        return moe.make_batch(model, seed=seed, batch_size=batch_size)
    import torch

    gen = torch.Generator().manual_seed(int(seed))
    cfg = model.config

    if family in ("qwen2", "llama"):
        ids = torch.stack([text_ids(gen, 12) for _ in range(batch_size)])
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
        input_ids, attn, labels = with_placeholders(gen, batch_size, 5, span, 6)
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
        input_ids, attn, labels = with_placeholders(gen, batch_size, 5, span, 6)
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
        input_ids, attn, labels = with_placeholders(gen, batch_size, 4, span, 6)
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
        input_ids, attn, labels = with_placeholders(gen, batch_size, 4, span, 6)
        return {
            "input_ids": input_ids,
            "attention_mask": attn,
            "input_features": input_features,
            "labels": labels,
        }

    raise ValueError(f"unknown family {family!r}")


def _with_videos(family, model, seed, batch_size, media):
    """Rows with an image and / or a video (``_VIDEO_FRAMES`` temporal patches of a ``_GRID`` square)."""
    import torch

    if family not in VIDEO_FAMILIES or not media or not set(media) <= {"image", "video"}:
        raise ValueError("media=%r: %s takes ('image',) only (videos: %s)" % (media, family, VIDEO_FAMILIES))
    gen = torch.Generator().manual_seed(int(seed))
    vcfg = model.config.vision_config
    if getattr(vcfg, "temporal_patch_size", None):  # the Qwen towers' Conv3d patches
        width = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size**2
    else:  # Cosmos-3 Edge: flat 2D patches (recent's ids and geometry are this module's)
        width = vcfg.num_channels * vcfg.patch_size**2
    # Qwen2-VL's and Qwen2.5-VL's M-RoPE take one span for a whole video.  Qwen3-VL's and Cosmos-3's want one
    # span per temporal patch, and their releases disagree on how those spans meet the grid (4.57 and 5.8+
    # split the video's grid per temporal patch, 5.3.0 does not): one temporal patch is the same layout in all.
    frames = 1 if family.startswith("qwen3") or family == "cosmos3_edge" else _VIDEO_FRAMES
    spans = {"image": [_VSTART] + [_IMG] * _IMAGE_TOKENS + [_VEND],
             "video": [_VSTART] + [_VID] * (_IMAGE_TOKENS * frames) + [_VEND]}
    input_ids, attn, labels = with_placeholders(gen, batch_size, 5, sum((spans[k] for k in media), []), 6)
    batch = {"input_ids": input_ids, "attention_mask": attn, "labels": labels}
    if "image" in media:
        batch["pixel_values"] = torch.randn(batch_size * _GRID * _GRID, width, generator=gen)
        batch["image_grid_thw"] = torch.tensor([[1, _GRID, _GRID]] * batch_size, dtype=torch.long)
    if "video" in media:
        batch["pixel_values_videos"] = torch.randn(batch_size * frames * _GRID * _GRID, width, generator=gen)
        batch["video_grid_thw"] = torch.tensor([[frames, _GRID, _GRID]] * batch_size, dtype=torch.long)
    _add_mm_token_type_ids(model, batch)
    return batch


def _add_mm_token_type_ids(model, batch: dict) -> None:
    """transformers 5.x computes 3D (M-RoPE) positions only when given
    ``mm_token_type_ids`` (0 text, 1 image, 2 video); 4.x derives them from ids."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # (a peft model: its base's)
    inner = getattr(base, "model", base)
    fn = getattr(inner, "get_rope_index", None)
    if fn is None or not _accepts(fn, "mm_token_type_ids"):
        return
    ids = batch["input_ids"]
    tt = torch.zeros_like(ids, dtype=torch.int32)
    tt[ids == _IMG] = 1
    tt[ids == _VID] = 2
    batch["mm_token_type_ids"] = tt
