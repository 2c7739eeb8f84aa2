"""torch FSDP2 gradient accumulation with micro-batches that skip a unit: proven on real FSDP2.

Two gloo ranks with different data, bf16 params / fp32 reduce (verl's and
SkyRL's default policy) unless said otherwise, an unsharded fp32 reference
trained on the data-parallel average (``support.accum_jobs``).  Three levels:

- pure torch (``fully_shard`` on a toy): the two bugs and the fix, no framework;
- GLM-4.1V and Qwen3-VL through each installed framework's own wrapping (verl's
  and SkyRL's ``apply_fsdp2``, AReaL's ``parallelize_model``, LLaMA-Factory's
  ``FSDP2Engine.prepare_model``, accelerate's ``Accelerator.prepare`` as TRL's
  trainers use it, deferring in ``accelerator.no_sync``), plain transformers
  forwards, step 0 = [text-only (deferred), image], step 1 = [image, text-only
  (deferred), image];
- verl issue #7520's setup: verl's fused kernels (``apply_monkey_patch``), untied
  ``lm_head`` as its own unit, deferred sync, 2-3 micro-batches.

Unpatched the deferred text-only micro-batch crashes (``AttributeError``); the
first seam alone meets the second bug (the mixed-dtype assertion) or, for
#7520, hides the crash behind an un-averaged ``lm_head`` gradient; patched,
every gradient is the data-parallel average.  Where a framework's path differs:

- accelerate's own policy for ``mixed_precision="bf16"`` (the only one
  transformers' Trainer gives it) reduces in bf16, where torch needs no upcast:
  there unpatched deferred sync is already right (to bf16 rounding); the bugs
  need a plugin policy with an fp32 reduce;
- AReaL's and LLaMA-Factory's engines never defer the sync themselves (one
  ``backward`` per micro-batch, synchronised): their "every" runs are their
  engines' loop, the deferred ones what a custom loop on their wrapping meets;
- LLaMA-Factory 0.9.5 with Qwen3-VL on transformers 5.x runs bf16 only with its
  layer-class lookup fixed (a target the ``qwen3vl`` patch carries); without
  it the first image forward fails in the vision LayerNorm, shown beside.
"""

import re

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")

from fsdp2_compat import integrations, registry  # noqa: E402
from fsdp2_compat.core import guards  # noqa: E402
from fsdp2_compat_harness.ranks import run_ranks  # noqa: E402
from support import accum_jobs  # noqa: E402

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("torch", "transformers", "{framework}")

TORCH = guards.installed_version("torch")
pytestmark = pytest.mark.skipif(
    not guards.in_range(TORCH, ">=2.7.0,<2.15.0"),
    reason="torch %s: the FSDP2 accumulation bugs are in 2.7.0-2.14.1 (2.15.0 rewrote accumulation)" % TORCH,
)

TOL, BF16_GRAD = accum_jobs.TOL, accum_jobs.BF16_GRAD
_close = accum_jobs.assert_close
ATTRIBUTE_ERROR = "AttributeError: 'FSDPParam' object has no attribute '_unsharded_param'"
MIXED_DTYPES = re.compile(
    r"AssertionError: FSDP reduce-scatter expects uniform gradient dtype but got "
    r"\{torch\.(bfloat16|float32), torch\.(float32|bfloat16)\}$"
)


# ---------------------------------------------------------------------------
# pure torch


def _toy(patches, unused=False, sync="deferred"):
    return run_ranks(accum_jobs.toy_accumulation, 2, patches, unused, sync)


@pytest.mark.depends_on("torch")
@pytest.mark.parametrize("unused", [False, True], ids=["skipped-unit", "reduce-scatter-unused-params"])
def test_unpatched_fsdp2_crashes_when_a_deferred_micro_batch_skips_a_unit(unused):
    for r in _toy(None, unused):
        assert r["error"] == ATTRIBUTE_ERROR, r["error"]


