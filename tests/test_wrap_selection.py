"""The wrap-selection fix, proven on real FSDP2 through each framework's own ``apply_fsdp2``.

For every framework release installed in this pinned set:
- unpatched, the first forward of a tiny GLM4V (and of the other families
  whose auxiliary embedding is read raw) raises the mixed Tensor/DTensor error
  (so the patch is needed);
- patched, two ranks with different data train two optimizer steps and match
  an unsharded reference trained on the data-parallel average, to 1e-5;
- the set of FSDP units differs from upstream's only by auxiliary embeddings.
"""

import re

import pytest

from fsdp2_compat import guards
from fsdp2_compat.examples import tiny_models
from fsdp2_compat.examples.ranks import run_ranks
from fsdp2_compat.examples.scenarios import train, wrap_plans

DIST_OF = {"verl": "verl", "skyrl": "skyrl", "skyrl-train": "skyrl-train"}
FRAMEWORKS = [
    pytest.param(fw, marks=pytest.mark.skipif(guards.installed_version(d) is None, reason="%s not in this pinned set" % d))
    for fw, d in DIST_OF.items()
]

# family -> (patch name, how upstream fails without it on 2 ranks).  Where the
# auxiliary embedding's parent is itself a layer class (SigLIP2 embeddings in
# transformers 5.x) or a layer class nests another (Qwen2-Audio's attention),
# torch 2.13 refuses the nested group already at wrap time.
MIXED = r"got mixed torch.Tensor and DTensor"
NESTED = r"^apply_fsdp2: RuntimeError: Cannot concatenate overlapping meshes"
RAW_READ_FAMILIES = {
    "glm4v": ("glm4v", r"^step 0: RuntimeError: aten.grid_sampler_2d.default " + MIXED),
    "glm4v_moe": ("glm4v", r"^step 0: RuntimeError: aten.grid_sampler_2d.default " + MIXED),
    "glm46v": ("glm4v", r"^step 0: RuntimeError: aten.grid_sampler_2d.default " + MIXED),
    "lfm2_vl": ("lfm2vl", NESTED + "|" + MIXED),
    "qwen2_audio": ("qwen2audio", NESTED + "|" + MIXED),
    "voxtral": ("voxtral", r"^step 0: RuntimeError: aten.add.Tensor " + MIXED),
    "audioflamingo3": ("audioflamingo3", NESTED + "|" + MIXED),
    "paddleocr_vl": ("paddleocrvl", r"^step 0: RuntimeError: aten.add.Tensor " + MIXED),
}
TOL = 1e-5


def family_param(family):
    reason = tiny_models.wrappable(family)
    return pytest.param(family, marks=pytest.mark.skipif(reason is not True, reason=str(reason)))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("family", [family_param(f) for f in RAW_READ_FAMILIES])
def test_unpatched_first_forward_raises_mixed_tensor_error(framework, family):
    result = run_ranks(train, 2, framework, family, None)[0]
    assert result["error"] is not None, "upstream %s did not crash on %s: the patch would be pointless" % (framework, family)
    assert re.search(RAW_READ_FAMILIES[family][1], result["error"]), result["error"]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("family", [family_param(f) for f in RAW_READ_FAMILIES])
def test_patched_two_ranks_match_the_data_parallel_reference(framework, family):
    patch = RAW_READ_FAMILIES[family][0]
    results = run_ranks(train, 2, framework, family, patch)
    for rank, result in enumerate(results):
        assert result["error"] is None, "rank %d: %s" % (rank, result["error"])
        assert result["grads_checked"] > 0
        assert result["loss_err"] < TOL, result
        assert result["grad_err"] < TOL, "rank %d worst gradient %s: %.2e" % (rank, result["worst_grad"], result["grad_err"])
        assert result["param_err"] < TOL, result
    # Different data per rank, or the reference could not tell averaged from local gradients.
    assert results[0]["losses"] != results[1]["losses"]


CONTROL_FAMILIES = ["qwen2", "llama", "qwen2_5_vl"]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_patched_plan_differs_from_upstream_only_by_auxiliary_embeddings(framework):
    """Text models and Qwen2.5-VL: identical.  Others: minus the auxiliary
    embeddings (and layer classes nested inside a kept unit)."""
    families = [f for f in CONTROL_FAMILIES + ["qwen3_vl"] + list(RAW_READ_FAMILIES) if tiny_models.wrappable(f) is True]
    [plans] = run_ranks(wrap_plans, 1, framework, families, "glm4v")
    for family, plan in plans.items():
        patched = set(plan["patched"])
        assert "<root>" in patched and any("layers" in n or "blocks" in n for n in patched), (family, patched)
        if family in CONTROL_FAMILIES:
            assert plan["auxiliary"] == [], family
            assert patched == set(plan["unpatched"]), family
            continue
        assert plan["auxiliary"], family
        assert not patched & set(plan["auxiliary"]), (family, "an auxiliary embedding kept its own group")
        if isinstance(plan["unpatched"], list):
            assert patched <= set(plan["unpatched"]), family
            dropped = set(plan["unpatched"]) - patched
            assert set(plan["auxiliary"]) <= dropped, family
            # Anything else dropped is a layer class nested in a unit the fix kept.
            nested = dropped - set(plan["auxiliary"])
            assert all(any(n.startswith(p + ".") for p in patched) for n in nested), (family, nested)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_tied_weights_under_an_untied_flag_train_when_patched(framework):
    """Tied by identity, ``config.tie_word_embeddings`` False (Qwen3-VL on 4.57):
    upstream shards the shared embedding in its own unit, so ``lm_head`` reads a
    sharded weight; the fix decides by identity and gives neither its own unit."""
    if tiny_models.wrappable("qwen3_vl") is not True:
        pytest.skip(str(tiny_models.wrappable("qwen3_vl")))
    unpatched = run_ranks(train, 2, framework, "qwen3_vl", None, kwargs={"tie": "weights-only"})[0]
    assert unpatched["error"] is not None, "upstream trained a tied model split across units?"
    results = run_ranks(train, 2, framework, "qwen3_vl", "glm4v", kwargs={"tie": "weights-only"})
    for r in results:
        assert r["error"] is None, r["error"]
        assert "model.language_model.embed_tokens" not in r["wrapped"] and "lm_head" not in r["wrapped"]
        assert r["loss_err"] < TOL and r["grad_err"] < TOL, (r["worst_grad"], r["grad_err"])
