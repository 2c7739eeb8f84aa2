"""verl's own FSDP training engine (0.7, 0.8, 0.9), end to end on 2 CPU gloo ranks: the bug and the fix where users meet them.

``fsdp2_compat_harness.engines.verl_engine``: ``EngineRegistry.new("language_model",
"fsdp2")`` -> ``FSDPEngineWithLMHead``, a tiny model loaded from a saved
directory, verl's SFT batches (different samples on each rank) through
``forward_backward_batch`` + ``optimizer_step`` and ``train_batch``, plain and
with ``use_fused_kernels=True`` (torch backend).  Patched, every loss, gradient
and parameter matches an unsharded reference trained on the data-parallel
average (fp32, 1e-5; verl's default bf16 policy within bf16 noise); unpatched,
each bug shows its exact error, and the controls train correctly as released.
Mixed text/image ranks (issue #20): verl's own model forwards run a dummy
vision forward on text-only samples, so one rank's text-only batch beside
another's images trains to the DP average without fsdp2-compat's mixed-ranks
fix, and with it nothing runs twice (verl's forward replaced ours).
verl 0.7.0's engine autocasts its forward to bf16 whatever the policy: there the
reference shares that autocast and every comparison is held to the bf16 bound
(``common.tolerance``); 0.7.0 also keeps ``lm_head`` in the root unit.

Stand-ins (CUDA-bound only, see ``tooling/engines/cpu.py``): verl 0.9, a CPU
platform registered through verl's own ``PlatformRegistry``; verl 0.7 / 0.8 (which
name the device ``cpu`` themselves), its FSDP engine class registered for ``cpu``
through verl's ``EngineRegistry.register``.  Nothing of verl's is replaced,
nothing wraps the model.
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")

from fsdp2_compat import registry  # noqa: E402
from fsdp2_compat.core import guards  # noqa: E402
from fsdp2_compat.fixes import glm4v_forward  # noqa: E402
from fsdp2_compat.integrations import verl as verl_targets  # noqa: E402
from fsdp2_compat_harness import tiny as tiny_models  # noqa: E402
from fsdp2_compat_harness.engines import FAMILIES, common, verl_engine  # noqa: E402
from fsdp2_compat_harness.mixed import gloo_error  # noqa: E402
from fsdp2_compat_harness.ranks import RankError, run_ranks  # noqa: E402
from support import mixed_jobs  # noqa: E402

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("torch", "transformers", "verl")

RUNNABLE = verl_engine.unrunnable()
pytestmark = pytest.mark.skipif(RUNNABLE is not None, reason=str(RUNNABLE))
VERL = guards.installed_version("verl")
TRANSFORMERS = guards.installed_version("transformers")
# verl 0.7 / 0.8's engine cannot run fused kernels without remove_padding (flash-attn): its sft_loss calls
# .values() on padded log-probs ("values expected sparse tensor layout but got Strided"), patched or not.
FUSED_RUNS = VERL is not None and guards.in_range(VERL, ">=0.9.0")
# verl 0.7.1+ selects an untied lm_head by name for a unit of its own; 0.7.0 leaves it in the root unit.
LM_HEAD_UNIT = VERL is not None and guards.in_range(VERL, ">=0.7.1")
MIXED = "got mixed torch.Tensor and DTensor"
UNAVERAGED = "lm_head gradient is not the data-parallel average"
# How verl's engine (0.7-0.9) fails unpatched (observed; why: README "What it fixes").  Absent: trains
# correctly as released (the controls).
UPSTREAM_FAILURE = {
    ("glm4v", "plain"): "step 0: RuntimeError: aten.grid_sampler_2d.default " + MIXED,
    ("glm4v", "fused"): "step 0: RuntimeError: aten.grid_sampler_2d.default " + MIXED,
    ("glm4v_moe", "plain"): "step 0: RuntimeError: aten.grid_sampler_2d.default " + MIXED,
    # GLM-4.5V gets verl's text-only dense_common fused forward: the vision tower never runs.
    ("glm4v_moe", "fused"): "step 0: RuntimeError: aten.mm.default " + MIXED,
    ("qwen2_5_vl", "fused"): "step 0: RuntimeError: aten.mm.default " + MIXED,
    ("qwen2", "fused"): "step 0: RuntimeError: aten.mm.default " + MIXED,
    # verl 0.9's Qwen3-VL fused forward reads lm_head with plain full_tensor(): runs, unaveraged.
    ("qwen3_vl", "fused"): UNAVERAGED,
}
# Upstream problems the patch does not fix, where they show (README "Upstream problems this package does
# not fix"): on transformers < 5.0.0rc0 verl feeds its 4-row position ids to transformers' own GLM-4.5V
# forward (verl installs no glm4v_moe forward), whose rotary embedding takes 3.
SIZE_MISMATCH = ("step 0: RuntimeError: The size of tensor a (3) must match the size of tensor b (4) "
                 "at non-singleton dimension 0")
NOT_FIXED = {("glm4v_moe", "plain"): SIZE_MISMATCH} if "process_position_ids" in glm4v_forward.adapted_for(
    TRANSFORMERS) else {}
# The verl module whose forward the engine installs, per family, with fused kernels.
FUSED_FORWARD = {"glm4v": "glm4v", "glm4v_moe": "dense_common", "qwen3_vl": "qwen3_vl", "qwen2_5_vl": "qwen2_vl",
                 "qwen2": "dense_common"}
SCENARIOS = [(f, m) for f in FAMILIES for m in ("plain", "fused")]
# Patched runs: every scenario but the plain controls, where no target of the family's patch is on the
# path (the qwen patches and textlm fix fused forwards only): that run is the unpatched one, which matches.
PATCHED = [s for s in SCENARIOS if s in UPSTREAM_FAILURE or s[1] == "fused" or s[0].startswith("glm")]


def _scenario(family, mode):
    reason = tiny_models.unwrappable(family)
    if reason is None and mode == "fused" and not FUSED_RUNS:
        reason = "verl %s's engine runs fused kernels only with remove_padding (flash-attn, CUDA)" % VERL
    return pytest.param(family, mode, id="%s-%s" % (family, mode),
                        marks=pytest.mark.skipif(reason is not None, reason=str(reason)))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("verl-engine-models"))
    return lambda family: common.model_dir(family, root)


def _run(model_dirs, family, mode, patches, **kwargs):
    return run_ranks(verl_engine.train_verl_engine, 2, family, model_dirs(family), patches,
                     kwargs=dict(fused=mode == "fused", **kwargs))


def _assert_lm_head_unit(units):
    assert ("lm_head" in units) == LM_HEAD_UNIT, units


def _assert_matches(results, steps=2):
    for rank, r in enumerate(results):
        where = "rank %d" % rank
        # 1e-5 for fp32; the bf16 bound for verl's bf16 policy and where verl computes in bf16 whatever the
        # policy (0.7.0's forward_step autocasts to bf16), nowhere else.
        assert r["autocast"] == (None if guards.in_range(VERL, ">=0.8.0") else "bfloat16"), r["autocast"]
        tol = common.tolerance(r)
        assert r["error"] is None, "%s: %s" % (where, r["error"])
        assert r["engine_class"] == "FSDPEngineWithLMHead" and r["device"] == "cpu"
        assert r["loss_err"] < tol, (where, r["losses"], r["loss_err"])
        for step in range(steps):
            key = "step%d" % step
            assert r[key + "_grads_checked"] > 0
            assert r[key + "_grad_err"] < tol, "%s %s worst gradient %s: %.2e" % (
                where, key, r[key + "_worst_grad"], r[key + "_grad_err"])
            assert r[key + "_lm_head_grad_err"] < tol, (where, key, r[key + "_lm_head_grad_err"])
            assert r["param_err_after_%s" % key] < tol, (where, key, r["param_err_after_%s" % key])
        assert r["grad_norm_err"] < tol, (where, r["grad_norm_err"])
    # Different samples on each rank, or the reference could not tell averaged gradients from local ones
    # (the reference's losses: verl 0.7.0 reports bf16-rounded ones, which two ranks can share).
    assert results[0]["reference_losses"] != results[1]["reference_losses"]


@pytest.mark.parametrize("family,mode", [_scenario(*s) for s in SCENARIOS])
def test_unpatched_engine_fails_exactly_where_upstream_has_the_bug(model_dirs, family, mode):
    results = _run(model_dirs, family, mode, None, steps=1)
    r = results[0]
    assert r["activation"]["requested"] == [] and r["activation"]["outcomes"] == {}
    _assert_lm_head_unit(r["units"])
    if family.startswith("glm"):  # upstream's selection: the vision position table gets a unit of its own
        assert "model.visual.embeddings.position_embedding" in r["units"], r["units"]
    expected = UPSTREAM_FAILURE.get((family, mode))
    if expected is None:  # a control: verl's engine trains it correctly as released
        _assert_matches(results, steps=1)
    elif expected == UNAVERAGED:
        assert r["error"] is None, r["error"]
        errs = [x["step0_lm_head_grad_err"] for x in results]
        assert min(errs) > 1e-3, "the plain full_tensor() lm_head gradient should miss the DP average: %s" % errs
        assert max(x["step0_grad_err"] for x in results) == max(errs)  # lm_head is the only wrong one
    else:
        assert r["error"] is not None and r["error"].startswith(expected), r["error"]


@pytest.mark.parametrize("family,mode", [_scenario(*s) for s in PATCHED])
def test_patched_engine_matches_the_dp_average(model_dirs, family, mode):
    patch = registry.for_model_type(family).name
    results = _run(model_dirs, family, mode, patch)
    if (family, mode) in NOT_FIXED:  # past our fix, upstream's next failure (the test fails the day it goes)
        assert results[0]["error"] == NOT_FIXED[family, mode], results[0]["error"]
        assert "model.visual.embeddings.position_embedding" not in results[0]["units"]
        return
    _assert_matches(results)
    r = results[0]
    assert r["activation"]["requested"] == [patch]
    _assert_lm_head_unit(r["units"])
    assert "model.visual.embeddings.position_embedding" not in r["units"], r["units"]
    if mode == "fused":
        assert r["forward"] == "verl.models.transformers." + FUSED_FORWARD[family], r["forward"]
    if family == "glm4v":
        # verl's own GLM4V forward ran (fused or not), through the patch's forward targets where needed.
        assert r["forward"] == "verl.models.transformers.glm4v", r["forward"]
        for attr in ("_get_input_embeds", "process_position_ids"):
            needed = attr in glm4v_forward.adapted_for(TRANSFORMERS)
            kind = r["activation"]["outcomes"]["verl:verl.models.transformers.glm4v." + attr]
            assert kind == ("applied" if needed else "not needed"), (attr, kind)


# How verl's GLM4V forward fails once the selection is fixed, by what transformers needs adapted.
GLM4V_FORWARD_FAILURE = {
    ("_get_input_embeds",): "step 0: AttributeError: 'BaseModelOutputWithPooling' object has no attribute 'shape'",
    ("process_position_ids",): SIZE_MISMATCH,
}


@pytest.mark.skipif(not glm4v_forward.adapted_for(TRANSFORMERS),
                    reason="transformers %s: verl's GLM4V forward runs as released" % TRANSFORMERS)
def test_glm4v_in_verl_engine_needs_the_forward_targets(model_dirs):
    """The glm4v patch without its verl-forward targets: the selection is fixed, verl's GLM4V forward is not."""
    adapted = glm4v_forward.adapted_for(TRANSFORMERS)
    without = ["glm4v"] + ["-" + t.key for t in verl_targets.GLM4V_FORWARD]
    r = _run(model_dirs, "glm4v", "plain", without, steps=1)[0]
    assert "model.visual.embeddings.position_embedding" not in r["units"]
    assert r["error"] == GLM4V_FORWARD_FAILURE[adapted], r["error"]


