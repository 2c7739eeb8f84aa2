"""``fsdp2_compat_harness.ranks`` and ``rank_server``: a run with a rank that died unreported, the batched
gather, and the rank server one process shares with those it starts."""

import time

import pytest

pytest.importorskip("torch", reason="needs torch (gloo ranks)")

from fsdp2_compat_harness import ranks  # noqa: E402
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


# A sharer and three clients (rank_server), fresh interpreters that never import torch themselves: each
# server preloads torch only (~3 s of CPU), the sharer's and that of the client not given the address.
SHARER = r"""
import json, os, subprocess, sys
from fsdp2_compat_harness import rank_server

rank_server.PRELOAD[:] = ["torch"]
address = rank_server.share()
client = "from fsdp2_compat_harness import rank_server; rank_server.PRELOAD[:] = ['torch']; " \
         "from fsdp2_compat_harness.ranks import run_ranks; from support import server_jobs; " \
         "print('RESULT', run_ranks(server_jobs.server_of, 1, timeout=120)[0], rank_server._joined, flush=True)"
without = {k: v for k, v in os.environ.items() if k != rank_server.ENV}
runs = [subprocess.run([sys.executable, "-c", client], env=env, capture_output=True, text=True, timeout=150)
        for env in (os.environ, os.environ, without)]
print(json.dumps({"address": address, "env": os.environ.get(rank_server.ENV),
                  "runs": [(r.returncode, r.stdout, r.stderr[-2000:]) for r in runs]}))
"""


def test_processes_started_after_share_fork_their_ranks_from_the_one_server(python):
    import json
    import os

    from fsdp2_compat_harness import rank_server

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = python(SHARER, env={rank_server.ENV: "", "PYTHONPATH": os.pathsep.join((os.path.dirname(tests), tests))},
                  timeout=240)
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["address"] and out["env"] == out["address"], out
    results = []
    for returncode, stdout, stderr in out["runs"]:
        assert returncode == 0, stderr
        [line] = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        _, server_pid, joined = line.split(" ")
        results.append((int(server_pid), joined, "rank 0 of 1 speaks" in stdout))
    (first, joined_first, spoke_first), (second, joined_second, spoke_second), (own, joined_own, spoke_own) = results
    assert first == second and joined_first == joined_second == out["address"], results
    assert not spoke_first and not spoke_second, results  # the shared server's ranks print to os.devnull ...
    assert own != first and joined_own == "None", results  # ... a process without the address has its own,
    assert spoke_own, results  # whose ranks print where their client does
