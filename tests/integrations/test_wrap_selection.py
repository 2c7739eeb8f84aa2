"""The wrap-selection fix, proven on real FSDP2 through each framework's own entry point.

Each framework shards as its trainer does (``fsdp2_compat_harness.frameworks.shard``):
verl / SkyRL ``apply_fsdp2``, AReaL ``parallelize_model``, LLaMA-Factory
``FSDP2Engine.prepare_model`` on the process group its ``DistributedInterface``
creates.  For every framework release installed in this pinned set:
- unpatched, the first forward of a tiny GLM4V (and of the other families
  whose auxiliary embedding is read raw) raises the mixed Tensor/DTensor error
  (so the patch is needed);
- patched, two ranks with different data train two optimizer steps and match
  an unsharded reference trained on the data-parallel average, to 1e-5;
- the set of FSDP units differs from upstream's only by auxiliary embeddings
  (LLaMA-Factory: and by the units of the one layer class its lookup picks from
  a list, which the patch restores on transformers 5.x).

Where upstream itself changed: PaddleOCR-VL reads no weight raw from
transformers 5.15.0 (it then trains unpatched: proven too), and SkyRL cannot
take a Step-3.7 config at all (no top-level ``tie_word_embeddings``, patched or
not: proven, then skipped with that reason).
"""

import re

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")

from fsdp2_compat import integrations, registry  # noqa: E402
from fsdp2_compat.core import guards  # noqa: E402
from fsdp2_compat_harness import tiny as tiny_models  # noqa: E402
from fsdp2_compat_harness.ranks import run_ranks  # noqa: E402
from fsdp2_compat_harness.scenarios import tie_flag_refusal, train  # noqa: E402
from support.rank_jobs import train_families, wrap_plans  # noqa: E402

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("torch", "transformers", "{framework}")

FRAMEWORKS = [
    pytest.param(i.dist, marks=pytest.mark.skipif(guards.installed_version(i.dist) is None,
                                                  reason="%s not in this pinned set" % i.dist))
    for i in integrations.wrapping()  # the frameworks with an apply_fsdp2 of their own (not TRL)
]

# How upstream fails on 2 ranks without the patch, per family (what was
# observed; the patch that fixes each comes from the catalogue).  Where the
# auxiliary embedding's parent is itself a layer class (SigLIP2 embeddings in
# transformers 5.x) or a layer class nests another (Qwen2-Audio's attention),
# torch 2.13 refuses the nested group already at wrap time.
MIXED = r"got mixed torch.Tensor and DTensor"
NESTED = r"^(apply_fsdp2|prepare_model): RuntimeError: Cannot concatenate overlapping meshes"
UPSTREAM_FAILURE = {
    "glm4v": r"^step 0: RuntimeError: aten.grid_sampler_2d.default " + MIXED,
    "glm4v_moe": r"^step 0: RuntimeError: aten.grid_sampler_2d.default " + MIXED,
    "glm46v": r"^step 0: RuntimeError: aten.grid_sampler_2d.default " + MIXED,
    "lfm2_vl": NESTED + "|" + MIXED,
    "qwen2_audio": NESTED + "|" + MIXED,
    "voxtral": r"^step 0: RuntimeError: aten.add.Tensor " + MIXED,
    "audioflamingo3": NESTED + "|" + MIXED,
    "paddleocr_vl": r"^step 0: RuntimeError: aten.add.Tensor " + MIXED,  # transformers < 5.15
    "hunyuan_vl": r"^step 0: RuntimeError: aten.add.Tensor " + MIXED,
    "step3p7": r"^step 0: RuntimeError: aten.add.Tensor " + MIXED,
    # the VQ codebook (an nn.Embedding) inside a layer class (the quantizer)
    "glm_image": NESTED,
    "cosmos3_edge": r"^step 0: RuntimeError: aten.add.Tensor " + MIXED,
    "deepseek_ocr2": r"^step 0: RuntimeError: aten.cat.default " + MIXED,
    # transformers 5.x: as GLM-Image; 4.57 lists no quantizer layer class, and its codebook read crashes
    "chameleon": NESTED + "|" + r"^step 0: RuntimeError: aten.add.Tensor " + MIXED,
}
PATCH_OF = registry.selection_model_types()
RAW_READ_FAMILIES = [f for f in PATCH_OF if f in tiny_models.FAMILIES]
TOL = 1e-5