@pytest.mark.depends_on("torch")
@pytest.mark.parametrize("unused", [False, True], ids=["skipped-unit", "reduce-scatter-unused-params"])
def test_the_guard_alone_meets_the_mixed_gradient_dtype_assertion(unused):
    for r in _toy(["t-guard"], unused):
        assert r["error"] is not None and MIXED_DTYPES.match(r["error"]), r["error"]


@pytest.mark.depends_on("torch")
@pytest.mark.parametrize("unused", [False, True], ids=["skipped-unit", "reduce-scatter-unused-params"])
def test_both_seams_reduce_the_dp_average_as_sync_on_every_micro_batch_does(unused):
    patched = _toy(["t-accum"], unused)
    every = _toy(None, unused, sync="every")  # upstream, no deferral: nothing to fix
    for rank, (p, e) in enumerate(zip(patched, every)):
        assert p["error"] is None and e["error"] is None, (p["error"], e["error"])
        assert p["grads_checked"] == (2 if unused else 6)
        assert p["grad_err"] < BF16_GRAD, (rank, p["grad_err"])  # bf16 toy vs the fp32 DP-average reference
        for name, g in p["grads"].items():  # deferred + the seams == synchronising every micro-batch
            worst = max(abs(a - b) for ra, rb in zip(g, e["grads"][name]) for a, b in zip(_flat(ra), _flat(rb)))
            assert worst < 1e-6, (rank, name, worst)


def _flat(x):
    return x if isinstance(x, list) else [x]


# ---------------------------------------------------------------------------
# GLM-4.1V and Qwen3-VL through each framework's own apply_fsdp2 (plain transformers forwards)

FAMILIES = ("glm4v", "qwen3_vl")
# The patch a user of each family enables, and test-only selections of its targets
# (``support.accum_jobs``): the torch fix left out, or only its first seam.
USER_PATCH = {f: registry.for_model_type(f).name for f in FAMILIES}
WITHOUT_TORCH_FIX = {"glm4v": ["t-selection"], "qwen3_vl": None}  # GLM-4.1V needs the selection fix to run at all
GUARD_ONLY = {"glm4v": ["t-selection-guard"], "qwen3_vl": ["t-guard"]}
# The user's patch without LLaMA-Factory's layer-class lookup target (``accum_jobs``): what the
# lookup fix is for, shown where it matters (Qwen3-VL in bf16 on transformers 5.x).
WITHOUT_LF_LOOKUP = {"qwen3_vl": "t-qwen3vl-without-lookup"}
PAIRS = [("bf16 deferred", "bf16 every"), ("fp32 deferred", "fp32 every")]
# accelerate's wrapping is not a selection target (its transformer_based_wrap gives GLM-4.1V's
# vision embeddings no unit of their own): there "without the torch fix" is plain upstream.
ACCELERATE = "accelerate"
# How a precision reaches each wrapping ("bf16": bf16 params, fp32 reduce): verl and SkyRL take
# the caller's MixedPrecisionPolicy, AReaL its TrainEngineConfig dtype, LLaMA-Factory its
# bf16 argument (``frameworks.shard``), accelerate its plugin's policy (``trl_scenarios``).
TRL = guards.installed_version("trl")


def _cases(framework, family):
    patch = [USER_PATCH[family]]
    policies = ("bf16", "fp32") + (("bf16-reduce",) if framework == ACCELERATE else ())
    cases = [("%s %s" % (policy, sync), patch, policy, sync, "mixed")
             for policy in policies for sync in ("deferred", "every")]
    guard, unpatched = GUARD_ONLY[family], WITHOUT_TORCH_FIX[family]
    if framework == ACCELERATE:
        guard, unpatched = ["t-guard"], None
        cases.append(("bf16-reduce unpatched", None, "bf16-reduce", "deferred", "mixed"))
    if framework == "llamafactory" and family in WITHOUT_LF_LOOKUP:
        cases.append(("bf16 without lookup", [WITHOUT_LF_LOOKUP[family]], "bf16", "deferred", "mixed"))
    # The failing runs last: a crashed backward leaves nothing behind for the next case, but why risk it.
    return cases + [("guard only", guard, "bf16", "deferred", "mixed"),
                    ("unpatched", unpatched, "bf16", "deferred", "mixed")]


