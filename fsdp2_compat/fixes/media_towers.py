"""The media towers the mixed-ranks fix knows (``fixes.mixed_media``): one declarative entry per tower kind.

Each ``Tower`` says, for the base model class whose ``forward`` is wrapped (``integrations.transformers_media``): the
attribute that holds the tower, the forward's arguments that carry media (any of them given: the tower runs, no
dummy), the token embedding module the forward calls first (the fix hooks its output), what the dummy needs from the
config (``check``: None or why not), and how to run the model's *own* feature function (Qwen2-Audio has none: its
tower and projector, as its forward runs them) on the smallest input it accepts (``run(model, device)``: its output,
whose floating tensors the fix multiplies by 0).  The dummy must go through every parameterised module the real media
path reaches (tower and projector), so every FSDP2 unit sees the same collectives as on a media rank; its values do
not matter (zeros). Optional fields cover forwards that run the tower more than once (``pad``, ``merge``), before the
embedding (``first``), or need one call per micro-batch of a unit they call per image (``around``).

``TOWERS`` maps the base model class name to its entry; a class without one gets ``PATCH_GRID`` (the Qwen/GLM
families, where the fix started).  A model whose entry's tower attribute is missing, or whose config lacks what the
dummy needs, is left alone by the fix, with a warning naming why (``reason``).
"""

from typing import Callable, NamedTuple, Optional, Tuple

from . import vq_tokens


class Tower(NamedTuple):
    attr: str  # the tower's attribute on the base model
    media: Tuple[str, ...]  # forward arguments that carry media
    check: Callable  # (model) -> None, or why the dummy cannot be built from its config
    run: Callable  # (model, device) -> the model's own feature output on the smallest valid dummy
    # the token embedding the forward calls before it runs the tower (the fix hooks it): (model) -> module
    embed: Callable = lambda model: model.get_input_embeddings()
    # arguments that, all given, make the forward run the tower once per media kind; ``fixes.media_merge`` then
    # runs it once for all of them (empty: one kind per micro-batch, nothing to merge)
    merge: Tuple[str, ...] = ()
    # ``(argument, run)``: a micro-batch with media but without this optional argument runs the tower fewer times
    # than one with it (Step-3.7's local crops: a second tower call); ``run(model, device)`` is the missing
    # call on its smallest dummy, added with a zero contribution so every micro-batch runs the tower as often
    pad: Optional[Tuple[str, Callable]] = None
    # the forward runs the tower before the token embedding (GLM-Image): the dummy runs at the forward's entry,
    # in that order, and returns no floating output (nothing of such a tower reaches the loss on any rank)
    first: bool = False
    # ``(model) -> context manager`` around a media micro-batch's forward, so it runs each unit as often as the
    # dummy does (GLM-Image: one tokenizer call for all its images, ``fixes.vq_tokens``)
    around: Optional[Callable] = None


def _ints(obj, *names):
    values = [getattr(obj, n, None) for n in names]
    return values if all(isinstance(v, int) and v > 0 for v in values) else None


def _vision(model):
    return getattr(getattr(model, "config", None), "vision_config", None)


def _zeros(tower, *shape, device):
    """The dummy's values: zeros in the dtype of ``tower``'s parameters, as a real micro-batch arrives (a bf16
    model's trainer casts its media to bf16; AudioFlamingo3's tower does not cast what it is given, and a float32
    window against bf16 weights raises "Input type (float) and bias type (c10::BFloat16) should be the same")."""
    import torch

    dtype = next((p.dtype for p in tower.parameters() if p.is_floating_point()), torch.get_default_dtype())
    return torch.zeros(*shape, device=device, dtype=dtype)


# --- Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), GLM-4.1V/4.5V/4.6V, Qwen3.5(-MoE) -------------------------------
# Patches come flattened, ``[n, channels * temporal patch * patch**2]``, with a ``[t, h, w]`` grid per image;
# the tower merges ``m x m`` patches into one token (``spatial_merge_size``), so the smallest image the merger
# accepts is one ``[1, m, m]`` grid of ``m * m`` patches: one merged token.