@pytest.mark.parametrize("family,mode", [_scenario("glm4v", "plain"), _scenario("qwen3_vl", "fused")])
def test_bf16_policy_trains_close_to_the_fp32_reference(model_dirs, family, mode):
    """verl's default mixed precision (bf16 parameters, fp32 reduce): patched runs train within bf16 noise.

    Unpatched, Qwen3-VL's fused forward meets its bf16 lm_head weight with an fp32 ``full_tensor()`` (crash).
    On verl 0.7.x the reference shares the engine's forced bf16 autocast (see ``verl_engine``).
    """
    if (family, mode) == ("qwen3_vl", "fused"):
        r = _run(model_dirs, family, mode, None, bf16=True, steps=1)[0]
        assert r["error"] is not None and "expected m1 and m2 to have the same dtype" in r["error"], r["error"]
    results = _run(model_dirs, family, mode, registry.for_model_type(family).name, bf16=True)
    assert results[0]["bf16"] and common.tolerance(results[0]) == common.BF16_TOL
    _assert_matches(results)


MIXED_PG_TIMEOUT = 60  # a mismatch (a verl forward that skipped the tower) fails in a minute, never hangs
QWEN2_VL_DUMMY = verl_targets.QWEN2_VL_FORWARD[0].key  # verl's own text-only dummy, fixed for transformers >= 5
DUMMY_FAILURE = "step 0: AttributeError: 'BaseModelOutputWithPooling' object has no attribute 'mean'"
# Step 0: rank 0 an image and a video per sample, rank 1 an image; step 1 the reverse.
BOTH_KINDS = (("image", "video"), ("image",))