_RESULTS = {}


def _framework_results(framework, family):
    key = (framework, family)
    if key not in _RESULTS:
        pairs = PAIRS + ([("bf16-reduce deferred", "bf16-reduce every")] if framework == ACCELERATE else [])
        _RESULTS[key] = run_ranks(accum_jobs.accumulation_cases, 2, framework, family, _cases(framework, family),
                                  pairs)
    return _RESULTS[key]


def _framework_params():
    out = []
    wrappers = [(i.dist, None if guards.installed_version(i.dist) else "%s not in this pinned set" % i.dist)
                for i in integrations.wrapping()]
    # accelerate is in most sets (a peft dependency); its FSDP2 path is proven where TRL, its user, is.
    wrappers.append((ACCELERATE, None if TRL else "trl not in this pinned set (accelerate's FSDP2 preparation "
                     "is proven as TRL's trainers use it)"))
    for framework, missing in wrappers:
        for family in FAMILIES:
            # one run serves them all; tiny.wrappable (it builds the model) is decided at setup, not collection
            marks = [pytest.mark.xdist_group("accum-%s-%s" % (framework, family)), pytest.mark.wrappable(family)]
            if missing:
                marks.append(pytest.mark.skip(reason=missing))
            out.append(pytest.param(framework, family, marks=marks, id="%s-%s" % (framework, family)))
    return out


FRAMEWORK_FAMILIES = _framework_params()


LAYERNORM_ERROR = "RuntimeError: mixed dtype (CPU): expect parameter to have scalar type of Float"


@pytest.mark.parametrize("framework,family", FRAMEWORK_FAMILIES)
def test_unpatched_text_only_deferred_micro_batch_crashes_on_the_vision_tower(framework, family):
    results = _framework_results(framework, family)
    for r in results:
        assert r["unpatched"]["error"] == "step 0: " + ATTRIBUTE_ERROR, r["unpatched"]["error"]
        # the trigger: after the text-only micro-batch no unit of the vision tower was ever all-gathered
        # (seen with the guard alone: the family patch's mixed-ranks targets run a dummy vision forward on
        # every rank's text-only micro-batch, so there the tower is gathered: tests/integrations/test_mixed_ranks.py)
        vision_units = [u for u in r["bf16 deferred"]["wrapped"] if u.startswith("model.visual.")]
        assert vision_units and r["guard only"]["never_gathered_after_first"] == vision_units, r["guard only"]
        assert r["bf16 deferred"]["never_gathered_after_first"] == [], r["bf16 deferred"]


@pytest.mark.parametrize("framework,family", FRAMEWORK_FAMILIES)
def test_the_guard_alone_meets_the_mixed_dtype_assertion_in_the_root_unit(framework, family):
    for r in _framework_results(framework, family):
        error = r["guard only"]["error"]
        assert error is not None and error.startswith("step 0: ") and MIXED_DTYPES.match(error[8:]), error


@pytest.mark.parametrize("framework,family", FRAMEWORK_FAMILIES)
@pytest.mark.parametrize("sync", ["deferred", "every"])
@pytest.mark.parametrize("policy", ["bf16", "fp32"])
def test_patched_mixed_micro_batches_match_the_dp_average(framework, family, policy, sync):
    results = _framework_results(framework, family)
    for rank, r in enumerate(results):
        _close(r["%s %s" % (policy, sync)], policy, "%s %s %s %s rank %d" % (framework, family, policy, sync, rank))
    # (fp32 losses: bf16 ones may round to the same value on both ranks)
    assert results[0]["fp32 deferred"]["losses"] != results[1]["fp32 deferred"]["losses"], "same data on both ranks"


