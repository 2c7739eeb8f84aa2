"""Mixed text/image ranks (issue #20) on the families ``test_mixed_ranks.py`` does not run: real FSDP2, 2 CPU gloo ranks.

``test_mixed_ranks.py`` proves the fix per framework on Qwen2.5-VL, Qwen3-VL,
GLM-4.1V and Qwen3.5.  This module proves it per transformers release on the
other families the fix wraps (GLM-4.5V ``glm4v_moe``, GLM-4.6V ``glm46v``,
Qwen3-VL-MoE ``qwen3_vl_moe``, LFM2-VL, PaddleOCR-VL, and the audio towers of
Qwen2-Audio, Voxtral and AudioFlamingo3, HunYuan-VL, Cosmos-3 Edge and Step-3.7 (transformers
5.13+ / 5.15+ / 5.16+), and Chameleon's VQ encoder, from ``tooling.tiny``; Qwen2-VL and Qwen3.5-MoE from
the test-only builders of ``accum_jobs.TEST_ONLY``): their forwards are
separate targets with fingerprints of their own, and most of their towers have
adapters of their own (``fixes.media_towers``).  Its outcome
depends on torch and transformers only, so the sharding is one generic
per-layer-class ``fully_shard`` (``FRAMEWORK``: the first installed framework
of ``mixed_jobs.PREFERRED``, whose own ``apply_fsdp2`` / ``parallelize_model`` gives every
``_no_split_modules`` class a unit; accelerate's FSDP2 preparation where only
TRL is installed).

One pair of rank processes runs everything (``mixed_jobs.patched_then_unpatched``):
every family patched (rank 0 image / rank 1 text-only, then the reverse, sync
on every micro-batch; and two micro-batches per rank, image and text-only,
with the first one's sync deferred, in fp32 and with bf16 parameters; each
gradient against the unsharded reference trained on the data-parallel
average), then one family unpatched (its patch without the mixed-ranks
targets), which gloo aborts with its collective-mismatch message under a 20 s
process-group timeout: the abort ends the process, so the unpatched case runs
last and once (the mechanism is the same for every family; the per-family
claim is the patched one, and ``test_mixed_ranks.py`` shows the abort per
framework).

A tower that differs from what its family's entry relies on (``CANNOT_SERVE``)
is checked here too: the fix says why it leaves it alone
(``mixed_media.unknown_tower``).
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")

from fsdp2_compat import registry  # noqa: E402
from support import accum_jobs, mixed_jobs, walk_jobs  # noqa: E402

DEPENDS_ON = ("torch", "transformers")

PG_TIMEOUT = 20
# rank 0 image / rank 1 text-only, then the reverse, then again: a rank's first text-only micro-batch records its
# dummy, the next one is walked (fixes.unit_walk) beside the other rank's image
STEPS = ((("image",), ("text",)), (("text",), ("image",)), (("image",), ("text",)))
# two micro-batches per rank, the first one's sync deferred; each rank walks in the second step
ACCUM_STEPS = ((("image", "text"), ("text", "image")), (("text", "image"), ("image", "text")))
# Sync on every micro-batch, and deferred (fp32 exact; bf16 parameters within bf16 tolerance): test_mixed_ranks' cases;
# and with transformers' reentrant gradient checkpointing, where a unit the dummy calls twice reduces at each call
# (Step-3.7, DeepSeek-OCR-2: the walk's own zeros, unit_walk).
PATCHED_CASES = ("fp32 every", "fp32 deferred", "bf16 deferred", "fp32 every reentrant")
# Under reentrant checkpointing some releases' records cannot be walked: the real dummy runs every time
# (walk_jobs.KEEPS_THE_DUMMY, one table with tests/fixes/test_unit_walk.py); where FSDP2 itself leaves the
# gradients unreduced (walk_jobs.UPSTREAM: DeepSeek-OCR-2 on 5.10.4 / 5.16.1, 0.031 off with every rank on
# images) there is no claim.
# Mixture-of-experts families: bf16 parameters may route a token to other experts than the fp32 reference
# does, and that expert's whole gradient then differs (GLM-4.5V: 0.26 of max on one expert, transformers
# 5.24.0).  Not a property of the fix: their claim is the exact fp32 one.
MOE = ("glm4v_moe", "qwen3_vl_moe", "qwen3_5_moe", "step3p7")
# Chameleon turns an image into codebook ids (a nearest-code choice, discrete like routing): in bf16 a patch may
# take another code than in the fp32 reference, and the text layers then see other tokens (skyrl040, 5.16.1:
# 0.17 of max on a k_norm bias).  Its claim is the exact fp32 one too.
# GLM-Image's codes are discrete too: they matched the fp32 reference's in bf16 over one step (5.10.4, 5.16.1, 5.24.0),
# not over two on 5.8.0 (0.018 on a text v_proj bias, the walk off or on: the same figure).
DISCRETE = MOE + ("chameleon", "glm_image")
# Step-3.7 and DeepSeek-OCR-2 run their tower twice with local crops: every micro-batch without crops runs a dummy
# (media_towers.pad), so each rank's image micro-batch runs one too.  Crops against an image without: CROPS_STEPS.
# Their text-only dummy calls a vision unit twice (view, crop); walked like every other (unit_walk), and so is
# their crop-only dummy.
PADDED = ("step3p7", "deepseek_ocr2")
CROPS_STEPS = ((("image+crops",), ("text",)), (("image",), ("image+crops",)))
MISMATCH = "Received data size doesn't match expected size. Is there a distributed collective mismatch"
FAMILIES = ("glm4v_moe", "glm46v", "qwen3_vl_moe", "qwen2_vl", "qwen3_5_moe", "lfm2_vl", "paddleocr_vl", "qwen2_audio",
            "voxtral", "audioflamingo3", "hunyuan_vl", "cosmos3_edge", "step3p7", "chameleon", "deepseek_ocr2", "glm_image")
# Built by the tests only (accum_jobs.TEST_ONLY): the transformers class each needs.
TEST_ONLY_CLASS = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
TOWER = {"step3p7": "vision_model", "deepseek_ocr2": "vision_tower", "chameleon": "vqmodel", "lfm2_vl": "vision_tower", "hunyuan_vl": "vision_tower", "qwen2_audio": "audio_tower", "voxtral": "audio_tower", "audioflamingo3": "audio_tower"}  # the tower's attribute on the base model where it is not `visual`
# No vision layer class in _no_split_modules: the tower is in the root unit, whose reduce-scatter is shorter
# on a text-only rank unpatched (its vision parameters have no gradient).
ROOT_UNIT_TOWERS = ("paddleocr_vl",)
# Chameleon's VQ encoder classes are in its VQ model's own _no_split_modules: they get units of their own in some
# pinned sets (SkyRL 0.4.0 / transformers 5.16.1, verl 0.9.1 / 5.10.4), the root unit in others (verl 0.7.0 /
# 4.57.6, verl 0.8.0 / 5.0.0rc3, LLaMA-Factory / 5.3.0), where no rank skips a collective.  Both layouts are
# valid: there the claim is the gradients, not where the units are.
EITHER_LAYOUT = ("chameleon",)
UNPATCHED_FAMILY = "glm4v_moe"
# Towers the fix cannot serve, made from a known family's tiny model: {family: (what is changed, the fix's reason)}.
# GLM-Image's one tokenizer call per micro-batch relies on a 1x1 quant_conv (fixes.vq_tokens).
CANNOT_SERVE = {
    "glm_image": ("a 3x3 quant_conv", "its vqmodel has no 1x1 quant_conv and encode (one tokenizer call per "
                                      "micro-batch needs both)"),
}


FRAMEWORK, NO_FRAMEWORK = mixed_jobs.generic_framework()


def _runnable():
    """``{family: None or the reason it cannot run here}``."""
    from fsdp2_compat_harness import tiny

    out = {}
    for family in FAMILIES:
        reason = NO_FRAMEWORK
        if reason is None and family in TEST_ONLY_CLASS:
            import transformers

            if not hasattr(transformers, TEST_ONLY_CLASS[family]):
                reason = "transformers %s has no %s" % (transformers.__version__, TEST_ONLY_CLASS[family])
        elif reason is None and tiny.unwrappable(family) is not None:
            reason = str(tiny.unwrappable(family))
        if reason is None:
            reason = mixed_jobs.cannot_wrap(FRAMEWORK, family)
        out[family] = reason
    return out


_RESULTS = {}


def _why_not(family=None):
    """Why ``family`` (None: every family) cannot run here, or None; decided once, at the first test's setup
    (building every family to decide costs seconds in each worker, and most sets deselect this module)."""
    if "runnable" not in _RESULTS:
        _RESULTS["runnable"] = _runnable()
    runnable = _RESULTS["runnable"]
    if family is not None:
        return runnable[family]
    if all(runnable.values()):
        return "no family runs here: %s" % "; ".join(sorted(set(str(why) for why in runnable.values())))
    return None


def _run():
    """``(patched {family: [rank results]}, unpatched [(outcome, stderr)] per rank)``, from one pair of ranks."""
    if "run" not in _RESULTS:
        families = [f for f in FAMILIES if _why_not(f) is None]
        unpatched = (UNPATCHED_FAMILY if UNPATCHED_FAMILY in families else families[0],
                     ("unpatched", "user-without-mixed", "fp32", "every", STEPS))
        cases = [(name, "user", name.split()[0], name.split()[1], _steps(name), *name.split()[2:])
                 for name in PATCHED_CASES]
        patched, ranks = mixed_jobs.run_patched_then_unpatched(FRAMEWORK, families, cases, unpatched, PG_TIMEOUT,
                                                               "mixed_families_")
        _RESULTS["run"] = (patched, unpatched[0], ranks)
    return _RESULTS["run"]


def _steps(case):
    return STEPS if case.split()[1] == "every" else ACCUM_STEPS


def _expected(case, what, family=None):
    """Per rank: the dummies ``case`` runs (one per text-only micro-batch; a padded family's image micro-batch
    runs its crop dummy too), or the walks (each dummy kind's later runs)."""
    out = []
    for rank in range(2):
        kinds = [k for step in _steps(case) for k in accum_jobs.rank_kinds(step, rank)]
        texts, images = kinds.count("text"), kinds.count("image")
        if what == "dummies":
            out.append(texts + (images if family in PADDED else 0))
        else:
            out.append(max(texts - 1, 0) + (max(images - 1, 0) if family in PADDED else 0))
    return out


@pytest.mark.parametrize("case", PATCHED_CASES)
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.xdist_group("mixed-families"), id=f)
                                    for f in FAMILIES])
