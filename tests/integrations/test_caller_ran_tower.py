"""A caller that runs the vision tower itself and passes ``inputs_embeds``: one tower call per micro-batch.

ms-swift 4.6.0's Qwen2-VL / Qwen2.5-VL templates (``_post_encode`` -> ``Template._get_inputs_embeds_hf``) run
the tower on every rank (a dummy image for a text-only micro-batch) and call the model with ``inputs_embeds``
only; the mixed-ranks fix (``fsdp2_compat.fixes.mixed_media``) used to add its own dummy on every rank there:
two tower calls per micro-batch everywhere (a second all-gather and reduce-scatter of every vision unit).

Two CPU gloo ranks, per-layer-class ``fully_shard`` (accelerate's TRANSFORMER_BASED_WRAP units), each step one
rank with an image and the other text-only, different data per rank, every micro-batch through a restatement
of ms-swift's ``_get_inputs_embeds_hf`` (``support/caller_tower_jobs.py``; ms-swift itself is not imported):

- unpatched: exact against the unsharded DP reference (the caller's own dummy keeps the ranks aligned), one
  tower call per micro-batch;
- patched: exact too, and one tower call per micro-batch on every rank from the second micro-batch on (the first
  one, before the fix's tower counter exists, runs its dummy on every rank alike: two calls, uniform).
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")

from fsdp2_compat_harness import tiny  # noqa: E402
from fsdp2_compat_harness.ranks import run_ranks  # noqa: E402
from support.caller_tower_jobs import caller_ran_tower  # noqa: E402

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("torch", "transformers")

TOL = 1e-5
FAMILIES = [pytest.param(f, marks=pytest.mark.wrappable(f)) for f in ("qwen2_5_vl",)]  # the tiny Qwen2-VL-style family


def _exact(results):
    for rank, r in enumerate(results):
        assert r["error"] is None, "rank %d: %s" % (rank, r["error"])
        assert r["grads_checked"] > 0 and r["loss_err"] < TOL and r["param_err"] < TOL, r
        assert r["grad_err"] < TOL, (rank, r["worst_grad"], r["grad_err"])
    assert results[0]["losses"] != results[1]["losses"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_caller_that_ran_the_tower_gets_no_second_tower_call(family, tmp_path):
    (tmp_path / "u").mkdir()
    (tmp_path / "p").mkdir()
    unpatched = run_ranks(caller_ran_tower, 2, str(tmp_path / "u"), family, None, pg_timeout=60)
    _exact(unpatched)
    assert all(r["tower_calls"] == [1, 1, 1] for r in unpatched), [r["tower_calls"] for r in unpatched]
    patched = run_ranks(caller_ran_tower, 2, str(tmp_path / "p"), family, "qwen2vl", pg_timeout=60)
    _exact(patched)
    for r in patched:
        assert r["tower_calls"] == [2, 1, 1], r["tower_calls"]
        assert r["stats"]["dummy_forwards"] == 1 and r["stats"]["caller_ran_tower"] == 2, r["stats"]
