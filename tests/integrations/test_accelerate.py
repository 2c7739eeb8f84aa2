"""accelerate's FSDP2 tail unit: the bugs and the fix, through the code users run, on real FSDP2.

The real ``Accelerator.prepare`` (accelerate's ``fsdp2_prepare_model``), the
real ``transformers.Trainer`` with ``TrainingArguments.fsdp`` (FSDP2) and the
real TRL ``SFTTrainer.train()``, on two CPU gloo ranks with different data,
against an unsharded reference trained on the data-parallel average (fp32,
1e-5).  The one stand-in is ``trl_scenarios.cpu_fsdp``: accelerate selects
FSDP only for GPU-like devices, so on CPU the test sets the distributed type
to FSDP exactly as accelerate's GPU branch does.

What each accelerate release does (unpatched), per model:
- tied embeddings: 1.14.0 ``ValueError: Parameter '...embed_tokens.weight'
  is shared with a parameter already managed by another FSDP group`` at the
  first forward, and the tie is broken by preparation; 1.15.0 is right;
- untied VLM (Qwen2.5-VL, Qwen3-VL), a loss reading ``self.lm_head.weight``
  inside the forward (Liger-Kernel style): ``aten.mm.default got mixed
  torch.Tensor and DTensor``; read with ``full_tensor()``: the ``lm_head``
  gradient is one rank's, not the average;
- untied text model (Qwen2): right (its tail unit holds the final norm).
Patched (the family's patch), every case trains exactly and a tie survives
preparation (``embed.weight is lm_head.weight``).
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models, Trainer)")
pytest.importorskip("accelerate", reason="needs accelerate (the code under test)")
pytest.importorskip("datasets", reason="needs datasets (the Trainer's dataset)")

from fsdp2_compat import registry  # noqa: E402
from fsdp2_compat.core import engine, guards, policy  # noqa: E402
from fsdp2_compat.integrations import accelerate as acc_integration  # noqa: E402
from fsdp2_compat_harness.ranks import run_ranks  # noqa: E402
from fsdp2_compat_harness import accelerate_scenarios  # noqa: E402
from support import accelerate_jobs  # noqa: E402

DEPENDS_ON = ("torch", "transformers", "accelerate", "trl")

ACCELERATE = guards.installed_version("accelerate")
TRL = guards.installed_version("trl")
pytestmark = [
    pytest.mark.skipif(not guards.in_range(ACCELERATE, ">=1.14.0,<=1.15.0"),
                       reason="accelerate %s: the tail unit is 1.14.0+, the targets' proven range 1.14.0-1.15.0"
                       % ACCELERATE),
    pytest.mark.xdist_group("accelerate"),  # one forkserver serves the module
]

TOL = 1e-5
TIED_BROKEN = guards.in_range(ACCELERATE, "==1.14.0")  # 1.15.0 carries the tied fix (PR #4171)
SHARED = "is shared with a parameter already managed by another FSDP group"
MIXED = "aten.mm.default got mixed torch.Tensor and DTensor"
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen2")
VLMS = FAMILIES[:2]
PATCH = {f: registry.for_model_type(f).name for f in FAMILIES}  # qwen2vl, qwen3vl, textlm
# The accelerate targets alone (no TRL reader target): what the grouping fix does by itself.
GROUPING_ONLY = [t.key for t in acc_integration.TARGETS]
CASES = [(f, tie, read, patch) for f in FAMILIES for tie in (False, True)
         for read, patch in (("raw", None), ("raw", PATCH[f]))]
CASES += [(f, False, "full_tensor", p) for f in VLMS for p in (None, PATCH[f])]


@pytest.fixture(scope="module")
def reader():
    """Every Liger-style reader case on one rank pair: ``{case: [rank 0 result, rank 1 result]}``."""
    results = run_ranks(accelerate_scenarios.reader_cases, 2, CASES, timeout=400)
    return {case: [results[0][i], results[1][i]] for i, case in enumerate(CASES)}


def _exact(results, tie):
    for rank, r in enumerate(results):
        assert r["error"] is None, "rank %d: %s" % (rank, r["error"])
        assert r["loss_err"] < TOL and r["param_err"] < TOL, (rank, r["loss_err"], r["param_err"])
        assert r["grad_err"] < TOL, "rank %d worst gradient %s: %.2e" % (rank, r["worst_grad"], r["grad_err"])
        assert r["lm_head_grad_err"] < TOL and r["lm_head_rel_to_max"] < TOL, r
        assert r["grads_checked"] > 10
        assert r["tied"] is tie, r  # a tie survives preparation (and nothing ties an untied model)
        assert r["fully_shard_restored"], r  # torch.distributed.fsdp.fully_shard is torch's again
    assert results[0]["losses"] != results[1]["losses"], "same data on both ranks"


def _print(case, results):
    r = results[0]
    print("accelerate %s %s tie=%s read=%s patch=%s: error=%s lm_head max|a-b|/max|b|=%s worst grad %s %.3g; "
          "head unit %s" % (ACCELERATE, case[0], case[1], case[2], case[3], r["error"],
                            ", ".join("%.3g" % x["lm_head_rel_to_max"] for x in results), r["worst_grad"],
                            r["grad_err"], r["head_unit"]))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_unpatched_liger_style_reader(reader, family, tie):
    case = (family, tie, "raw", None)
    results = reader[case]
    _print(case, results)
    if tie and TIED_BROKEN:
        for r in results:
            assert r["error"].startswith("step 0: ValueError: Parameter ") and SHARED in r["error"], r["error"]
            assert r["tied"] is False and "lm_head" not in r["head_unit"], r  # the head stayed in the root unit
    elif family in VLMS and not tie:
        for r in results:
            assert r["error"] == "step 0: RuntimeError: %s, need to convert all torch.Tensor to DTensor before " \
                                 "calling distributed operators!" % MIXED, r["error"]
            assert r["head_unit"] == ["lm_head"], r["head_unit"]  # the head alone: no norm found
    else:  # text model untied, or any tied model on 1.15.0: upstream is right
        _exact(results, tie)


@pytest.mark.parametrize("family", VLMS)
def test_unpatched_full_tensor_reader_trains_lm_head_on_one_rank(reader, family):
    case = (family, False, "full_tensor", None)
    results = reader[case]
    _print(case, results)
    for r in results:
        assert r["error"] is None and r["worst_grad"] == "lm_head.weight", r
        assert r["lm_head_rel_to_max"] > 0.1 and r["lm_head_grad_err"] > 1e-3, r  # measured 0.97-0.99 of max


PATCHED = [c for c in CASES if c[3] is not None]


@pytest.mark.parametrize("case", PATCHED, ids=["%s-%s-%s" % (f, "tied" if t else "untied", r) for f, t, r, _ in PATCHED])
def test_patched_every_gradient_matches_the_dp_average(reader, case):
    family, tie, read, _ = case
    results = reader[case]
    _print(case, results)
    _exact(results, tie)
    text = "model.norm" if family == "qwen2" else "model.language_model.norm"
    embed = text.replace("norm", "embed_tokens")
    # The unit 1.15.0 builds for tied weights, and a text model's unit for untied ones.
    assert results[0]["head_unit"] == sorted(["lm_head", text] + ([embed] if tie else [])), results[0]["head_unit"]


TRAINER_CASES = [("qwen2_5_vl", False, "raw"), ("qwen2", True, None)]


# transformers 4.57's Trainer builds accelerate's FSDP plugin in its constructor, whose __post_init__ asks for an
# accelerator device ("RuntimeError: There are currently no available devices found, must be one of 'XPU',
# 'CUDA', ...", seen with accelerate 1.15.0 in the tf4 set): that path cannot run on a CPU.
TRAINER_ON_CPU = guards.in_range(guards.installed_version("transformers") or "0", ">=5.0.0rc0")


@pytest.mark.skipif(not TRAINER_ON_CPU, reason="transformers < 5's Trainer asks accelerate's FSDP plugin for a GPU-like "
                                               "device at construction (no available devices on CPU)")
@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
@pytest.mark.parametrize("family,tie,read", TRAINER_CASES, ids=["qwen2_5_vl-untied-liger", "qwen2-tied-plain"])
def test_hf_trainer_one_step(family, tie, read, patched):
    """One step of ``transformers.Trainer`` (FSDP2 from ``TrainingArguments.fsdp``), parameters vs the reference."""
    results = run_ranks(accelerate_jobs.trainer_step, 2, family, tie, read, PATCH[family] if patched else None)
    r = results[0]
    print("Trainer accelerate %s %s tie=%s read=%s %s: error=%s param_err=%s lm_head step err=%s" % (
        ACCELERATE, family, tie, read, "patched" if patched else "unpatched", r["error"], r.get("param_err"),
        r.get("lm_head_step_err")))
    assert all(x["distributed_type"] == "DistributedType.FSDP" for x in results)
    broken = (tie and TIED_BROKEN) or (read == "raw" and not tie and family in VLMS)
    if not patched and broken:
        for x in results:
            assert x["error"] is not None and (SHARED if tie else MIXED) in x["error"], x["error"]
        return
    for rank, x in enumerate(results):
        assert x["error"] is None, (rank, x["error"])
        assert x["tied"] is tie
        assert x["param_err"] < TOL, (rank, x["worst_param"], x["param_err"])
        if not tie:
            assert x["lm_head_param_err"] < TOL and x["lm_head_step_err"] < 1e-4, x
    assert results[0]["rank_batches"][0] != results[0]["rank_batches"][1], "same data on both ranks"


@pytest.mark.skipif(not guards.in_range(TRL or "0", ">=1.16.0"), reason="trl %s: the SFT fused head runs on CPU "
                    "from 1.16.0" % TRL)
@pytest.mark.parametrize("patches", [None, GROUPING_ONLY], ids=["unpatched", "accelerate-targets-only"])
def test_trl_sft_train_step_untied_vlm_with_the_grouping_fixed(patches):
    """TRL's ``SFTTrainer.train()``: the accelerate targets alone make TRL's fused-head read exact (no TRL target)."""
    from support import trl_jobs

    results = run_ranks(trl_jobs.sft_train_step, 2, "qwen2_5_vl", patches)
    for rank, r in enumerate(results):
        print("SFTTrainer.train() accelerate %s trl %s qwen2_5_vl %s: lm_head step off by %.3g of the step, "
              "other params %.2e" % (ACCELERATE, TRL, "grouping fixed" if patches else "unpatched",
                                     r["lm_head_step_err"], r["param_err"]))
        assert r["distributed_type"] == "DistributedType.FSDP"
        assert r["param_err"] < TOL, (rank, r["worst_param"], r["param_err"])
        if patches is None:
            assert r["lm_head_step_err"] > 0.3, r  # TRL's full_tensor(): each rank's own gradient
        else:
            assert r["lm_head_param_err"] < TOL and r["lm_head_step_err"] < 1e-4, r
    assert results[0]["rank_batches"][0] != results[0]["rank_batches"][1], "same data on both ranks"


def test_vlm_and_text_patches_carry_the_accelerate_targets():
    for name in ("qwen2vl", "qwen3vl", "qwen35", "glm4v", "lfm2vl", "paddleocrvl"):
        assert set(acc_integration.TARGETS) <= set(registry.patch(name).targets), name
    textlm = set(registry.patch("textlm").targets)
    assert acc_integration.TIED_TAIL in textlm and acc_integration.VLM_FINAL_NORM not in textlm


def test_installed_release_is_classified_by_its_code():
    """The gate on the installed accelerate: fingerprinted code, or the catalogue's reason."""
    import accelerate.utils.fsdp_utils as fsdp_utils

    for target in acc_integration.TARGETS:
        label, fp = policy.code_label(target, fsdp_utils, engine.lookup)
        if target.fixed_in and guards.in_range(ACCELERATE, target.fixed_in):
            assert label is None, (target.key, label)  # 1.15.0's fsdp2_prepare_model is other code: fixed there
        else:
            assert label is not None and guards.in_range(ACCELERATE, target.versions), (target.key, fp)