def test_patched_mixed_ranks_train_to_the_dp_average(family, case):
    if _why_not(family):
        pytest.skip(str(_why_not(family)))
    if family in DISCRETE and case.startswith("bf16"):
        pytest.skip("a discrete choice (MoE routing, VQ codes) in bf16 differs from the fp32 reference's (see MOE, "
                    "DISCRETE); the fp32 cases are exact")
    patched, _, _ = _run()
    results = patched[family]
    kept = any(r[case].get("unwalkable") for r in results)
    if kept:
        assert case.endswith("reentrant") and (family, "reentrant") in walk_jobs.KEEPS_THE_DUMMY, (
            family, case, results)
        if walk_jobs.UPSTREAM in walk_jobs.KEEPS_THE_DUMMY[(family, "reentrant")]:
            pytest.skip(walk_jobs.UPSTREAM_SKIP)
    for rank, r in enumerate(results):
        accum_jobs.assert_close(r[case], case.split()[0], "%s %s %s rank %d" % (FRAMEWORK, family, case, rank))
    # one dummy vision forward per text-only micro-batch, never on an image micro-batch (so the fix found the
    # tower FSDP2-managed: units of its own, or PaddleOCR-VL's root unit around it); the first of each kind
    # records, the later ones walk
    assert [r[case]["dummy_forwards"] for r in results] == _expected(case, "dummies", family), results
    assert [r[case]["walks"] for r in results] == (
        [0, 0] if kept else _expected(case, "walks", family)), results
    if family == "glm_image":  # one tokenizer call per micro-batch: the dummy's (none when walked), and the two
        # source images' merged
        micro_batches = [sum(len(accum_jobs.rank_kinds(step, rank)) for step in _steps(case)) for rank in range(2)]
        assert [r[case]["vq_encodes"] for r in results] == [
            n - r[case]["walks"] for n, r in zip(micro_batches, results)], results
    if case.startswith("fp32"):  # (bf16 losses may round to the same value on both ranks)
        assert results[0][case]["losses"] != results[1][case]["losses"], "same data on both ranks"
    tower = ".%s." % TOWER.get(family, "visual")  # (Voxtral before 5.10.0: on the outer model, no ``model.``)
    own_units = any(tower in ".%s." % name for name in results[0]["fp32 every"]["wrapped"])
    if family not in EITHER_LAYOUT:
        assert own_units == (family not in ROOT_UNIT_TOWERS), results[0]["fp32 every"]["wrapped"]