def _grid_geometry(model):
    vision = _vision(model)
    if vision is None:
        return "its config has no vision_config"
    channels = getattr(vision, "in_channels", None) or getattr(vision, "in_chans", None)
    rest = _ints(vision, "temporal_patch_size", "patch_size", "spatial_merge_size")
    if not (isinstance(channels, int) and channels > 0 and rest):
        return "its vision_config lacks in_channels / temporal_patch_size / patch_size / spatial_merge_size"
    temporal, patch, merge = rest
    return channels * temporal * patch * patch, merge


def _grid_run(model, device):
    import torch

    width, merge = _grid_geometry(model)
    grid = torch.tensor([[1, merge, merge]], dtype=torch.long, device=device)
    return model.get_image_features(_zeros(model.visual, merge * merge, width, device=device), grid)


def _grid_check(model):
    geometry = _grid_geometry(model)
    return geometry if isinstance(geometry, str) else None


# Images and videos go through the same tower code (Qwen families): one merged call (``fixes.media_merge``).
PATCH_GRID = Tower("visual", ("pixel_values", "pixel_values_videos"), _grid_check, _grid_run,
                   merge=("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"))
# GLM-4.1V/4.5V/4.6V: every release marks video tokens with the image token id (``get_placeholder_mask``), so
# a micro-batch with an image and a video fails in transformers itself; one kind per micro-batch, no merge.
GLM_GRID = PATCH_GRID._replace(merge=())


# --- HunYuan-VL (``HunYuanVLModel``), Cosmos-3 Edge (``Cosmos3EdgeModel``): transformers 5.13+ / 5.15+ --------
# Flat patches without a temporal patch, ``[n, channels * patch**2]``, with the same ``[t, h, w]`` grid; the
# merger (HunYuan-VL: a stride-``m`` convolution that needs a side > 1; Cosmos-3: its projector) turns ``m x m``
# patches into one token, so the smallest image is one ``[1, s, s]`` grid, ``s = m`` (2 where ``m`` is 1).

def _flat_geometry(model):
    vision = _vision(model)
    rest = _ints(vision, "num_channels", "patch_size", "spatial_merge_size") if vision is not None else None
    if not rest:
        return "its vision_config lacks num_channels / patch_size / spatial_merge_size"
    channels, patch, merge = rest
    return channels * patch * patch, merge if merge > 1 else 2


def _flat_check(model):
    geometry = _flat_geometry(model)
    return geometry if isinstance(geometry, str) else None


def _flat_run(model, device):
    import torch

    width, side = _flat_geometry(model)
    grid = torch.tensor([[1, side, side]], dtype=torch.long, device=device)
    return model.get_image_features(_zeros(getattr(model, for_model(model).attr), side * side, width, device=device),
                                    grid)


# --- PaddleOCR-VL (``PaddleOCRVLModel``) --------------------------------------------------------------------
# ``get_image_features(pixel_values [n, channels, patch, patch], image_grid_thw)``: unflattened patches, the
# same ``[t, h, w]`` grid; its projector (outside ``visual``, run by ``get_image_features``) merges
# ``spatial_merge_size`` squared patches into a token, so one ``[1, m, m]`` grid is again the smallest image.

def _paddle_check(model):
    vision = _vision(model)
    if vision is None or not _ints(vision, "num_channels", "patch_size", "spatial_merge_size"):
        return "its vision_config lacks num_channels / patch_size / spatial_merge_size"
    return None


def _paddle_run(model, device):
    import torch

    channels, patch, merge = _ints(_vision(model), "num_channels", "patch_size", "spatial_merge_size")
    grid = torch.tensor([[1, merge, merge]], dtype=torch.long, device=device)
    return model.get_image_features(_zeros(model.visual, merge * merge, channels, patch, patch, device=device), grid)


