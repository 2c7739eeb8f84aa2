"""Images and videos mixed across ranks (issue #20): one rank's micro-batch with an image *and* a video, another's
with one kind or text only.  Real FSDP2, 2 CPU gloo ranks.

Unpatched, the rank with both kinds runs the vision tower twice (``get_image_features``, then
``get_video_features``) while the other runs it once: the vision units' all-gathers differ across ranks and
gloo reports the collective mismatch (NCCL would hang).  Patched, ``fixes.media_merge`` runs one tower call
for both kinds (and ``fixes.mixed_media`` one dummy call on a text-only micro-batch), so every rank runs it
once per micro-batch; each step's gradients, losses and parameters then match the unsharded reference trained
on the data-parallel average (fp32 1e-5), with the sync on every micro-batch and deferred to the last.

The families: Qwen2.5-VL (its ``get_video_features`` is ``get_image_features`` under other names) and
Qwen3-VL (its ``get_video_features`` calls ``get_image_features``; its deepstack features are split too): the
two shapes of every family the merge applies to.  Each of those (Qwen2-VL, Qwen3-VL-MoE too) is checked in one
process against its released two calls by ``tests/fixes/test_media_merge.py``; GLM-4.1V's forward cannot take
both kinds in one micro-batch (``media_towers.GLM_GRID``).  The outcome depends on torch and transformers (the forwards and the
feature outputs the merge splits, which change across releases), so the sharding is the generic
per-layer-class wrapping of ``test_mixed_families.py`` (``mixed_jobs.generic_framework``).  One pair of rank
processes runs every case patched, then one unpatched case last (gloo's abort ends the process).
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")

from support import accum_jobs, mixed_jobs  # noqa: E402

DEPENDS_ON = ("torch", "transformers")

pytestmark = pytest.mark.xdist_group("mixed-media-kinds")

PG_TIMEOUT = 20
MISMATCH = "Received data size doesn't match expected size. Is there a distributed collective mismatch"
FAMILIES = ("qwen2_5_vl", "qwen3_vl")
# One micro-batch per rank and step: (rank 0's kinds, rank 1's kinds).
EVERY = ((("image+video",), ("image",)), (("video",), ("image+video",)), (("text",), ("image+video",)))
# Two micro-batches per rank and step, the gradient sync deferred to the last.
DEFERRED = ((("image+video", "text"), ("image", "video")), (("video", "image"), ("text", "image+video")))
CASES = [("fp32 every", "user", "fp32", "every", EVERY), ("fp32 deferred", "user", "fp32", "deferred", DEFERRED)]
UNPATCHED = ("qwen2_5_vl", ("unpatched", "user-without-mixed", "fp32", "every", EVERY[:1]))
FRAMEWORK, NO_FRAMEWORK = mixed_jobs.generic_framework()
_RESULTS = {}


def _expected(steps, kind):
    """Per rank: how many micro-batches of ``kind`` it trains on over ``steps``."""
    return [sum(kinds.count(kind) for step in steps for kinds in [accum_jobs.rank_kinds(step, r)]) for r in range(2)]


def _run():
    if "run" not in _RESULTS:
        _RESULTS["run"] = mixed_jobs.run_patched_then_unpatched(FRAMEWORK, list(FAMILIES), CASES, UNPATCHED, PG_TIMEOUT,
                                                                "mixed_kinds_")
    return _RESULTS["run"]


@pytest.mark.skipif(NO_FRAMEWORK is not None, reason=str(NO_FRAMEWORK))
@pytest.mark.parametrize("case", [c[0] for c in CASES])
@pytest.mark.parametrize("family", FAMILIES)
def test_image_and_video_on_one_rank_trains_to_the_dp_average(family, case):
    patched, _ = _run()
    steps = dict((c[0], c[4]) for c in CASES)[case]
    results = [rank[case] for rank in patched[family]]
    for rank, r in enumerate(results):
        accum_jobs.assert_close(r, "fp32", "%s %s %s rank %d" % (FRAMEWORK, family, case, rank))
    # one merged tower call per image+video micro-batch, one dummy per text-only one: never more, never fewer
    assert [r["merged_forwards"] for r in results] == _expected(steps, "image+video"), results
    assert [r["dummy_forwards"] for r in results] == _expected(steps, "text"), results
    assert results[0]["losses"] != results[1]["losses"], "same data on both ranks"


@pytest.mark.skipif(NO_FRAMEWORK is not None, reason=str(NO_FRAMEWORK))
def test_unpatched_the_rank_with_both_kinds_breaks_the_vision_units_collectives():
    _, ranks = _run()
    assert any(MISMATCH in outcome or MISMATCH in stderr for outcome, stderr in ranks), ranks
    assert not any(outcome is None for outcome, _ in ranks), ranks  # no rank trained through it
