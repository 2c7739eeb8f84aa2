"""What the mixed-ranks fix costs a text-only micro-batch: its dummy vision forward, at real size.

For real-size Qwen3-VL-8B and GLM-4.1V-9B configs (``tests/support/real_size.py``),
built on the meta device (no weights, no memory):

- compute: the FLOPs of the model's own ``get_image_features`` on the dummy
  ``fsdp2_compat.fixes.mixed_media`` feeds it (zeros, a ``[1, m, m]`` patch grid:
  one merged token), as a ratio of one real image micro-batch's (a 448x448 /
  512x512 image: ``IMAGE_GRIDS``), counted by ``torch.utils.flop_counter``
  (forward only; backward is about twice the forward for both).  GLM4V's
  position-embedding interpolation calls ``.item()``, which the meta device
  cannot: it is skipped for both grids (elementwise work, no matmul); transformers 5.24+ computes the
  position indices, weights and ids from the grid on the CPU: they are moved to meta (index arithmetic);
- collectives: the bytes the vision units move for that micro-batch (what an
  image rank moves anyway, and what a text-only rank would otherwise skip and
  hang on): per rank, bf16 all-gathers of the vision parameters in forward and
  again in backward (``reshard_after_forward=True``) and the fp32
  reduce-scatter of their gradients, for ``WORLD`` ranks.  They do not depend on
  the input size, so the dummy costs exactly one image micro-batch's vision
  communication.

FLOPs are not what a user waits for: on a GPU a tower call is latency-bound
whatever its input, and since issue #40 only a model's first text-only
micro-batch runs this dummy (later ones walk the units, ``fixes.unit_walk``).
The time, at real geometry: ``benchmarks/text_only_cost.py`` (this CPU) and
``benchmarks/gpu_check.py`` (one GPU).

    python benchmarks/mixed_ranks.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

WORLD = 8
FAMILIES = {"qwen3_vl": "Qwen3-VL-8B", "glm4v": "GLM-4.1V-9B"}
IMAGE_GRIDS = {"qwen3_vl": [1, 32, 32], "glm4v": [1, 32, 32]}  # 512x512 (patch 16) / 448x448 (patch 14)


def _meta_model(family):
    import torch
    import transformers

    from fsdp2_compat_harness.tiny.configs import CLASSES
    from support.real_size import real_size_config

    config = real_size_config(family)
    with torch.device("meta"):
        return getattr(transformers, CLASSES[family][0])(config)


def _skip_position_interpolation(model):
    """GLM4V's embeddings interpolate the position table with ``.item()`` sizes: not on meta (see the docstring)."""
    embeddings = getattr(model.model.visual, "embeddings", None)
    if embeddings is not None and type(embeddings).__name__.startswith("Glm4v"):
        embeddings.forward = lambda hidden, *args, **kwargs: hidden


# transformers 5.24+ computes these from the grid (a CPU tensor: its values are needed) in module functions.
_GRID_FUNCTIONS = ("get_vision_interpolation_indices_and_weights", "get_vision_position_ids")


def _grid_tensors_on_meta(model):
    """On the meta device the position indices, weights and ids computed from the grid must be meta tensors too
    (``_GRID_FUNCTIONS``); returns an undo.  Index arithmetic, no matmul: the FLOPs counted are the same."""
    import sys

    import torch

    module = sys.modules[type(model.model.visual).__module__]
    saved = {name: getattr(module, name) for name in _GRID_FUNCTIONS if hasattr(module, name)}

    def on_meta(original):
        def call(*args, **kwargs):
            out = original(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                return out.to("meta")
            return tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in out)

        return call

    for name, original in saved.items():
        setattr(module, name, on_meta(original))
    return lambda: [setattr(module, name, original) for name, original in saved.items()]


def image_flops(model, grid):
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    vision = model.config.vision_config
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    pixels = torch.zeros(grid[0] * grid[1] * grid[2], width, device="meta")
    undo = _grid_tensors_on_meta(model)
    try:
        with FlopCounterMode(display=False) as counter:
            model.model.get_image_features(pixels, torch.tensor([grid]))
    finally:
        undo()
    return counter.get_total_flops()


def collective_bytes(model, world):
    numel = sum(p.numel() for p in model.model.visual.parameters())
    shard_share = (world - 1) / world  # what each rank receives (all-gather) or sends (reduce-scatter)
    return {"vision_params": numel,
            "all_gather_bytes": int(2 * numel * 2 * shard_share),  # bf16, forward + backward re-gather
            "reduce_scatter_bytes": int(numel * 4 * shard_share)}  # fp32 gradients


def measure(family):
    model = _meta_model(family)
    _skip_position_interpolation(model)
    merge = model.config.vision_config.spatial_merge_size
    dummy = image_flops(model, [1, merge, merge])
    image = image_flops(model, IMAGE_GRIDS[family])
    return dict(collective_bytes(model, WORLD), dummy_flops=dummy, image_flops=image, ratio=dummy / image)


def main():
    from fsdp2_compat_harness import tiny

    print("per text-only micro-batch, per rank, %d ranks; forward FLOPs of the vision path" % WORLD)
    print("%-12s %10s %14s %14s %9s %12s %12s" % ("model", "vision", "dummy GFLOP", "image GFLOP", "ratio",
                                                   "AG MiB", "RS MiB"))
    for family, label in FAMILIES.items():
        if tiny.unavailable(family) is not None:
            print("%-12s %s" % (label, tiny.unavailable(family)))
            continue
        r = measure(family)
        print("%-12s %9.0fM %14.2f %14.1f %8.3f%% %12.0f %12.0f" % (
            label, r["vision_params"] / 1e6, r["dummy_flops"] / 1e9, r["image_flops"] / 1e9, 100 * r["ratio"],
            r["all_gather_bytes"] / 2**20, r["reduce_scatter_bytes"] / 2**20))
    print("(the collectives are those of one image micro-batch's vision units: without the dummy the ranks hang)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
