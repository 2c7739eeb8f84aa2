"""lmms-engine's own padding-free VLM forwards (``use_rmpad``) with a text-only rank (issue #34, item 3).

lmms-engine 0.1.4's Liger monkey patch with ``use_rmpad=True`` assigns its own
base-model forward over transformers' (``qwen3_vl_ops.model_forward``,
``qwen2_5_vl_ops.vl_model_forward``); that forward runs the vision tower only
when the micro-batch has ``pixel_values``.  Here, through lmms-engine's monkey
patch and its ``apply_fsdp2`` as released, on 2 CPU gloo ranks, rank 0 an image
and rank 1 text only, then the reverse (different data per rank):

- the class runs lmms-engine's function (asserted: the proof is about its code);
- unpatched (the family's patch without its mixed-ranks targets), gloo reports
  the collective mismatch under a 20 s process-group timeout;
- patched, every gradient equals the unsharded reference trained on the
  data-parallel average, the text-only rank ran one dummy tower call per
  text-only micro-batch and the image rank none.

The CUDA-only kernels it calls have stand-ins named in ``fsdp2_compat_harness.engines.lmms_forwards``.
GLM-4.1V has no lmms-engine forward: it runs transformers' through lmms-engine's
``apply_fsdp2``, proven with a text-only rank in ``test_mixed_ranks.py``.
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")

from fsdp2_compat import registry  # noqa: E402
from fsdp2_compat.core import guards  # noqa: E402
from support import accum_jobs  # noqa: E402

DEPENDS_ON = ("torch", "transformers", "lmms-engine", "liger-kernel")

LMMS = guards.installed_version("lmms-engine")
pytestmark = [
    pytest.mark.skipif(LMMS is None, reason="lmms-engine not in this pinned set"),
    pytest.mark.skipif(guards.installed_version("liger-kernel") is None or guards.installed_version("einops") is None,
                       reason="lmms-engine's Liger forwards need liger-kernel and einops (not in this pinned set)"),
]

PG_TIMEOUT = 20
MISMATCH = "Received data size doesn't match expected size"
FAMILIES = ("qwen3_vl", "qwen3_vl_moe", "qwen2_5_vl")
STEPS = (("image", "text"), ("text", "image"))  # per step: rank 0's kind, rank 1's
# an image+video micro-batch (the forward runs the tower once per kind) against an image or a text-only one
MEDIA_STEPS = (("image+video", "text"), ("image", "image+video"))
MEDIA_NAME = "image+video"
VIDEO_FAMILIES = ("qwen3_vl",)  # Qwen2.5-VL's lmms-engine forward calls ``self.visual`` per kind: not merged (below)
OPS = {"qwen3_vl": "lmms_engine.models.qwen3_vl.qwen3_vl_ops",
       "qwen3_vl_moe": "lmms_engine.models.qwen3_vl_moe.qwen3_vl_moe_ops",
       "qwen2_5_vl": "lmms_engine.models.qwen2_5_vl.qwen2_5_vl_ops"}
_RESULTS = {}


def _user(family):
    return registry.for_model_type(family).name


def _run():
    """Both families patched, then Qwen3-VL unpatched, in one pair of rank processes."""
    if "run" in _RESULTS:
        return _RESULTS["run"]
    from support import lmms_jobs, mixed_jobs

    cases = [(f, f, [_user(f)], STEPS) for f in FAMILIES] + [
        ("%s %s" % (f, MEDIA_NAME), f, [_user(f)], MEDIA_STEPS) for f in VIDEO_FAMILIES] + [
        ("qwen3_vl late", "qwen3_vl", [_user("qwen3_vl")], STEPS, True)]
    unpatched = ("unpatched", "qwen3_vl", ["t-%s-without-mixed" % _user("qwen3_vl")], STEPS)
    _RESULTS["run"] = mixed_jobs.collect_patched_then_unpatched(
        lmms_jobs.patched_then_unpatched, (cases, unpatched), lambda r: r["error"], PG_TIMEOUT, "lmms_forwards_")
    return _RESULTS["run"]


def test_unpatched_lmms_engine_forward_skips_the_tower_on_the_text_only_rank():
    _, ranks = _run()
    assert any(MISMATCH in str(outcome) or MISMATCH in err for outcome, err in ranks), ranks
    assert not any(outcome is None for outcome, _ in ranks), ranks  # no rank trained through it


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_lmms_engine_forward_trains_to_the_dp_average(family):
    patched, _ = _run()
    results = [p[family] for p in patched]
    for rank, r in enumerate(results):
        assert r["forward"] == OPS[family], r["forward"]  # lmms-engine's own forward ran, not transformers'
        accum_jobs.assert_close(r, "fp32", "lmms-engine %s rank %d" % (family, rank))
        # one dummy per text-only micro-batch on this rank (one per step: STEPS), none on an image step
        assert r["dummy_forwards"] == sum(kinds[rank] == "text" for kinds in STEPS), r
    assert results[0]["losses"] != results[1]["losses"], "same data on both ranks"


@pytest.mark.parametrize("family", VIDEO_FAMILIES)
def test_patched_lmms_engine_forward_runs_the_tower_once_for_an_image_and_a_video(family):
    patched, _ = _run()
    results = [p["%s %s" % (family, MEDIA_NAME)] for p in patched]
    for rank, r in enumerate(results):
        accum_jobs.assert_close(r, "fp32", "lmms-engine %s %s rank %d" % (family, MEDIA_NAME, rank))
        # one tower call for both kinds (media_merge), as the other rank's one image or one dummy
        assert r["merged_forwards"] == sum(kinds[rank] == "image+video" for kinds in MEDIA_STEPS), r
        assert r["dummy_forwards"] == sum(kinds[rank] == "text" for kinds in MEDIA_STEPS), r


def test_lmms_engine_qwen2_5_vl_forward_says_its_image_and_video_tower_calls_are_not_merged():
    """lmms-engine's Qwen2.5-VL ``vl_model_forward`` runs ``self.visual`` once per media kind, bypassing
    ``get_image_features`` / ``get_video_features`` where ``media_merge`` makes one tower call of the two: an
    image+video micro-batch there still runs the tower twice (a rank with one kind runs it once).  Not fixed;
    the wrapper says so (one process: the merge is asked for directly, as the wrapper asks on 2+ ranks)."""
    import warnings

    from fsdp2_compat.fixes import media_merge
    from fsdp2_compat_harness import frameworks, tiny
    from fsdp2_compat_harness.engines import lmms_forwards

    frameworks.import_fsdp_utils("lmms-engine")
    restore = lmms_forwards.install_own_forwards("qwen2_5_vl")
    try:
        model = tiny.build("qwen2_5_vl", tie=False, seed=0)
        assert lmms_forwards.own_forward_of(model) == OPS["qwen2_5_vl"]
        batch = tiny.make_batch("qwen2_5_vl", model, seed=1, media=("image", "video"))
        media_merge._WARNED.discard(type(model.model).__name__)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with media_merge.one_tower_call(model.model, batch.get):
                model(**batch)
    finally:
        restore()
    said = [str(w.message) for w in caught if "never called get_image_features" in str(w.message)]
    assert len(said) == 1 and "vl_model_forward" in said[0], [str(w.message) for w in caught]


def test_a_patch_requested_after_lmms_engine_assigned_its_forward_still_reaches_the_class():
    """The request comes after lmms-engine's monkey patch put its unwrapped function on ``Qwen3VLModel``
    (``Target.assigned_to``): the class gets the wrapped one, ``status`` says so, and training is exact."""
    patched, _ = _run()
    results = [p["qwen3_vl late"] for p in patched]
    for rank, r in enumerate(results):
        assert r["forward"] == OPS["qwen3_vl"], r["forward"]
        accum_jobs.assert_close(r, "fp32", "lmms-engine qwen3_vl, late request, rank %d" % rank)
        assert r["dummy_forwards"] == sum(kinds[rank] == "text" for kinds in STEPS), r
        assert any("rebound objects that held the original: Qwen3VLModel.forward" in d for d in r["outcomes"]), r
