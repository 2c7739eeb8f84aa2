"""``fsdp2_compat.tooling.ranks``: how a run with a rank that died without reporting ends."""

import time

import pytest

pytest.importorskip("torch", reason="needs torch (gloo ranks)")

from fsdp2_compat.tooling import ranks  # noqa: E402
from support import rank_jobs  # noqa: E402

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("torch",)


def test_a_rank_that_dies_unreported_ends_the_run_without_waiting_for_the_others():
    """gloo aborts the rank that sees a collective mismatch; its peers would wait out the group's timeout."""
    waited = 90  # what the surviving rank would take (an hour with NCCL's default)
    start = time.monotonic()
    with pytest.raises(ranks.RankError) as info:
        ranks.run_ranks(rank_jobs.one_rank_dies, 2, waited, retries=0, timeout=300)
    took = time.monotonic() - start
    assert info.value.errors[1][0] == "no report; process exit code 3", info.value.errors
    assert info.value.errors[0][0].startswith("no report; process exit code"), info.value.errors  # killed
    assert took < waited / 2, "run_ranks waited %.0f s for a rank stuck beside a dead one" % took


@pytest.mark.parametrize("world", [2, 3])
def test_full_values_gathers_what_full_tensor_gathers_in_one_collective(world):
    """The comparisons' batched gather (``scenarios.full_values``) returns, on every rank, exactly what
    ``full_tensor()`` returns per tensor: uneven rows (3 ranks: one has no row of a 1-row tensor), bf16 beside
    fp32, a Replicate DTensor, a plain tensor and None."""
    results = ranks.run_ranks(rank_jobs.gathered_both_ways, world, timeout=120)
    assert results == [(7, [])] * world, results
