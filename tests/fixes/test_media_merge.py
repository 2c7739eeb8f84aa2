"""``fixes.media_merge`` on the installed transformers, in one process: the merged tower call is the two calls.

The two-rank proof (collectives, DP-average gradients) is ``tests/integrations/test_mixed_media_kinds.py``;
here each family's forward with an image and a video runs once as released and once with one merged tower
call, on the same weights and batch: the loss and every gradient must agree, the tower must run once instead
of twice, and the model must hold no override afterwards.  The release's own source decides where the merge
applies (``video_path_is_image_path``): the Qwen families yes, GLM-4.1V (frames flattened) no.
"""

import pytest

pytest.importorskip("torch", reason="needs torch")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")

from fsdp2_compat.fixes import media_merge  # noqa: E402
from fsdp2_compat_harness import tiny  # noqa: E402

DEPENDS_ON = ("torch", "transformers")


def _build(family):
    """A tiny model of ``family`` (Qwen2-VL: the tests' own builder, the harness has none)."""
    if family == "qwen2_vl":
        from support import accum_jobs

        return accum_jobs.tiny_qwen2_vl(), "qwen2_5_vl"  # Qwen2.5-VL's batches fit its geometry
    if tiny.unavailable(family) is not None:
        pytest.skip(str(tiny.unavailable(family)))
    return tiny.quiet(tiny.build, family), family


def _tower_calls(model):
    calls = []
    handle = model.model.visual.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls, handle


@pytest.mark.parametrize("family", tiny.VIDEO_FAMILIES + ("qwen2_vl",))
def test_one_merged_tower_call_gives_the_loss_and_gradients_of_two(family):
    model, batches = _build(family)
    batch = tiny.make_batch(batches, model, seed=3, media=("image", "video"))
    calls, handle = _tower_calls(model)
    released = model(**batch).loss
    released.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert len(calls) == 2, "the released forward should run the tower once per kind"
    model.zero_grad(set_to_none=True)
    del calls[:]
    base = model.model
    assert media_merge.video_path_is_image_path(type(base)) is None
    before = media_merge.STATS["merged_forwards"]
    with media_merge.one_tower_call(base, batch.get):
        merged = model(**batch).loss
    merged.backward()
    handle.remove()
    assert len(calls) == 1 and media_merge.STATS["merged_forwards"] == before + 1
    assert "get_image_features" not in base.__dict__ and "get_video_features" not in base.__dict__
    assert abs(merged.item() - released.item()) < 1e-6
    after = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(after) == set(grads)
    worst = max(float((after[n] - grads[n]).abs().max()) for n in grads)
    assert worst < 1e-6, worst
    assert any(".visual." in n for n in grads)  # the tower got gradients through the merged call


def test_glm4v_flattens_video_frames_so_its_video_path_is_not_merged():
    from transformers.models.glm4v import modeling_glm4v

    why = media_merge.video_path_is_image_path(modeling_glm4v.Glm4vModel)
    assert why == "Glm4vModel.get_video_features is not get_image_features with the video names"


def test_an_output_the_merge_cannot_split_is_a_clear_error():
    import torch

    sizes = media_merge._Sizes(torch.tensor([[1, 4, 4]]), torch.tensor([[2, 4, 4]]), 2)
    image, video = media_merge.split((torch.zeros(4, 3), torch.zeros(8, 3)), sizes)  # per-item tensors
    assert [t.shape[0] for t in image] == [4] and [t.shape[0] for t in video] == [8]
    image, video = media_merge.split(torch.zeros(48, 3), sizes)  # patches: 16 of the image, 32 of the video
    assert (image.shape[0], video.shape[0]) == (16, 32)
    with pytest.raises(media_merge.MergeError, match=r"output\.x: a tensor of 5 rows is neither the 12 merged"):
        media_merge.split({"x": torch.zeros(5, 3)}, sizes)


def test_a_call_with_pixels_that_are_not_the_forwards_own_runs_as_released_for_the_rest_of_the_forward():
    """A forward that transforms its pixels before the feature call gets transformers' two calls, with a
    warning, never a merged call on top of a released one."""
    model, _ = _build("qwen2_5_vl")
    batch = tiny.make_batch("qwen2_5_vl", model, seed=4, media=("image", "video"))
    base = model.model
    media_merge._WARNED.discard(type(base).__name__)  # once per class and process: whatever ran before here
    calls, handle = _tower_calls(model)
    before = media_merge.STATS["merged_forwards"]
    with pytest.warns(UserWarning, match="tower runs twice"):
        with media_merge.one_tower_call(base, batch.get):
            base.get_image_features(batch["pixel_values"].clone(), batch["image_grid_thw"])
            base.get_video_features(batch["pixel_values_videos"], batch["video_grid_thw"])
    handle.remove()
    assert len(calls) == 2 and media_merge.STATS["merged_forwards"] == before