def _run_mixed(model_dirs, family, patches, **kwargs):
    try:
        return _run_mixed_or_raise(model_dirs, family, patches, **kwargs)
    except RankError as exc:
        pytest.fail("a rank's mixed media broke verl's engine: %s" % str(exc).splitlines()[0])


def _run_mixed_or_raise(model_dirs, family, patches, **kwargs):
    return run_ranks(verl_engine.train_verl_engine, 2, family, model_dirs(family), patches,
                     kwargs=kwargs or {"mixed": True}, timeout=MIXED_PG_TIMEOUT + 240, retries=0,
                     pg_timeout=MIXED_PG_TIMEOUT)


@pytest.mark.skipif(tiny_models.unwrappable("qwen2_5_vl") is not None, reason=str(tiny_models.unwrappable("qwen2_5_vl")))
def test_mixed_text_and_image_ranks_on_verls_own_forward_need_only_its_dummy_fixed(model_dirs):
    """verl's Qwen2-VL / Qwen2.5-VL forward runs its own dummy vision forward on text-only samples.

    Step 0: rank 1 text-only, step 1: rank 0.  Patched, both steps match the DP reference and
    fsdp2-compat's own dummy never runs (verl's forward replaced the wrapped one).  Unpatched, the same
    run is exact where verl's dummy works as released (transformers 4.x, 5.0.0rc), and where it calls
    ``.mean()`` on transformers 5's vision output the text-only rank raises that (the qwen2vl patch's
    verl target fixes it).  No release hangs.
    """
    patched = _run_mixed(model_dirs, "qwen2_5_vl", "qwen2vl")
    _assert_matches(patched)
    assert [r["dummy_forwards"] for r in patched] == [0, 0]  # verl's forward replaced ours: no second dummy
    assert patched[0]["activation"]["outcomes"][QWEN2_VL_DUMMY] == "applied"
    unpatched = _run_mixed(model_dirs, "qwen2_5_vl", None)
    if guards.in_range(TRANSFORMERS, glm4v_forward.VISION_OUTPUT_OBJECT):
        text = common.text_only_rank(0, 2)  # the text-only rank of step 0
        assert unpatched[text]["error"] == DUMMY_FAILURE, unpatched[text]["error"]
        assert unpatched[1 - text]["error"] is not None  # its peer: the collective it was in broke
    else:
        _assert_matches(unpatched)