def family_param(family):
    return pytest.param(family, marks=pytest.mark.wrappable(family))  # skips at setup unless tiny.wrappable


def skip_if_framework_refuses(framework, family):
    """The framework cannot take this family's config at all (proven below): skip with the reason."""
    reason = tie_flag_refusal(framework, tiny_models.quiet(tiny_models.tiny_config, family, False))
    if reason is not None:
        pytest.skip(reason)


def assert_matches_the_reference(results):
    for rank, result in enumerate(results):
        assert result["error"] is None, "rank %d: %s" % (rank, result["error"])
        assert result["grads_checked"] > 0
        assert result["loss_err"] < TOL, result
        assert result["grad_err"] < TOL, "rank %d worst gradient %s: %.2e" % (rank, result["worst_grad"], result["grad_err"])
        assert result["param_err"] < TOL, result
    # Different data per rank, or the reference could not tell averaged from local gradients.
    assert results[0]["losses"] != results[1]["losses"]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("family", [family_param(f) for f in RAW_READ_FAMILIES])
def test_unpatched_first_forward_raises_mixed_tensor_error(framework, family):
    skip_if_framework_refuses(framework, family)
    removed = tiny_models.raw_read_removed(family)
    if removed is not None:
        pytest.skip(removed + " (test_unpatched_trains_where_transformers_removed_the_raw_read)")
    result = run_ranks(train, 2, framework, family, None)[0]
    assert result["error"] is not None, "upstream %s did not crash on %s: the patch would be pointless" % (framework, family)
    assert re.search(UPSTREAM_FAILURE[family], result["error"]), result["error"]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("family", [family_param(f) for f in RAW_READ_FAMILIES])
def test_patched_two_ranks_match_the_data_parallel_reference(framework, family):
    skip_if_framework_refuses(framework, family)
    assert_matches_the_reference(run_ranks(train, 2, framework, family, PATCH_OF[family]))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("family", [family_param(f) for f in RAW_READ_FAMILIES if f in tiny_models.RAW_READ_REMOVED])
def test_unpatched_trains_where_transformers_removed_the_raw_read(framework, family):
    """PaddleOCR-VL from transformers 5.15.0: upstream's plan is right, the patch is not needed."""
    removed = tiny_models.raw_read_removed(family)
    if removed is None:
        pytest.skip("this transformers still reads %s's embedding weight raw" % family)
    assert_matches_the_reference(run_ranks(train, 2, framework, family, None))


STEP3P7 = tiny_models.unavailable("step3p7")
SKYRL_LOOPS = [
    pytest.param(d, marks=pytest.mark.skipif(guards.installed_version(d) is None, reason="%s not in this pinned set" % d))
    for d in ("skyrl", "skyrl-train")
]