@pytest.mark.xdist_group("mixed-families")
def test_unpatched_a_text_only_rank_breaks_the_vision_units_collectives():
    if _why_not():
        pytest.skip(_why_not())
    _, family, ranks = _run()
    assert any(MISMATCH in outcome or MISMATCH in stderr for outcome, stderr in ranks), (family, ranks)
    assert not any(outcome is None for outcome, _ in ranks), (family, ranks)  # no rank trained through it


@pytest.mark.parametrize("family", sorted(CANNOT_SERVE))
def test_a_tower_the_fix_cannot_serve_is_left_alone_and_the_fix_says_why(family):
    """A model whose tower differs from what the family's entry relies on: the fix's own check names why (what
    its warning says when the wrapped forward meets it: the forward is then left alone), and the unchanged
    model passes the same check."""
    import torch

    from fsdp2_compat.fixes import mixed_media
    from fsdp2_compat_harness import tiny

    if tiny.unavailable(family) is not None:
        pytest.skip(str(tiny.unavailable(family)))
    model = tiny.quiet(tiny.build, family)
    base = model.model
    assert mixed_media.unknown_tower(base) is None
    conv = base.vqmodel.quant_conv
    base.vqmodel.quant_conv = torch.nn.Conv2d(conv.in_channels, conv.out_channels, 3, padding=1)
    assert mixed_media.unknown_tower(base) == CANNOT_SERVE[family][1], CANNOT_SERVE[family][0]