# --- LFM2-VL (``Lfm2VlModel``) ------------------------------------------------------------------------------
# SigLIP2 NaFlex tower (``vision_tower``): ``get_image_features(pixel_values [b, n, channels * patch**2],
# spatial_shapes [b, 2] (patches per side), pixel_attention_mask [b, n])``; its projector pixel-unshuffles by
# ``downsample_factor`` (f), so the smallest image it accepts is ``f x f`` patches (one token), all valid.

def _lfm2_check(model):
    config = getattr(model, "config", None)
    vision = _vision(model)
    if vision is None or not _ints(vision, "num_channels", "patch_size") or not _ints(config, "downsample_factor"):
        return "its config lacks vision_config.num_channels / patch_size or downsample_factor"
    return None


def _lfm2_run(model, device):
    import torch

    channels, patch = _ints(_vision(model), "num_channels", "patch_size")
    (factor,) = _ints(model.config, "downsample_factor")
    n = factor * factor
    return model.get_image_features(
        pixel_values=_zeros(model.vision_tower, 1, n, channels * patch * patch, device=device),
        spatial_shapes=torch.tensor([[factor, factor]], dtype=torch.long, device=device),
        pixel_attention_mask=torch.ones(1, n, dtype=torch.long, device=device))


# --- Step-3.7 (``Step3p7Model``): transformers 5.16+ --------------------------------------------------------
# ``get_image_features(pixel_values [n, channels, s, s], pixel_values_local, num_local_patches)`` runs
# ``vision_model`` (interpolated positions: any whole number of patches per side; two stride-2 convolutions)
# and the projector on the global views, and again on the local crops when the micro-batch has any: two tower
# calls with crops, one without.  So every micro-batch runs it twice: a text-only one on a one-patch view and
# one one-patch crop, one without crops gets the crop call on a one-patch crop (``pad``).

def _step3p7_check(model):
    if not _ints(_vision(model), "num_channels", "patch_size"):
        return "its vision_config lacks num_channels / patch_size"
    return None


def _step3p7_view(model, device):
    channels, patch = _ints(_vision(model), "num_channels", "patch_size")
    return _zeros(model.vision_model, 1, channels, patch, patch, device=device)


def _step3p7_run(model, device):
    return model.get_image_features(_step3p7_view(model, device), _step3p7_view(model, device), [1])


def _step3p7_crop_run(model, device):
    return model.get_image_features(_step3p7_view(model, device))


# --- Chameleon (``ChameleonModel``) ----------------------------------------------------------------------------
# ``get_image_features(pixel_values [n, channels, s, s])``: the VQ-VAE encoder (``vqmodel``, whose blocks are
# layer classes) turns each image into codebook ids, which the token embedding embeds (a tensor to 4.57, the
# ``pooler_output`` of the VQ output from 5.0.0).  Only those embeddings reach the loss: no gradient reaches the
# encoder on any rank, so the dummy adds only them (the VQ output's latents would send one into it on the
# text-only rank alone).  The encoder halves the side once per channel multiplier but the last, and its group
# norms need more than one value per group in training: the dummy is ``2 ** levels`` pixels square, 2x2 codes.

def _chameleon_check(model):
    vq = getattr(getattr(model, "config", None), "vq_config", None)
    levels = getattr(vq, "channel_multiplier", None)
    if not _ints(vq, "in_channels") or not isinstance(levels, (list, tuple)) or not levels:
        return "its vq_config lacks in_channels / channel_multiplier"
    return None


def _chameleon_run(model, device):
    vq = model.config.vq_config
    side = 2 ** len(vq.channel_multiplier)
    out = model.get_image_features(_zeros(model.vqmodel, 1, vq.in_channels, side, side, device=device))
    return getattr(out, "pooler_output", out)


