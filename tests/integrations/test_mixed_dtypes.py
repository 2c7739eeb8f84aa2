"""fp32-kept MoE routers in a bf16 FSDP2 unit (``fixes.mixed_dtypes``): proven on real FSDP2 (issue #42 item 4).

transformers >= 5.24.0 keeps ``mlp.gate.weight`` in fp32 (``_keep_in_fp32_modules_strict``) for GLM-4.5
(glm4_moe) and DeepSeek-V3 (and glm4v_moe, deepseek_v2).  A tiny model built from its config is saved in bf16
and loaded back on each of 2 CPU gloo ranks by transformers' own ``from_pretrained(dtype=torch.bfloat16)``
(bf16 weights, fp32 routers: asserted), with different data per rank, against an unsharded copy loaded the same
way and trained on the data-parallel average (``harness dtype_scenarios``).  Two wrappings, as released:
torch's per-layer recipe (bf16 params / fp32 reduce: what verl, SkyRL, AReaL and LLaMA-Factory call) and
accelerate's ``Accelerator.prepare`` with ``mixed_precision="no"`` (through the named CPU stand-in
``trl_scenarios.cpu_fsdp``); GLM-4.5V (glm4v_moe, image batches, ``glm4v`` patch) through accelerate.  Unpatched:
torch's exact AssertionError at the first forward.  Patched (``moe``; ``glm4v``): every router is its own unit
computing in fp32 and every gradient and parameter equals the reference.  (GLM-4.5V through the per-layer recipe
runs too, router fp32, but a vision-tower gradient sits 0.014 of the largest off the reference under the bf16
policy: the tower's policy, not this fix (the routers cast to bf16 and no fix: the same 0.0139); not asserted.)

Tolerance: both sides do the same arithmetic (bf16 weights, fp32 router) on the same inputs; FSDP2's fp32
reduce-scatter of two bf16 gradients halved, cast back to bf16, rounds once as autograd's bf16 sum of the two
halved contributions does.  Measured 0.0; the bound is one bf16 rounding step (2**-8) relative to the largest
gradient, so a stray reduction in another dtype or an unaveraged gradient (errors of order 1) fails.
"""

import re

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")

from fsdp2_compat.core import guards  # noqa: E402

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("torch", "transformers", "accelerate")

needs_fp32_routers = pytest.mark.skipif(
    not guards.in_range(guards.installed_version("transformers") or "0", ">=5.24.0"),
    reason="transformers < 5.24.0 keeps no MoE router in fp32 (_keep_in_fp32_modules_strict lists only the "
           "e_score_correction_bias buffer): every unit is uniform, nothing to fix")

UPSTREAM_FAILURE = re.compile(r"step 0: AssertionError: FSDP expects uniform original parameter dtype but got "
                              r"\{torch\.(bfloat16, torch\.float32|float32, torch\.bfloat16)\}$")
TOL = 2 ** -8
FAMILIES = ("glm4_moe", "deepseek_v3")
WRAPS = ("per-layer", "accelerate")
# the routers transformers 5.24.0 loads fp32 (the tiny GLM-4.5V's first layer is dense: first_k_dense_replace)
ROUTERS = {"glm4_moe": ["model.layers.%d.mlp.gate.weight" % i for i in range(2)],
           "deepseek_v3": ["model.layers.%d.mlp.gate.weight" % i for i in range(2)],
           "glm4v_moe": ["model.language_model.layers.1.mlp.gate.weight"]}
PATCH = {"glm4_moe": "moe", "deepseek_v3": "moe", "glm4v_moe": "glm4v"}
CASES = ([dict(family=f, wrap="per-layer", patches=None) for f in FAMILIES]
         + [dict(family="glm4_moe", wrap="accelerate", patches=None)]
         + [dict(family=f, wrap=w, patches=[PATCH[f]]) for f in FAMILIES for w in WRAPS]
         + [dict(family="glm4v_moe", wrap="accelerate", patches=["glm4v"])])


@pytest.fixture(scope="module")
def results():
    if not guards.in_range(guards.installed_version("transformers") or "0", ">=5.24.0"):
        pytest.skip("transformers < 5.24.0 keeps no MoE router in fp32: nothing to fix")
    if guards.installed_version("accelerate") is None:
        pytest.skip("accelerate is not installed in this set")
    from fsdp2_compat_harness import dtype_scenarios

    per_case, error = dtype_scenarios.collect(CASES, pg_timeout=20, timeout=400)
    return {(c["family"], c["wrap"], bool(c["patches"])): r for c, r in zip(CASES, per_case)}, error


def _ranks(results, key):
    found, error = results
    assert found[key] is not None, error
    for r in found[key]:
        assert r["loaded_fp32"] == ROUTERS[key[0]], r["loaded_fp32"]
    return found[key]