@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.xdist_group("mixed-families"), id=f)
                                    for f in PADDED])
def test_local_crops_on_one_rank_and_none_on_another_train_to_the_dp_average(family):
    """Step-3.7's and DeepSeek-OCR-2's forwards run the tower again for local crops: a rank with crops beside
    one without (or text only) issues more collectives.  Patched, the rank without crops runs the crop call on
    a dummy, and both steps match the DP reference; unpatched (without the mixed-ranks target), gloo aborts the
    crops step."""
    if _why_not(family):
        pytest.skip(str(_why_not(family)))
    cases = [("fp32 crops", "user", "fp32", "every", CROPS_STEPS)]
    unpatched = (family, ("unpatched", "user-without-mixed", "fp32", "every", CROPS_STEPS[1:]))
    patched, ranks = mixed_jobs.run_patched_then_unpatched(FRAMEWORK, [family], cases, unpatched, PG_TIMEOUT,
                                                           "mixed_crops_%s_" % family)
    results = [r["fp32 crops"] for r in patched[family]]
    for rank, r in enumerate(results):
        accum_jobs.assert_close(r, "fp32", "%s %s crops rank %d" % (FRAMEWORK, family, rank))
    # rank 0: its image without crops (step 1) pads; rank 1: its text-only micro-batch (step 0)
    assert [r["dummy_forwards"] for r in results] == [1, 1], results
    assert [r["walks"] for r in results] == [0, 0], results  # (each rank's first dummy of its kind: recorded)
    assert any(MISMATCH in outcome or MISMATCH in stderr for outcome, stderr in ranks), ranks
    assert not any(outcome is None for outcome, _ in ranks), ranks