# verl's GLM-4.1V dummy hard-codes the real tower's patch: 16 rows of 3 * 2 * 14 * 14 = 1176 values.
GLM4V_REAL_PATCH = {"patch_size": 14, "image_size": 56}


@pytest.mark.wrappable("glm4v")
def test_mixed_text_and_image_ranks_on_verls_own_glm4v_forward_train_to_the_dp_average(tmp_path_factory):
    """verl's GLM-4.1V forward runs its own dummy (real geometry only: 1176-wide patches) on text-only samples.

    Step 0: rank 1 text-only, step 1: rank 0, a tiny GLM-4.1V with the real tower's 14-pixel patches.  With
    the glm4v patch (its selection fix, and the fixes that make verl's GLM forward run on this transformers)
    every step matches the DP reference and fsdp2-compat's own dummy never runs: verl needs nothing more.
    """
    root = str(tmp_path_factory.mktemp("verl-engine-glm4v-p14"))
    model_dir = common.model_dir("glm4v", root, vision=GLM4V_REAL_PATCH)
    try:
        results = run_ranks(verl_engine.train_verl_engine, 2, "glm4v", model_dir, "glm4v", kwargs={"mixed": True},
                            timeout=MIXED_PG_TIMEOUT + 240, retries=0, pg_timeout=MIXED_PG_TIMEOUT)
    except RankError as exc:
        pytest.fail("a text-only rank beside an image rank broke verl's GLM-4.1V forward: %s" % exc)
    _assert_matches(results)
    assert [r["dummy_forwards"] for r in results] == [0, 0]
    assert all(r["forward"] == "verl.models.transformers.glm4v" for r in results), results[0]["forward"]