@pytest.mark.parametrize("framework,family", FRAMEWORK_FAMILIES)
def test_deferred_sync_reduces_what_sync_on_every_micro_batch_reduces(framework, family):
    for r in _framework_results(framework, family):
        for a, b in PAIRS:
            assert r["%s vs %s" % (a, b)] < 1e-6, (a, b, r["%s vs %s" % (a, b)])


@pytest.mark.parametrize("framework,family", [p for p in FRAMEWORK_FAMILIES
                                              if p.values[0] == "llamafactory" and p.values[1] in WITHOUT_LF_LOOKUP])
def test_llamafactory_bf16_needs_the_layer_class_lookup_fix_the_family_patch_carries(framework, family):
    """Not an accumulation bug.  LLaMA-Factory 0.9.5 looks its one layer class up in ``_no_split_modules``,
    a set on transformers 5.x that it cannot read: without the lookup target the vision blocks stay in
    the root unit, whose bf16 forward hands their LayerNorm the fp32 output of the vision ``pos_embed``
    unit, and the first image forward fails, deferred sync or not.  The user's patch carries the target:
    with it the vision blocks get their units and bf16 trains (the tests above)."""
    from fsdp2_compat.integrations import llamafactory

    assert llamafactory.LAYER_CLASS_LOOKUP in registry.patch(USER_PATCH[family]).targets
    if not guards.in_range(guards.installed_version("transformers"), ">=5.0.0rc0"):
        pytest.skip("transformers %s keeps _no_split_modules a list: LLaMA-Factory finds its layer class as released"
                    % guards.installed_version("transformers"))
    for r in _framework_results(framework, family):
        assert any(u.startswith("model.visual.blocks.") for u in r["bf16 deferred"]["wrapped"]), r["bf16 deferred"]
        without = r["bf16 without lookup"]
        assert not any(".blocks." in u or ".layers." in u for u in without["wrapped"]), without["wrapped"]
        assert without["error"] == "step 0: " + LAYERNORM_ERROR, without["error"]


@pytest.mark.parametrize("framework,family", [p for p in FRAMEWORK_FAMILIES if p.values[0] == ACCELERATE])
def test_accelerate_bf16_reduces_in_bf16_so_unpatched_deferred_sync_already_matches_the_dp_average(framework, family):
    """accelerate derives ``MixedPrecisionPolicy(bf16, bf16)`` from ``mixed_precision="bf16"`` (transformers'
    Trainer passes no other): torch clamps an equal reduce dtype to None, so ``to_accumulated_grad_if_needed``
    returns before it reads ``_unsharded_param`` and every gradient is bf16.  The deferred micro-batches then
    accumulate in bf16, which sync on every micro-batch does not: the two agree only to bf16 rounding."""
    for rank, r in enumerate(_framework_results(framework, family)):
        unpatched = r["bf16-reduce unpatched"]
        assert unpatched["policies"] == [["torch.bfloat16", "torch.bfloat16"]], unpatched["policies"]
        assert r["bf16 deferred"]["policies"] == [["torch.bfloat16", "torch.float32"]], r["bf16 deferred"]["policies"]
        # the same trigger as under the crashing policy (with the guard alone: no mixed-ranks dummy there)
        assert unpatched["never_gathered_after_first"] == r["guard only"]["never_gathered_after_first"], unpatched
        for case in ("bf16-reduce unpatched", "bf16-reduce deferred", "bf16-reduce every"):
            _close(r[case], "bf16", "%s %s rank %d" % (family, case, rank))
        assert 0 < r["bf16-reduce deferred vs bf16-reduce every"] < BF16_GRAD, r["bf16-reduce deferred vs bf16-reduce every"]