# --- DeepSeek-OCR-2 (``DeepseekOcr2Model``): transformers 5.10.1+ --------------------------------------------
# ``get_image_features(pixel_values [n, channels, s, s], pixel_values_local, num_local_patches)`` runs
# ``vision_tower`` (SAM layers, two stride-2 convolutions, then an encoder over the patches and a learned query
# table) and the projector on the global views, and again on the local crops when the micro-batch has any, as
# Step-3.7 does: every micro-batch runs it twice (``pad``: a dummy crop where there are none).  The encoder
# appends its 144-row ``query_768_resolution`` table when the SAM grid, quartered per side, is at most 144
# patches, else the 256-row ``query_1024_resolution``: each table lives in the enclosing unit, so the dummy view
# must pick the table a real global view picks (the SAM pretraining size ``sam_config.image_size``): one patch
# when that size picks the small one (the tiny models), else the smallest square past 144 (13 per side: 784 px
# for the released 1024-px config, 59% of one real global view).  Real crops pick the small table: one patch.

def _deepseek_ocr2_sides(model):
    """``(view side, crop side, channels)`` in pixels, or why not."""
    import math

    sam = getattr(_vision(model), "sam_config", None)
    size, patch, channels = _ints(sam, "image_size", "patch_size", "num_channels") or (None, None, None)
    small = getattr(getattr(getattr(model, "vision_tower", None), "query_768_resolution", None), "num_embeddings", None)
    if size is None or not isinstance(small, int):
        return "its vision_config.sam_config lacks image_size / patch_size / num_channels, or its vision_tower " \
               "has no query_768_resolution table"
    per_side = math.ceil(math.ceil((size // patch) / 2) / 2)  # the SAM grid after the two stride-2 convolutions
    view = patch if per_side * per_side <= small else (4 * (math.isqrt(small) + 1) - 3) * patch
    return view, patch, channels


def _deepseek_ocr2_check(model):
    sides = _deepseek_ocr2_sides(model)
    return sides if isinstance(sides, str) else None


def _deepseek_ocr2_image(model, side, channels, device):
    return _zeros(model.vision_tower, 1, channels, side, side, device=device)


def _deepseek_ocr2_run(model, device):
    view, crop, channels = _deepseek_ocr2_sides(model)
    return model.get_image_features(_deepseek_ocr2_image(model, view, channels, device),
                                    _deepseek_ocr2_image(model, crop, channels, device), [1])


def _deepseek_ocr2_crop_run(model, device):
    # get_image_features runs the global view first: the crop call alone is the tower and the projector
    _, crop, channels = _deepseek_ocr2_sides(model)
    return model.multi_modal_projector(model.vision_tower(_deepseek_ocr2_image(model, crop, channels, device))
                                       .last_hidden_state)


# --- Qwen2-Audio, Voxtral, AudioFlamingo3 (``*ForConditionalGeneration`` to 5.9.0, ``*Model`` from 5.10.0) ---
# Whisper-style ``audio_tower``: it accepts exactly ``max_source_positions * conv1 stride * conv2 stride`` mel
# frames (Qwen2-Audio and Voxtral raise on any other length; AudioFlamingo3 adds ``embed_positions.weight`` whole, so any other
# length fails to broadcast), so the smallest valid input is one whole window of zeros (for the released
# checkpoints, 3000 frames: one 30 s chunk, the cost of one audio micro-batch's encoder forward), all of it
# valid in AudioFlamingo3's ``input_features_mask``; ``get_audio_features`` runs the tower and the projector.

def _whisper_check(model):
    audio = getattr(getattr(model, "config", None), "audio_config", None)
    tower = getattr(model, "audio_tower", None)
    if audio is None or not _ints(audio, "num_mel_bins", "max_source_positions"):
        return "its audio_config lacks num_mel_bins / max_source_positions"
    if not all(hasattr(tower, c) for c in ("conv1", "conv2")):
        return "its audio_tower has no conv1 / conv2 (not the Whisper-style encoder)"
    return None


def _whisper_window(model, device):
    mel, positions = _ints(model.config.audio_config, "num_mel_bins", "max_source_positions")
    tower = model.audio_tower
    return _zeros(tower, 1, mel, positions * tower.conv1.stride[0] * tower.conv2.stride[0], device=device)


def _voxtral_run(model, device):
    return model.get_audio_features(_whisper_window(model, device))


def _audioflamingo3_run(model, device):
    import torch

    features = _whisper_window(model, device)
    return model.get_audio_features(features, torch.ones(1, features.shape[-1], dtype=torch.long, device=device))


# Qwen2-Audio has no feature function: its forward runs ``audio_tower`` and then ``multi_modal_projector``
# inline (with a padding mask the whole window does not need: every frame is valid), and so does its dummy.
# (Its forward runs the tower only when it embeds ``input_ids`` itself: a caller that passes ``inputs_embeds``
# with audio gets no tower on that rank, patched or not, while a text-only rank runs the dummy; no trainer
# this project runs does that, and the audio would be silently ignored anyway.)
def _qwen2_audio_run(model, device):
    return model.multi_modal_projector(model.audio_tower(_whisper_window(model, device)).last_hidden_state)


_QWEN2_AUDIO = Tower("audio_tower", ("input_features",), _whisper_check, _qwen2_audio_run)
_VOXTRAL = Tower("audio_tower", ("input_features",), _whisper_check, _voxtral_run)
_AUDIOFLAMINGO3 = Tower("audio_tower", ("input_features",), _whisper_check, _audioflamingo3_run)

TOWERS = {
    "Glm4vModel": GLM_GRID,
    "Glm4vMoeModel": GLM_GRID,
    "Glm46VModel": GLM_GRID,
    # every release's forward calls ``self.language_model.embed_tokens`` itself (from 5.9.0 the class has no
    # get_input_embeddings of its own)
    "PaddleOCRVLModel": Tower("visual", ("pixel_values",), _paddle_check, _paddle_run,
                              lambda model: model.language_model.embed_tokens),
    "Lfm2VlModel": Tower("vision_tower", ("pixel_values",), _lfm2_check, _lfm2_run),
    "HunYuanVLModel": Tower("vision_tower", ("pixel_values",), _flat_check, _flat_run),
    # its get_video_features calls get_image_features: images and videos merge as the Qwen families'
    "Cosmos3EdgeModel": Tower("visual", ("pixel_values", "pixel_values_videos"), _flat_check, _flat_run,
                              merge=PATCH_GRID.merge),
    "Step3p7Model": Tower("vision_model", ("pixel_values", "pixel_values_local"), _step3p7_check, _step3p7_run,
                          pad=("pixel_values_local", _step3p7_crop_run)),
    "ChameleonModel": Tower("vqmodel", ("pixel_values",), _chameleon_check, _chameleon_run),
    "GlmImageModel": Tower("visual", ("pixel_values",), vq_tokens.check,
                           lambda model, device: vq_tokens.run(model, device, _zeros), first=True,
                           around=vq_tokens.one_encode),
    "DeepseekOcr2Model": Tower("vision_tower", ("pixel_values",), _deepseek_ocr2_check, _deepseek_ocr2_run,
                               pad=("pixel_values_local", _deepseek_ocr2_crop_run)),
    "Qwen2AudioForConditionalGeneration": _QWEN2_AUDIO,
    "Qwen2AudioModel": _QWEN2_AUDIO,
    "VoxtralForConditionalGeneration": _VOXTRAL,
    "VoxtralModel": _VOXTRAL,
    "AudioFlamingo3ForConditionalGeneration": _AUDIOFLAMINGO3,
    "AudioFlamingo3Model": _AUDIOFLAMINGO3,
}


def for_model(model) -> Tower:
    """The entry of ``model``'s class (or of the nearest base class with one), else ``PATCH_GRID``."""
    for cls in type(model).__mro__:
        if cls.__name__ in TOWERS:
            return TOWERS[cls.__name__]
    return PATCH_GRID


def reason(model) -> Optional[str]:
    """Why the dummy cannot be built for ``model`` (None when it can)."""
    tower = for_model(model)
    if getattr(model, tower.attr, None) is None:
        return "it has no `%s` tower" % tower.attr
    return tower.check(model)


def media_inputs():
    """Every argument name that carries media into a wrapped forward (any family)."""
    names = dict.fromkeys(PATCH_GRID.media)
    for tower in TOWERS.values():
        names.update(dict.fromkeys(tower.media))
    return tuple(names)