VERL_FORWARD_PATCH = {"qwen2_5_vl": "qwen2vl", "qwen3_vl": "qwen3vl"}


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.wrappable(f)) for f in VERL_FORWARD_PATCH])
def test_images_and_videos_on_one_rank_through_verls_own_forward_train_to_the_dp_average(model_dirs, family):
    """verl's ``_get_input_embeds`` calls the tower once per kind; patched it runs once per micro-batch.

    Rank 0's samples carry an image and a video each on step 0, rank 1's an image (step 1: the reverse),
    two micro-batches per rank and step with the gradient sync deferred (``forward_backward_batch``), then
    ``train_batch``.  Patched, every loss, gradient and parameter matches the DP reference, and each rank
    merged exactly its two both-kinds micro-batches.
    """
    patched = _run_mixed(model_dirs, family, VERL_FORWARD_PATCH[family], kinds=BOTH_KINDS)
    _assert_matches(patched)
    assert [r["merged_forwards"] for r in patched] == [2, 2], patched
    assert [r["dummy_forwards"] for r in patched] == [0, 0]
    assert patched[0]["losses"] != patched[1]["losses"], "same data on both ranks"


@pytest.mark.wrappable("qwen2_5_vl")
def test_unpatched_images_and_videos_on_one_rank_break_verls_vision_collectives(model_dirs, tmp_path):
    """As released, the rank with both kinds all-gathers the vision units twice: gloo aborts the step
    (from a C++ thread, SIGABRT: what it printed is read from the ranks' stderr files)."""
    with pytest.raises(RankError):
        run_ranks(mixed_jobs.verl_engine_with_stderr_file, 2, str(tmp_path), "qwen2_5_vl", model_dirs("qwen2_5_vl"),
                  None, kwargs={"kinds": BOTH_KINDS}, timeout=MIXED_PG_TIMEOUT + 240, retries=0,
                  pg_timeout=MIXED_PG_TIMEOUT)
    assert gloo_error(str(tmp_path), 2) is not None, [p.read_text()[-2000:] for p in tmp_path.glob("rank*.err")]