def test_seams_apply_rebind_callers_and_revert(warm_python):
    """Outcomes on the installed accelerate, the by-name callers rebound, torch's fully_shard untouched after."""
    proc = warm_python(
        """
        import json
        import accelerate.accelerator as accel, accelerate.utils as utils, accelerate.utils.fsdp_utils as fu
        import torch.distributed.fsdp as fsdp
        import fsdp2_compat
        from fsdp2_compat.core import engine
        originals = (fu.fsdp2_prepare_model, fu._find_final_norm, fsdp.fully_shard)
        fsdp2_compat.apply("qwen2vl")
        rows = {r["attr"]: r["outcome"] for r in fsdp2_compat.status() if r["dist"] == "accelerate"}
        report = {
            "rows": rows,
            "norm_ours": engine.is_ours(fu._find_final_norm),
            "prepare_ours": engine.is_ours(fu.fsdp2_prepare_model),
            "callers": accel.fsdp2_prepare_model is fu.fsdp2_prepare_model is utils.fsdp2_prepare_model,
            "fully_shard_kept": fsdp.fully_shard is originals[2],
        }
        fsdp2_compat.revert()
        report["reverted"] = (fu.fsdp2_prepare_model, fu._find_final_norm, fsdp.fully_shard) == originals and (
            accel.fsdp2_prepare_model is originals[0])
        print(json.dumps(report))
        """
    )
    report = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    assert report["rows"]["_find_final_norm"] == engine.APPLIED and report["norm_ours"], report
    if TIED_BROKEN:
        assert report["rows"]["fsdp2_prepare_model"] == engine.APPLIED and report["prepare_ours"], report
    else:
        assert report["rows"]["fsdp2_prepare_model"] == engine.NOT_NEEDED and not report["prepare_ours"], report
    assert report["callers"] and report["fully_shard_kept"] and report["reverted"], report