@needs_fp32_routers
@pytest.mark.parametrize("family, wrap", [(f, "per-layer") for f in FAMILIES] + [("glm4_moe", "accelerate")])
def test_unpatched_mixed_unit_raises_torchs_assertion(results, family, wrap):
    for r in _ranks(results, (family, wrap, False)):
        assert r["error"] and UPSTREAM_FAILURE.match(r["error"]), r["error"]
        assert r["rebound"] == [False, False], r["rebound"]


@needs_fp32_routers
@pytest.mark.parametrize("family, wrap", [(f, w) for f in FAMILIES for w in WRAPS] + [("glm4v_moe", "accelerate")])
def test_patched_routers_get_their_own_unit_and_match_the_dp_average(results, family, wrap):
    ranks = _ranks(results, (family, wrap, True))
    for rank, r in enumerate(ranks):
        assert r["error"] is None, (rank, r["error"])
        assert r["rebound"] == [True, True], "a name imported before the patch must be the patched fully_shard"
        assert [i.rpartition(".mlp.")[2] for i in r["islands"]] == ["gate (torch.float32)"] * len(ROUTERS[family])
        assert r["router_dtypes"] == ["float32"], "the router must compute with its fp32 weight: %s" % r
        assert r["grads_checked"] > 0
        assert r["grad_rel_to_max"] <= TOL and r["grad_err"] <= TOL, (rank, r["worst_grad"], r["grad_err"])
        assert r["loss_err"] <= TOL and r["param_err"] <= TOL, r
    assert ranks[0]["losses"] != ranks[1]["losses"], "the ranks must see different data"
    print("%s, %s: islands %s, router %s, worst gradient %.2g (%s), parameters %.2g" % (
        family, wrap, ranks[0]["islands"], ranks[0]["router_dtypes"], max(r["grad_err"] for r in ranks),
        ranks[0]["worst_grad"], max(r["param_err"] for r in ranks)))


def test_a_bare_minority_parameter_is_refused_naming_it():
    """No submodule holds only the fp32 parameter: nothing can be split, the call refuses before sharding."""
    import torch

    from fsdp2_compat.fixes import mixed_dtypes

    block = torch.nn.Module()
    block.proj = torch.nn.Linear(4, 4).to(torch.bfloat16)
    block.A_log = torch.nn.Parameter(torch.zeros(4))  # fp32 beside bf16 weights, in the same module
    with pytest.raises(ValueError, match=r"uniform original parameter dtype.*A_log \(float32\)"):
        mixed_dtypes.plan([block])
    block.A_log.requires_grad_(False)  # frozen parameters are exempt from torch's check: nothing to do
    assert mixed_dtypes.plan([block]) == []


def test_the_moe_and_glm4v_patches_carry_the_torch_target_for_the_fp32_router_families():
    from fsdp2_compat import registry
    from fsdp2_compat.integrations import torch_fsdp

    target = torch_fsdp.MIXED_DTYPE_UNITS
    assert set(target.families) == {"glm4_moe", "glm4v_moe", "deepseek_v2", "deepseek_v3"}
    carrying = {p.name for p in registry.PATCHES if target in p.targets}
    assert carrying == {"moe", "glm4v"}, carrying
    for model_type in target.families:
        assert registry.for_model_type(model_type).name in carrying, model_type


def test_the_policy_param_dtype_decides_which_dtype_stays_in_the_call():
    """A layer whose fp32 parameters outweigh its bf16 ones still keeps the bf16 ones under a bf16 policy: the fp32
    submodule is the island (it computes in fp32), never the other way round."""
    import torch

    from fsdp2_compat.fixes import mixed_dtypes

    layer = torch.nn.Module()
    layer.attn = torch.nn.Linear(2, 2).to(torch.bfloat16)
    layer.gate = torch.nn.Linear(64, 64)  # fp32, the larger
    assert [n for n, _ in mixed_dtypes.plan([layer], param_dtype=torch.bfloat16)] == ["Module.gate"]
    assert [n for n, _ in mixed_dtypes.plan([layer])] == ["Module.attn"]  # no policy dtype: the larger stays


def test_applied_at_start_up_while_torch_distributed_fsdp_is_still_importing():
    """The way users enable it: the patch requested first, then torch's FSDP2 imported.  The target's hook fires
    inside ``import torch.distributed.fsdp`` (the package half-initialised); every name ends up the patched one."""
    import os
    import subprocess
    import sys

    code = ("import fsdp2_compat.auto\nimport torch.distributed.fsdp as f\n"
            "from torch.distributed.fsdp._fully_shard import _fully_shard as impl\n"
            "from fsdp2_compat.core.swaps import is_ours\nprint(is_ours(f.fully_shard), is_ours(impl.fully_shard))\n")
    env = dict(os.environ, FSDP2_COMPAT_PATCHES="moe")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.split() == ["True", "True"], (proc.stdout, proc.stderr[-2000:])
