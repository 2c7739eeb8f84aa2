"""torch FSDP2 accumulation: the catalogue's "not needed from 2.15.0" proven by running, on the installed torch.

``integrations/torch_fsdp.py`` declares both accumulation seams not needed on torch >= 2.15.0 (the code was
rewritten around ``Parameter.grad_dtype``), from reading the source. Here the same scenarios that crash on
torch 2.7.0-2.14.1 (``test_grad_accumulation.py``: a deferred text-only micro-batch, bf16 params / fp32
reduce, 2 gloo ranks with different data) run unpatched, and the expected outcome is read from the
catalogue, not written here: where the catalogue declares the seams not needed, unpatched training must not
crash and must match the unsharded data-parallel-average reference (and what syncing on every micro-batch
gives); where it records a fingerprint, unpatched must raise the exact ``AttributeError``. The status rows
must say the same thing the run shows.

Measured: torch 2.15.0 (set ``latest``): trains, "not needed"; torch 2.13.0: crashes (``test_grad_accumulation``).
"""

import json

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")

from fsdp2_compat.core import engine, guards, policy  # noqa: E402
from fsdp2_compat.integrations import torch_fsdp  # noqa: E402
from fsdp2_compat_harness.ranks import run_ranks  # noqa: E402
from support import accum_jobs  # noqa: E402

DEPENDS_ON = ("torch", "transformers", "accelerate", "trl")

TORCH = guards.installed_version("torch")
SEAMS = torch_fsdp.GRAD_ACCUMULATION
DECLARED = [policy.declared_reason(t, TORCH) for t in SEAMS]
NOT_NEEDED = all(r is not None for r in DECLARED)
ATTRIBUTE_ERROR = "AttributeError: 'FSDPParam' object has no attribute '_unsharded_param'"
BF16_GRAD, BF16_REL_TO_MAX = 1e-2, 6e-2  # bf16 params against the fp32 reference (as test_grad_accumulation)

pytestmark = pytest.mark.skipif(
    not guards.in_range(TORCH, ">=2.7.0"),
    reason="torch %s: before 2.7.0 the root callback does not reach a never-gathered unit" % TORCH)


def test_the_catalogue_classifies_the_installed_torch_one_way_for_both_seams():
    fingerprinted = [guards.in_range(TORCH, t.versions) or any(
        guards.in_range(TORCH, ">=%s,<=%s" % (lb.partition("-")[0], lb.partition("-")[2] or lb))
        for lb in t.fingerprints) for t in SEAMS]
    assert NOT_NEEDED or all(fingerprinted), (TORCH, DECLARED, fingerprinted)
    assert not (NOT_NEEDED and any(fingerprinted)), (TORCH, DECLARED)


def test_status_after_import_says_what_the_run_below_shows(warm_python):
    proc = warm_python(
        """
        import json
        import fsdp2_compat
        fsdp2_compat.apply("qwen3vl")
        import torch.distributed.fsdp
        rows = [r for r in fsdp2_compat.status() if r["dist"] == "torch"]
        print(json.dumps([(r["attr"], r["outcome"], r["detail"]) for r in rows]))
        fsdp2_compat.revert()
        """
    )
    # the accumulation fix's rows (the patch carries other torch fixes: frozen_units has its own proof)
    rows = [r for r in json.loads(proc.stdout.strip().splitlines()[-1]) if r[0] in {t.attr for t in SEAMS}]
    assert sorted(a for a, _, _ in rows) == sorted(t.attr for t in SEAMS), rows
    for attr, outcome, detail in rows:
        if NOT_NEEDED:
            assert outcome == engine.NOT_NEEDED and "Parameter.grad_dtype" in detail, (attr, outcome, detail)
        else:
            assert outcome == engine.APPLIED, (attr, outcome, detail)


@pytest.mark.parametrize("unused", [False, True], ids=["skipped-unit", "reduce-scatter-unused-params"])
def test_pure_torch_deferred_text_only_micro_batch_unpatched(unused):
    deferred = run_ranks(accum_jobs.toy_accumulation, 2, None, unused, "deferred")
    if not NOT_NEEDED:
        assert all(r["error"] == ATTRIBUTE_ERROR for r in deferred), [r["error"] for r in deferred]
        return
    every = run_ranks(accum_jobs.toy_accumulation, 2, None, unused, "every")
    for rank, (d, e) in enumerate(zip(deferred, every)):
        assert d["error"] is None and e["error"] is None, (rank, d["error"], e["error"])
        assert d["grads_checked"] == (2 if unused else 6)
        assert d["grad_err"] < BF16_GRAD, (rank, d["grad_err"])
        worst = max(abs(a - b) for name, g in d["grads"].items() for ra, rb in zip(g, e["grads"][name])
                    for a, b in zip(ra if isinstance(ra, list) else [ra], rb if isinstance(rb, list) else [rb]))
        assert worst < 1e-6, (rank, worst)  # deferred, unpatched == synchronising every micro-batch


@pytest.mark.xdist_group("accum-declared-accelerate")
def test_qwen3_vl_through_accelerate_text_only_then_image_unpatched():
    """``Accelerator.prepare`` (FSDP2 plugin, bf16 params / fp32 reduce), ``accelerator.no_sync`` around the
    deferred micro-batches, steps [text, image] and [image, text, image]: the case that raises on 2.13.0."""
    pytest.importorskip("trl", reason="accelerate's FSDP2 path is driven as TRL's trainers use it (trl_scenarios)")
    cases = [("deferred", None, "bf16", "deferred", "mixed"), ("every", None, "bf16", "every", "mixed")]
    results = run_ranks(accum_jobs.accumulation_cases, 2, "accelerate", "qwen3_vl", cases, [("deferred", "every")])
    for rank, r in enumerate(results):
        d = r["deferred"]
        if not NOT_NEEDED:
            assert d["error"] == "step 0: " + ATTRIBUTE_ERROR, d["error"]
            continue
        assert d["error"] is None and r["every"]["error"] is None, (rank, d["error"], r["every"]["error"])
        print("torch %s unpatched qwen3_vl deferred: worst gradient %.3g (%s), rel to max %.3g; deferred vs every %.3g"
              % (TORCH, d["grad_err"], d["worst_grad"], d["grad_rel_to_max"], r["deferred vs every"]))
        # the trigger was there: after the text-only micro-batch no vision unit had been all-gathered
        vision = [u for u in d["wrapped"] if u.startswith("model.visual.")]
        assert vision and d["never_gathered_after_first"] == vision, d
        assert d["grads_checked"] > 0 and d["grad_err"] < BF16_GRAD and d["grad_rel_to_max"] < BF16_REL_TO_MAX, d
        assert r["deferred vs every"] < 1e-6, r["deferred vs every"]