# ---------------------------------------------------------------------------
# verl issue #7520: fused kernels, untied lm_head in its own unit, deferred sync

VERL = guards.installed_version("verl")


def _fused_param(family, patch, steps, needs):
    reason = None
    if VERL is None or not guards.in_range(VERL, needs):
        reason = "needs verl %s (its %s fused forward)" % (needs, family)
    else:
        from fsdp2_compat_harness import tiny

        if family == "qwen3_5" and not tiny.exports("Qwen3_5ForConditionalGeneration"):
            reason = "transformers %s has no Qwen3_5ForConditionalGeneration" % guards.installed_version("transformers")
        elif family != "qwen3_5" and tiny.unavailable(family) is not None:
            reason = str(tiny.unavailable(family))
    marks = [pytest.mark.xdist_group("accum-fused-%s" % family)]
    if reason:
        marks.append(pytest.mark.skip(reason=reason))
    return pytest.param(family, patch, steps, marks=marks, id=family)


FUSED = [
    _fused_param("qwen3_5", "qwen35", "text", ">=0.8.0"),  # verl issue #7520 itself (plain full_tensor())
    _fused_param("qwen3_vl", "qwen3vl", "mixed", ">=0.6.0"),
    _fused_param("qwen2", "textlm", "text", ">=0.4.1"),  # a text model (dense_common)
]
_FUSED_RESULTS = {}


def _fused_results(family, patch, steps):
    if family not in _FUSED_RESULTS:
        cases = [("bf16", [patch], "bf16", "deferred", steps), ("fp32", [patch], "fp32", "deferred", steps)]
        if family == "qwen3_5":
            cases += [("guard only", ["t-guard"], "bf16", "deferred", steps),
                      ("unpatched", None, "bf16", "deferred", steps)]
        _FUSED_RESULTS[family] = run_ranks(accum_jobs.accumulation_cases, 2, "verl", family, cases,
                                           kwargs={"fused": True})
    return _FUSED_RESULTS[family]


@pytest.mark.depends_on("torch", "transformers", "verl")
@pytest.mark.parametrize("family,patch,steps", FUSED)
def test_issue_7520_setup_trains_every_gradient_to_the_dp_average_through_the_lm_head_patch(family, patch, steps):
    results = _fused_results(family, patch, steps)
    for rank, r in enumerate(results):
        for policy in ("bf16", "fp32"):
            where = "%s %s rank %d" % (family, policy, rank)
            _close(r[policy], policy, where)  # no AttributeError, and the DP average
            if policy == "fp32":
                assert r[policy]["lm_head_grad_err"] < TOL, (where, r[policy]["lm_head_grad_err"])
            if guards.in_range(VERL, ">=0.7.1"):  # lm_head is its own unit: #7520's setup
                assert "lm_head" in r[policy]["wrapped"], r[policy]["wrapped"]
    assert results[0]["fp32"]["losses"] != results[1]["fp32"]["losses"], "same data on both ranks"


@pytest.mark.depends_on("torch", "transformers", "verl")
@pytest.mark.parametrize("family,patch,steps", FUSED[:1])
def test_issue_7520_unpatched_crashes_and_the_guard_alone_leaves_lm_head_unaveraged(family, patch, steps):
    for r in _fused_results(family, patch, steps):
        assert r["unpatched"]["error"] == "step 0: " + ATTRIBUTE_ERROR, r["unpatched"]["error"]
        guard = r["guard only"]
        # verl's full_tensor() read never all-gathers the lm_head unit...
        assert guard["error"] is None and guard["never_gathered_after_first"] == ["lm_head"], guard
        # ...so with the crash guarded away each rank keeps its own lm_head gradient
        assert guard["lm_head_grad_err"] > 1e-2 and guard["worst_rel_to_max"] == "lm_head.weight", guard
        assert guard["grad_rel_to_max"] > 0.5, guard["grad_rel_to_max"]
