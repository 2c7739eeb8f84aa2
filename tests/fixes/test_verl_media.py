"""``fixes.verl_media.one_visual_call`` in one process: verl's two tower calls served by one run of the tower.

verl's ``_get_input_embeds`` calls ``model.visual(pixels, grid_thw=grid)`` once per kind.  Here the same
two calls run as released and inside ``one_visual_call`` on the same weights: every output tensor and every
tower gradient must agree, the tower's blocks must run once instead of twice, a call the merge was not built
for must run as released (with a warning), and the tower must hold no override afterwards.  The two-rank
proof through verl's engine is ``tests/integrations/test_verl_engine.py``; no verl is needed here.
"""

import pytest

pytest.importorskip("torch", reason="needs torch")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")

from fsdp2_compat.fixes import media_merge, verl_media  # noqa: E402
from fsdp2_compat_harness import tiny  # noqa: E402

DEPENDS_ON = ("torch", "transformers")

FAMILIES = ("qwen2_5_vl", "qwen3_vl")


def _floats(value):
    import torch

    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict):
        return [t for v in value.values() for t in _floats(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _floats(v)]
    return []


def _setup(family):
    if tiny.unavailable(family) is not None:
        pytest.skip(str(tiny.unavailable(family)))
    model = tiny.quiet(tiny.build, family)
    batch = tiny.make_batch(family, model, seed=5, media=("image", "video"))
    visual = model.model.visual
    kinds = (batch["pixel_values"], batch["image_grid_thw"], batch["pixel_values_videos"], batch["video_grid_thw"])
    block_calls = []
    handle = visual.blocks[0].register_forward_pre_hook(lambda module, args: block_calls.append(1))
    return model, visual, kinds, block_calls, handle


def _two_calls(visual, pixels, image_grid, videos, video_grid):
    """What verl's ``_get_input_embeds`` does: images first, then videos, each cast to the tower's dtype."""
    return visual(pixels, grid_thw=image_grid), visual(videos, grid_thw=video_grid)


def _loss_and_grads(model, visual, outputs):
    loss = sum((t.float() ** 2).sum() for t in _floats(outputs))
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in visual.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_one_run_of_the_tower_serves_verls_image_and_video_calls(family):
    model, visual, kinds, block_calls, handle = _setup(family)
    released = _two_calls(visual, *kinds)
    assert len(block_calls) == 2, "as released the tower runs once per kind"
    released_grads = _loss_and_grads(model, visual, released)
    del block_calls[:]
    before = media_merge.STATS["merged_forwards"]
    with verl_media.one_visual_call(model.model, visual, *kinds):
        merged = _two_calls(visual, *kinds)
    handle.remove()
    assert len(block_calls) == 1 and media_merge.STATS["merged_forwards"] == before + 1
    assert "forward" not in visual.__dict__
    want, got = _floats(released), _floats(merged)
    assert len(got) == len(want) and len(want) >= 2
    for a, b in zip(got, want):
        assert a.shape == b.shape and (a - b).abs().max().item() < 1e-5
    merged_grads = _loss_and_grads(model, visual, merged)
    assert set(merged_grads) == set(released_grads)
    for name, g in released_grads.items():
        assert (merged_grads[name] - g).abs().max().item() < 1e-4 * (1 + g.abs().max().item()), name


def test_a_call_the_merge_was_not_built_for_runs_the_tower_as_released():
    model, visual, kinds, block_calls, handle = _setup("qwen2_5_vl")
    pixels, image_grid, videos, video_grid = kinds
    verl_media._WARNED.discard(type(model.model).__name__)
    with pytest.warns(UserWarning, match="tower runs twice"):
        with verl_media.one_visual_call(model.model, visual, *kinds):
            visual(pixels, grid_thw=image_grid.clone())  # a grid that is not the call's own
            visual(pixels, grid_thw=image_grid)  # released for the rest of the call
    handle.remove()
    assert len(block_calls) == 2 and "forward" not in visual.__dict__
