"""MoE experts that one rank's tokens never reach: proven on real FSDP2 through the frameworks' own wrapping.

Two gloo ranks, tiny MoE models (``tiny.moe``: 16 experts, one per token) and
different tokens per rank, chosen so that the ranks reach different experts
(asserted in every test from the experts each rank recorded), against an
unsharded reference trained on the data-parallel average
(``tooling.moe_scenarios``):

- transformers 4.x (experts in a loop that skips the unreached ones):
  unpatched, the ranks' reduce-scatters differ in size inside the decoder
  layer's unit and gloo aborts; patched (``moe``, GLM-4.5V under ``glm4v``),
  every gradient is the DP average (fp32 exact; sync every step and deferred;
  bf16 parameters with an fp32 reduce within bf16 tolerance), through verl's,
  SkyRL's and skyrl-train's ``apply_fsdp2``, LLaMA-Factory's ``FSDP2Engine`` and accelerate's
  ``Accelerator.prepare`` (the HF Trainer's and TRL's preparation), and on the
  path ``fixes.experts`` takes on a torch without ``reduce_scatter_unused_params``;
- transformers 5.x (3-D experts) and Qwen3-VL-MoE on 4.57 (3-D already): the
  same scenario is exact unpatched, the "not affected" declarations (per
  transformers release, framework-free: ``test_moe_3d_experts.py``; AReaL's
  and LLaMA-Factory's wrapping were measured on 5.3.0 too).
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")

from fsdp2_compat.core import guards  # noqa: E402
from support import moe_jobs  # noqa: E402

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("torch", "transformers", "{framework}")

TRANSFORMERS = guards.installed_version("transformers")
LOOPED = guards.in_range(TRANSFORMERS, "<5.0.0rc0")  # experts in an nn.ModuleList loop that skips
MISMATCH = "Received data size doesn't match expected size"
TOL = 1e-5
BF16_GRAD, BF16_REL_TO_MAX = 1e-2, 6e-2  # bf16 compute against a bf16 reference (routing alike), fp32 reduce

FRAMEWORKS = ("verl", "skyrl", "skyrl-train", "llamafactory", "accelerate")
TEXT_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3", "glm4_moe")

needs_loop = pytest.mark.skipif(not LOOPED, reason="transformers %s keeps experts as 3-D parameters (every rank has "
                                "every gradient): nothing to fix (test_moe_3d_experts.py)" % TRANSFORMERS)


def _installed(framework):
    if guards.installed_version(framework) is None:
        pytest.skip("%s is not installed in this set" % framework)


def _family(family):
    from fsdp2_compat_harness import tiny

    why = tiny.unavailable(family)
    if why is not None:
        pytest.skip(why)


def _patch_of(family):
    return "glm4v" if family == "glm4v_moe" else "moe"


def _assert_dp_exact(results, tol=TOL):
    for rank, r in enumerate(results):
        assert r["error"] is None, (rank, r["error"])
        assert r["grads_checked"] > 0, r
        assert r["grad_err"] < tol and r["param_err"] < tol and r["loss_err"] < tol, (rank, r["worst_grad"], r)


@needs_loop
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_unpatched_ranks_that_reach_different_experts_break_the_reduce_scatter(framework):
    _installed(framework)
    results, stderr, differ = moe_jobs.run(framework, "qwen3_moe", None)
    assert differ, "the ranks' tokens reached the same experts: the scenario proves nothing"
    assert results is None or any(r["error"] for r in results), results
    assert any(MISMATCH in text for text in stderr), stderr


@needs_loop
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_patched_every_rank_reduces_every_expert_and_matches_the_dp_average(framework):
    _installed(framework)
    results, stderr, differ = moe_jobs.run(framework, "qwen3_moe", ["moe"])
    assert differ and results is not None, (differ, stderr)
    _assert_dp_exact(results)


@needs_loop
@pytest.mark.parametrize("framework", ["verl"])
@pytest.mark.parametrize("family", TEXT_FAMILIES[1:] + ("glm4v_moe",))
def test_every_family_with_skipping_experts_is_exact_patched(framework, family):
    _installed(framework)
    _family(family)
    results, stderr, differ = moe_jobs.run(framework, family, [_patch_of(family)])
    assert differ and results is not None, (differ, stderr)
    _assert_dp_exact(results)


@needs_loop
@pytest.mark.parametrize("framework", ["verl", "skyrl"])
def test_deferred_sync_reduces_every_expert_once_and_exactly(framework):
    _installed(framework)
    results, stderr, differ = moe_jobs.run(framework, "qwen3_moe", ["moe"], accumulate=2)
    assert differ and results is not None, (differ, stderr)
    _assert_dp_exact(results)


@needs_loop
@pytest.mark.parametrize("framework", ["verl", "skyrl"])
def test_bf16_deferred_sync_is_within_bf16_tolerance(framework):
    _installed(framework)
    results, stderr, differ = moe_jobs.run(framework, "qwen3_moe", ["moe"], precision="bf16", accumulate=2, steps=1)
    assert differ and results is not None, (differ, stderr)
    for rank, r in enumerate(results):
        assert r["error"] is None and r["grads_checked"] > 0, (rank, r)
        assert r["grad_err"] < BF16_GRAD and r["grad_rel_to_max"] < BF16_REL_TO_MAX, (rank, r["worst_rel_to_max"], r)


@needs_loop
@pytest.mark.parametrize("framework", ["verl"])
def test_the_older_torch_path_gives_the_same_exact_gradients(framework):
    """On a torch without ``reduce_scatter_unused_params`` the fix gives the zeros itself before
    ``post_backward``: the same run, forced down that path here, is DP-exact with no flag set."""
    from fsdp2_compat_harness.ranks import run_ranks

    _installed(framework)
    results = run_ranks(moe_jobs.train_on_older_torch_path, 2, framework, "qwen3_moe", ["moe"],
                        timeout=140, retries=0, pg_timeout=20)
    _assert_dp_exact(results)
    for r in results:
        assert r["groups"] > 0 and not r["flag_set"] and r["zero_grads_given"] > 0, r


@pytest.mark.skipif(LOOPED, reason="transformers %s keeps experts in a skipping loop (the tests above)" % TRANSFORMERS)
@pytest.mark.parametrize("framework", ["verl"])
def test_3d_experts_are_exact_unpatched_through_a_framework(framework):
    """One framework's wrapping per stack; every transformers release: test_moe_3d_experts.py."""
    _installed(framework)
    results, stderr, differ = moe_jobs.run(framework, "qwen3_moe", None)
    assert differ, "the ranks' tokens reached the same experts: the scenario proves nothing"
    assert results is not None, stderr
    _assert_dp_exact(results)


@pytest.mark.parametrize("framework", ["verl"])
def test_qwen3_vl_moe_has_3d_experts_and_is_exact_unpatched(framework):
    _installed(framework)
    _family("qwen3_vl_moe")
    results, stderr, differ = moe_jobs.run(framework, "qwen3_vl_moe", None)
    assert differ, "the ranks' tokens reached the same experts: the scenario proves nothing"
    assert results is not None, stderr
    _assert_dp_exact(results)
