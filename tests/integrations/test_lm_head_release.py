"""The gathered lm_head unit is released as soon as its gradient is complete: proven on real FSDP2.

``fsdp2_compat.fixes.gather`` runs the unit's own ``post_backward`` from a
post-accumulate-grad hook on FSDP's unsharded parameter, instead of leaving
it to FSDP's root callback after the whole backward.  Two gloo ranks, verl's
fused forwards through its own ``apply_fsdp2`` (``benchmarks/lm_head_release.py``
measures the same runs).  Unchanged gradients are proven here (bit-identical to
the run without the early release) and by the existing gradient tests of the
fused forwards (``test_fused_forwards.py``: HSDP, bf16; ``test_diffs.py``:
gradient accumulation, a ``no_grad`` rollout resharded).
"""

import os
import sys

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")

from fsdp2_compat.core import guards  # noqa: E402
from fsdp2_compat_harness.ranks import run_ranks  # noqa: E402
from support import accum_jobs  # noqa: E402
from support.release_jobs import first  # noqa: E402

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("torch", "transformers", "verl")

VERL = guards.installed_version("verl")
pytestmark = pytest.mark.skipif(
    VERL is None or not guards.in_range(VERL, ">=0.7.1"),
    reason="needs verl >= 0.7.1 (an untied lm_head in its own FSDP2 unit, read by the fused forwards)",
)
TOL = 1e-5

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))


def _is_layer(unit):
    return ".layers." in unit or ".blocks." in unit


_MEASURED = {}


def _measured():
    """benchmarks/lm_head_release.py's runs (before / after the early release), once per worker."""
    if not _MEASURED:
        import lm_head_release

        _MEASURED.update(lm_head_release.measure())
    return _MEASURED


@pytest.mark.xdist_group("lm-head-release")
def test_lm_head_unit_is_released_before_the_first_decoder_layer_backward():
    after = _measured()["after"]
    assert after["early_releases"] == 2  # one per backward: the deferred and the synchronising micro-batch
    for mb in after["micro_batches"]:
        where = "sync" if mb["sync"] else "deferred"
        assert mb["layers_while_unsharded"] == [] and mb["blocks_while_unsharded"] == [], (where, mb)
        events = mb["events"]
        released = first(events, "post_backward", lambda u: u == "lm_head")
        assert released is not None and released < first(events, "pre_backward", _is_layer), (where, events)
        assert mb["lm_head_sharded_after"], where
    sync = after["micro_batches"][1]
    assert sync["held"] == {"weight": 0, "grad": 0, "accumulated_grad": 0}, sync["held"]
    rs_lm_head = first(sync["events"], "reduce_scatter_single", lambda u: u == "lm_head")
    rs_layer = first(sync["events"], "reduce_scatter_single", _is_layer)
    assert rs_lm_head is not None and rs_layer is not None and rs_lm_head < rs_layer, sync["events"]
    deferred = after["micro_batches"][0]
    # deferred sync: the unit is resharded at once; only the fp32 accumulated gradient stays (FSDP's own)
    assert deferred["held"]["weight"] == deferred["held"]["grad"] == 0, deferred["held"]
    assert deferred["held"]["accumulated_grad"] == 4 * after["lm_head_numel"], deferred["held"]


@pytest.mark.xdist_group("lm-head-release")
def test_without_the_early_release_every_decoder_layer_runs_backward_with_lm_head_unsharded():
    before = _measured()["before"]
    assert before["early_releases"] == 0
    for mb in before["micro_batches"]:
        assert sorted(mb["layers_while_unsharded"]) == before["layers"], mb
        assert sorted(mb["blocks_while_unsharded"]) == before["blocks"], mb
        assert mb["held"]["weight"] == mb["held"]["grad"] == 2 * before["lm_head_numel"], mb["held"]
    sync = before["micro_batches"][1]
    assert first(sync["events"], "reduce_scatter_single", lambda u: u == "lm_head") > first(
        sync["events"], "reduce_scatter_single", _is_layer), sync["events"]


@pytest.mark.xdist_group("lm-head-release")
def test_the_early_release_changes_no_gradient_and_a_no_grad_read_arms_nothing():
    import numpy as np

    runs = _measured()
    before, after = runs["before"]["grads"], runs["after"]["grads"]
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in after)
    for side in ("before", "after"):
        assert runs[side]["resharded_after_no_grad"] and runs[side]["pending_after_no_grad"] == 0, side


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_a_chunked_head_is_released_once_per_backward_and_trains_the_dp_average(policy):
    # Qwen3-VL with a chunked cross-entropy that reads lm_head.weight once per 7 rows (5 reads a
    # forward) inside gathered(); mixed text-only / image micro-batches, sync deferred on all but the
    # last (the torch accumulation seams make the text-only ones work).
    cases = [(policy, ["t-accum"], policy, "deferred", "mixed")]
    results = run_ranks(accum_jobs.accumulation_cases, 2, "verl", "qwen3_vl", cases, kwargs={"chunked": True})
    for rank, r in enumerate(results):
        r = r[policy]
        assert r["error"] is None, r["error"]
        assert "lm_head" in r["wrapped"]
        assert r["early_releases"] == 5, r["early_releases"]  # 2 + 3 micro-batches
        assert r["lm_head_sharded_after_backward"] == [True] * 5, r["lm_head_sharded_after_backward"]
        if policy == "fp32":
            assert r["lm_head_grad_err"] < TOL and r["grad_err"] < TOL, (rank, r["worst_grad"], r["grad_err"])
        else:
            assert r["lm_head_grad_err"] < 1e-2 and r["grad_err"] < 1e-2, (rank, r["worst_grad"], r["grad_err"])
            assert r["grad_rel_to_max"] < 6e-2, (rank, r["worst_rel_to_max"], r["grad_rel_to_max"])
    if policy == "fp32":  # (bf16 losses may round to the same value on both ranks)
        assert results[0][policy]["losses"] != results[1][policy]["losses"], "same data on both ranks"
