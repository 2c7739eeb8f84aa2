"""GLM-Image's image tokenizer for the mixed-ranks fix: one quantizer call per micro-batch, and its dummy.

GLM-Image (``GlmImageModel``, transformers 5.0.0+) turns each source image
into codebook ids *before* it embeds the tokens: ``visual`` (its vision blocks
are layer classes), then ``get_image_tokens``, which runs ``vqmodel.encode``
(a 1x1 ``quant_conv`` and a nearest-code quantizer) once per source image,
then the token embedding of ``input_ids`` with the ids scattered in.  Only
ids reach the loss: no gradient reaches ``visual`` or ``vqmodel`` on any rank.

Two collectives differ between ranks, and this module removes both:

- a text-only micro-batch skips ``visual`` and the quantizer: ``run`` is the
  model's own path on one one-patch image (its ids only, no floating output:
  nothing to add to the loss, so no rank reduce-scatters for the tower), and
  ``fixes.mixed_media`` runs it at the forward's entry (``Tower.first``), in
  the order a media rank's forward reaches those units;
- the quantizer is a layer class of the VQ model (``GlmImageVQVAEVectorQuantizer``):
  where a framework gives it a unit, every ``encode`` call all-gathers, so two
  ranks with different numbers of source images (one or none, or two and one)
  issue different collectives.  ``one_encode`` makes the forward's
  ``get_image_tokens`` encode every image in one call: the conv is 1x1 and the
  quantizer picks a code per position, so the images' features side by side,
  ``[1, channels, 1, total positions]``, give the same ids in the same order
  (``check`` refuses a tokenizer whose conv is not 1x1).

Releases: ``get_image_tokens(features [positions, channels], grid)`` to 5.17
(features packed per image as ``[t, h, w]``), a list of ``[channels, h, w]``
per image from 5.18.0; both are read.  The forward's fingerprints are in
``integrations.transformers_media``.

Delete with ``fixes.mixed_media``.
"""

import contextlib

from . import media_merge


def check(model):
    """None, or why the tokenizer or the dummy cannot be built for ``model``."""
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    vq = getattr(model, "vqmodel", None)
    conv = getattr(vq, "quant_conv", None)
    if vision is None or not all(isinstance(getattr(vision, n, None), int) for n in ("in_channels", "patch_size")):
        return "its vision_config lacks in_channels / patch_size"
    if getattr(vision, "spatial_merge_size", 1) != 1:
        return "its vision_config.spatial_merge_size is not 1"
    if conv is None or tuple(getattr(conv, "kernel_size", ())) != (1, 1) or not hasattr(vq, "encode"):
        return "its vqmodel has no 1x1 quant_conv and encode (one tokenizer call per micro-batch needs both)"
    return None


def _tokens(model, features, grid):
    """``get_image_tokens`` on ``features`` with one ``vqmodel.encode`` call for every image."""
    import torch

    if isinstance(features, (list, tuple)):  # 5.18.0+: [channels, h, w] per image
        side_by_side = torch.cat([f.reshape(f.shape[0], 1, -1) for f in features], dim=-1)
    else:  # to 5.17: [positions, channels], packed per image in (t, h, w) order
        side_by_side = features.transpose(0, 1).reshape(features.shape[-1], 1, -1)
    STATS["encodes"] += 1
    return model.vqmodel.encode(side_by_side[None]).image_tokens.reshape(-1)


STATS = {"encodes": 0}


@contextlib.contextmanager
def one_encode(model):
    """For one forward call of ``model``: its ``get_image_tokens`` encodes every image in one call."""
    with media_merge.for_this_call(
            model, get_image_tokens=lambda features, image_grid_thw=None: _tokens(model, features, image_grid_thw)):
        yield


def run(model, device, zeros):
    """The image path on one image of one patch (grid ``[1, 1, 1]``): its ids, a LongTensor.  ``zeros(tower,
    *shape, device=)``: the dummy's values (``media_towers``, which imports this module)."""
    import torch

    vision = model.config.vision_config
    grid = torch.tensor([[1, 1, 1]], dtype=torch.long, device=device)
    pixels = zeros(model.visual, 1, vision.in_channels * vision.patch_size ** 2, device=device)
    out = model.get_image_features(pixels, grid, return_dict=True)
    features = getattr(out, "pooler_output", out)
    if isinstance(features, (list, tuple)) and features[0].dim() == 2:  # to 5.17: [positions, channels] per image
        features = torch.cat(list(features))
    return _tokens(model, features, grid)