@pytest.mark.skipif(STEP3P7 is not None, reason=str(STEP3P7))
@pytest.mark.parametrize("framework", SKYRL_LOOPS)
def test_skyrl_refuses_a_config_without_a_top_level_tie_flag_patched_or_not(framework):
    """Step-3.7's config class has no top-level tie_word_embeddings; SkyRL's loop reads it without a default.
    With the key present (a config.json that carries it), the fix is what makes it train."""
    assert tie_flag_refusal(framework, tiny_models.quiet(tiny_models.tiny_config, "step3p7", False))
    missing = r"^apply_fsdp2: AttributeError: 'Step3p7Config' object has no attribute 'tie_word_embeddings'"
    for patches in (None, PATCH_OF["step3p7"]):
        [result] = run_ranks(train, 1, framework, "step3p7", patches)
        assert re.search(missing, result["error"] or ""), (patches, result["error"])
    flag = {"config_attrs": {"tie_word_embeddings": False}}
    unpatched = run_ranks(train, 2, framework, "step3p7", None, kwargs=flag)[0]
    assert re.search(UPSTREAM_FAILURE["step3p7"], unpatched["error"] or ""), unpatched["error"]
    assert_matches_the_reference(run_ranks(train, 2, framework, "step3p7", PATCH_OF["step3p7"], kwargs=flag))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_one_rank_crashes_unpatched_on_glm4v_and_matches_the_reference_patched(framework):
    """One rank (no data-parallel average to miss): the same GLM4V error, and every patched
    family trains like the unsharded model."""
    families = [f for f in RAW_READ_FAMILIES if tiny_models.unwrappable(f) is None
                and tie_flag_refusal(framework, tiny_models.quiet(tiny_models.tiny_config, f, False)) is None] + ["qwen2"]
    [runs] = run_ranks(train_families, 1, framework, families, dict(PATCH_OF, qwen2="glm4v"))
    for family in ("glm4v", "glm4v_moe", "glm46v"):
        if family in runs:
            assert re.search(UPSTREAM_FAILURE[family], runs[family]["unpatched"]["error"] or ""), runs[family]
    assert runs["qwen2"]["unpatched"]["error"] is None
    for family, run in runs.items():
        result = run["patched"]
        assert result["error"] is None, (family, result["error"])
        assert result["grads_checked"] > 0 and result["loss_err"] < TOL and result["param_err"] < TOL, (family, result)
        assert result["grad_err"] < TOL, (family, result["worst_grad"], result["grad_err"])


CONTROL_FAMILIES = ["qwen2", "llama", "qwen2_5_vl"]


def test_every_tiny_family_with_a_selection_patch_has_a_recorded_upstream_failure():
    """The catalogue and this proof agree: each family it lists is proven here, and only those."""
    assert set(RAW_READ_FAMILIES) == set(UPSTREAM_FAILURE)
    assert not set(CONTROL_FAMILIES) & set(PATCH_OF)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_patched_plan_differs_from_upstream_only_by_auxiliary_embeddings(framework):
    """Text models and Qwen2.5-VL: identical.  Others: minus the auxiliary
    embeddings (and layer classes nested inside a kept unit)."""
    config = lambda f: tiny_models.quiet(tiny_models.tiny_config, f, False)  # noqa: E731
    families = [f for f in CONTROL_FAMILIES + ["qwen3_vl"] + RAW_READ_FAMILIES
                if tiny_models.unwrappable(f) is None and tie_flag_refusal(framework, config(f)) is None]
    [plans] = run_ranks(wrap_plans, 1, framework, families, "glm4v")
    for family, plan in plans.items():
        patched = set(plan["patched"])
        # LLaMA-Factory shards one layer class; on transformers 5.x upstream finds none for a
        # VLM, the patch restores the one its list rule picks (tests/integrations/test_llamafactory.py).
        lookup = set(plan["layer_lookup"])
        assert lookup <= patched, (family, lookup - patched)
        assert "<root>" in patched and (lookup or any("layers" in n or "blocks" in n for n in patched)), (family, patched)
        if family in CONTROL_FAMILIES:
            assert plan["auxiliary"] == [], family
            assert patched - lookup == set(plan["unpatched"]) - lookup, family
            continue
        assert plan["auxiliary"], family
        assert not patched & set(plan["auxiliary"]), (family, "an auxiliary embedding kept its own group")
        if isinstance(plan["unpatched"], list):
            assert patched - lookup <= set(plan["unpatched"]), family
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
    if tiny_models.unwrappable("qwen3_vl") is not None:
        pytest.skip(str(tiny_models.unwrappable("qwen3_vl")))
    unpatched = run_ranks(train, 2, framework, "qwen3_vl", None, kwargs={"tie": "weights-only"})[0]
    assert unpatched["error"] is not None, "upstream trained a tied model split across units?"
    results = run_ranks(train, 2, framework, "qwen3_vl", "glm4v", kwargs={"tie": "weights-only"})
    for r in results:
        assert r["error"] is None, r["error"]
        assert "model.language_model.embed_tokens" not in r["wrapped"] and "lm_head" not in r["wrapped"]
        assert r["loss_err"] < TOL and r["grad_err"] < TOL, (r["worst_grad"], r["grad_err"])