OLDER_TRL_CASES = [("qwen2_5_vl", False, read, p) for read in accelerate_scenarios.TRL_READERS for p in (None, GROUPING_ONLY)]


@pytest.mark.skipif(not guards.in_range(TRL or "0", ">=1.4.0,<1.15.0"),
                    reason="trl %s: _patch_chunked_ce_lm_head / patch_chunked_lm_head are TRL 1.4.0-1.14.2's" % TRL)
def test_older_trl_chunked_forwards_are_exact_with_the_grouping_fixed():
    """TRL 1.4.0-1.14.2's own chunked forwards (SFT ``chunked_nll``, async GRPO log-probs), untied Qwen2.5-VL:
    ``full_tensor()`` of the sharded head unpatched; with the accelerate targets alone, exact."""
    results = run_ranks(accelerate_scenarios.reader_cases, 2, OLDER_TRL_CASES, timeout=300)
    for i, case in enumerate(OLDER_TRL_CASES):
        pair = [results[0][i], results[1][i]]
        _print(case, pair)
        if case[3] is None:
            for r in pair:
                assert r["error"] is None and r["worst_grad"] == "lm_head.weight", r
                assert r["lm_head_rel_to_max"] > 0.1, r
        else:
            _exact(pair, False)
            assert pair[0]["head_unit"] == ["lm_head", "model.language_model.norm"], pair[0]["head_unit"]
