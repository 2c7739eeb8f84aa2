"""TRL reads a sharded lm_head.weight outside its forward: the bug and the fix, on real FSDP2.

Real TRL (its fused LM head, ``SFTTrainer``, ``DistillationTrainer``,
``AsyncDistillationTrainer``) on a model prepared by the real
``Accelerator.prepare`` (accelerate's ``fsdp2_prepare_model``), two CPU gloo
ranks with different data, against an unsharded reference trained on the
data-parallel average.  The one stand-in is ``trl_scenarios.cpu_fsdp``:
accelerate selects FSDP only for GPU-like devices, so on CPU the test sets
the distributed type exactly as accelerate's GPU branch does.

Families: Qwen3-VL and Qwen2.5-VL (accelerate leaves their ``lm_head`` alone
in a tail unit whose forward never runs: the trap), Qwen2 (text control: the
tail unit holds the final norm, so TRL is right with and without the patch).
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")
pytest.importorskip("trl", reason="needs trl (the code under test)")
pytest.importorskip("accelerate", reason="needs accelerate (TRL's FSDP2 preparation)")

from fsdp2_compat import registry  # noqa: E402
from fsdp2_compat.core import engine, guards, policy  # noqa: E402
from fsdp2_compat.integrations import trl as trl_integration  # noqa: E402
from fsdp2_compat_harness.ranks import run_ranks  # noqa: E402
from fsdp2_compat_harness.trl_scenarios import train_trl  # noqa: E402
from support import trl_jobs  # noqa: E402

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("torch", "transformers", "trl", "accelerate")

TRL = guards.installed_version("trl")
ACCELERATE = guards.installed_version("accelerate")
pytestmark = [
    pytest.mark.skipif(trl_jobs.cannot_show_the_bug() is not None, reason=str(trl_jobs.cannot_show_the_bug())),
]

TOL = 1e-5
VLMS = ("qwen3_vl", "qwen2_5_vl")
FAMILIES = VLMS + ("qwen2",)
PATHS = ("sft", "grpo", "distill")
PATCH = {f: registry.for_model_type(f).name for f in FAMILIES}  # qwen3vl, qwen2vl, textlm


def _run(family, path, patch, **kwargs):
    results = run_ranks(train_trl, 2, family, path, patch, kwargs=kwargs)
    for rank, r in enumerate(results):
        assert r["error"] is None, "rank %d: %s" % (rank, r["error"])
        assert r["head_weight"] == "DTensor", r["head_weight"]  # accelerate sharded lm_head apart
        assert "lm_head" in r["wrapped"], r["wrapped"]
    assert results[0]["losses"] != results[1]["losses"], "same data on both ranks"
    return results


def test_every_tested_family_has_the_trl_targets_in_its_patch():
    for family in FAMILIES:
        assert set(trl_integration.TARGETS) <= set(registry.patch(PATCH[family]).targets), family


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", VLMS)
def test_unpatched_vlm_lm_head_gradient_misses_the_dp_average(family, path):
    results = _run(family, path, None)
    lm = [r["lm_head_rel_to_max"] for r in results]
    print("trl %s accelerate %s %s %s unpatched: lm_head gradient vs DP average, max|a-b|/max|b| per rank: %s; "
          "max|a-b|/(1+|b|): %s" % (TRL, ACCELERATE, family, path, ", ".join("%.3g" % e for e in lm),
                                    ", ".join("%.3g" % r["lm_head_grad_err"] for r in results)))
    assert min(lm) > 0.1, lm  # measured 0.43-1.26: each rank keeps its own micro-batch gradient
    if path != "distill":  # the distillation gradients are ~1e-4 in absolute terms
        assert min(r["lm_head_grad_err"] for r in results) > 1e-3
    assert all(r["worst_grad"] == "lm_head.weight" for r in results)
    assert all(k == ("Tensor", "torch.float32") for r in results for k in r["kernel_weights"])  # full_tensor()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_every_gradient_matches_the_dp_average(family, path):
    results = _run(family, path, PATCH[family])
    for rank, r in enumerate(results):
        assert r["loss_err"] < TOL and r["param_err"] < TOL, (rank, r["loss_err"], r["param_err"])
        assert r["lm_head_grad_err"] < TOL and r["lm_head_rel_to_max"] < TOL, (rank, r["lm_head_rel_to_max"])
        assert r["grad_err"] < TOL, "rank %d worst gradient %s: %.2e" % (rank, r["worst_grad"], r["grad_err"])
        assert r["grads_checked"] > 40
        # TRL's kernel gets FSDP's unsharded parameter, not a full_tensor() copy.
        assert r["kernel_weights"] == [("Parameter", "torch.float32")], r["kernel_weights"]


@pytest.mark.parametrize("path", PATHS)
def test_text_model_is_exact_without_the_patch(path):
    for rank, r in enumerate(_run("qwen2", path, None)):
        assert r["grad_err"] < TOL and r["param_err"] < TOL, (rank, r["worst_grad"], r["grad_err"])
        assert r["kernel_weights"] == [("Parameter", "torch.float32")], r["kernel_weights"]


@pytest.mark.parametrize("path", PATHS)
def test_bf16_patched_vlm_is_as_close_as_the_text_models_bf16_noise(path):
    """Accelerator(mixed_precision="bf16"): bf16 FSDP2 policy and CPU autocast, against an fp32 reference."""
    vlm = _run("qwen3_vl", path, "qwen3vl", bf16=True)
    text = _run("qwen2", path, None, bf16=True)
    unpatched = _run("qwen3_vl", path, None, bf16=True)
    noise = max(r["lm_head_rel_to_max"] for r in text)
    print("bf16 %s lm_head max|a-b|/max|b|: qwen3_vl patched %s, qwen2 (control) %.3g, qwen3_vl unpatched %s" % (
        path, ", ".join("%.3g" % r["lm_head_rel_to_max"] for r in vlm), noise,
        ", ".join("%.3g" % r["lm_head_rel_to_max"] for r in unpatched)))
    for r in vlm:
        # The autocast wrapper accelerate puts around model.forward kept the gathering wrapper: bf16 weight.
        assert r["kernel_weights"] == [("Parameter", "torch.bfloat16")], r["kernel_weights"]
        assert r["lm_head_rel_to_max"] < 2 * noise + 1e-3, (r["lm_head_rel_to_max"], noise)  # measured 0.0075-0.011
        assert r["grad_rel_to_max"] < 0.05, (r["worst_rel_to_max"], r["grad_rel_to_max"])
    assert min(r["lm_head_rel_to_max"] for r in unpatched) > 0.3


@pytest.mark.parametrize("family,patch,tol", [
    ("qwen3_vl", None, None), ("qwen3_vl", "qwen3vl", TOL), ("qwen2", None, TOL),
])
def test_sft_trainer_train_step(family, patch, tol):
    """One optimizer step of the real ``SFTTrainer.train()`` (FSDP2 from ``TrainingArguments.fsdp``)."""
    results = run_ranks(trl_jobs.sft_train_step, 2, family, patch)
    for rank, r in enumerate(results):
        assert r["distributed_type"] == "DistributedType.FSDP" and "lm_head" in r["wrapped"]
        assert r["param_err"] < TOL, (rank, r["worst_param"], r["param_err"])  # every other parameter: exact
        if tol is None:
            print("SFTTrainer.train() %s unpatched: lm_head after one step off by %.3g of the step" % (
                family, r["lm_head_step_err"]))
            assert r["lm_head_step_err"] > 0.3, r  # measured 0.956: the step is its own rank's
        else:
            assert r["lm_head_param_err"] < tol and r["lm_head_step_err"] < 1e-4, r
    assert results[0]["rank_batches"][0] != results[0]["rank_batches"][1], "same data on both ranks"


def test_sft_trainer_train_with_gradient_accumulation_matches():
    results = run_ranks(trl_jobs.sft_train_step, 2, "qwen3_vl", "qwen3vl", kwargs={"accum": 2})
    for r in results:
        assert all(len(b) == 2 for b in r["rank_batches"]), r["rank_batches"]
        assert r["lm_head_param_err"] < TOL and r["param_err"] < TOL, r


@pytest.mark.parametrize("patch", [None, "qwen3vl"], ids=["unpatched", "patched"])
def test_async_distillation_compute_loss(patch):
    """``AsyncDistillationTrainer.compute_loss`` (text-only, padding-free) with a Qwen3-VL student."""
    results = run_ranks(trl_jobs.async_distill_step, 2, "qwen3_vl", patch)
    for rank, r in enumerate(results):
        assert r["error"] is None and r["head_weight"] == "DTensor", r
        if patch is None:
            assert r["lm_head_rel_to_max"] > 0.3, r["lm_head_rel_to_max"]  # measured 0.997
        else:
            assert r["grad_err"] < TOL and r["loss_err"] < TOL and r["param_err"] < TOL, (rank, r["worst_grad"], r)
    assert results[0]["losses"] != results[1]["losses"]


def test_patch_rebinds_callers_keeps_a_bound_method_and_reverts(warm_python):
    """The seam's mechanics in a fresh interpreter, on the installed TRL."""
    proc = warm_python(
        """
        import inspect, json, types
        import fsdp2_compat
        from fsdp2_compat.core import engine
        import trl.trainer.sft_trainer as sft, trl.trainer.utils as utils
        original = utils.add_fused_lm_head
        from fsdp2_compat_harness import tiny
        plain = tiny.build("qwen3_vl"); original(plain)
        fsdp2_compat.apply("qwen3vl")
        import trl.trainer.distillation_trainer as dt
        model = tiny.build("qwen3_vl")
        sft.add_fused_lm_head(model)          # through the caller's by-name import
        bound = model.__dict__["forward"]
        rows = {r["attr"]: r for r in fsdp2_compat.status() if r["dist"] == "trl"}
        report = {
            "alias": sft.add_fused_lm_head is utils.add_fused_lm_head and engine.is_ours(utils.add_fused_lm_head),
            "bound": isinstance(bound, types.MethodType) and bound.__self__ is model,
            "func": type(bound.__func__).__name__,
            "signature": str(inspect.signature(model.forward)) == str(inspect.signature(plain.forward)),
            "outcomes": {a: (r["outcome"], r["proven"]) for a, r in rows.items()},
            "distillation": engine.is_ours(dt.DistillationTrainer.__dict__["_compute_loss"]),
        }
        fsdp2_compat.revert()
        report["reverted"] = sft.add_fused_lm_head is original and utils.add_fused_lm_head is original
        print(json.dumps(report))
        """
    )
    report = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    assert report["alias"] and report["bound"] and report["signature"] and report["distillation"], report
    assert report["func"] == "FunctionWrapper"
    assert report["outcomes"]["add_fused_lm_head"] == [engine.APPLIED, True]
    assert report["outcomes"]["DistillationTrainer._compute_loss"] == [engine.APPLIED, True]
    assert report["reverted"]


def test_older_trl_releases_are_recorded_as_not_covered():
    """TRL 1.1.0-1.14.2 read lm_head through other functions: a requested patch is refused there, loudly."""
    reason = policy.unsupported_reason(trl_integration.FUSED_LM_HEAD, "1.14.2")
    assert "_patch_chunked_ce_lm_head" in reason and "not covered by fsdp2-compat yet" in reason
    assert policy.declared_reason(trl_integration.FUSED_LM_HEAD, "1.14.2") is None
    assert policy.unsupported_reason(trl_integration.FUSED_LM_HEAD, "1.16.0") is None
    assert policy.declared_reason(trl_integration.DISTILLATION, "1.9.2") is not None
