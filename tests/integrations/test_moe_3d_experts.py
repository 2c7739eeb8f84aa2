"""transformers 5.x keeps MoE experts as 3-D parameters: ranks that reach different experts are exact unpatched.

The "not affected" declarations of ``fsdp2_compat.integrations.transformers_moe``
(``>=5.0.0rc0``), measured per transformers release on real FSDP2 with torch's
own recipe (each ``_no_split_modules`` layer a unit, then the root; no
framework: the claim is about the model's code), 2 gloo ranks whose tokens
reach different experts (asserted), no patch, against the DP reference.  The
4.x bug and fix through each framework: ``test_moe_experts.py``.
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")

from fsdp2_compat.core import guards  # noqa: E402
from support import moe_jobs  # noqa: E402

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("torch", "transformers")

TRANSFORMERS = guards.installed_version("transformers")
TOL = 1e-5

pytestmark = pytest.mark.skipif(guards.in_range(TRANSFORMERS, "<5.0.0rc0"),
                                reason="transformers %s keeps experts in a loop that skips unreached ones "
                                       "(test_moe_experts.py)" % TRANSFORMERS)


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4v_moe"])
def test_ranks_that_reach_different_experts_are_exact_unpatched(family):
    from fsdp2_compat_harness import tiny

    why = tiny.unavailable(family)
    if why is not None:
        pytest.skip(why)
    results, stderr, differ = moe_jobs.run("fully_shard", family, None)
    assert differ, "the ranks' tokens reached the same experts: the scenario proves nothing"
    assert results is not None, stderr
    for rank, r in enumerate(results):
        assert r["error"] is None and r["grads_checked"] > 0, (rank, r)
        assert r["grad_err"] < TOL and r["param_err"] < TOL and r["loss_err"] < TOL, (rank, r["worst_grad"], r)
