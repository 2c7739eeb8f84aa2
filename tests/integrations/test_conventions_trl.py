"""TRL's distillation seams hold however ``_compute_loss`` is called (issue #22, calling conventions).

``DistillationTrainer._compute_loss`` and ``AsyncDistillationTrainer._compute_loss``
are method seams.  Here the real trainers' ``compute_loss`` reaches the
(patched) ``_compute_loss`` through a subclass override that calls the base
each way user code does (``tooling.conventions``: the instance, the class with
an explicit self, ``super()``, ``MethodType`` re-binding, the class attribute
itself, every argument by keyword), on a student prepared by the real
``Accelerator.prepare`` (accelerate's FSDP2), two CPU gloo ranks with different
data, against an unsharded reference trained on the data-parallel average.
The claim is the fix's effect: every gradient, ``lm_head``'s included, is the
DP average; unpatched, ``lm_head``'s is not (same run, same convention).
The one stand-in is ``trl_scenarios.cpu_fsdp`` (accelerate selects FSDP only
for GPU-like devices).
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")
pytest.importorskip("trl", reason="needs trl (the code under test)")
pytest.importorskip("accelerate", reason="needs accelerate (TRL's FSDP2 preparation)")

from fsdp2_compat.core import guards  # noqa: E402
from fsdp2_compat_harness.conventions import CONVENTIONS  # noqa: E402
from fsdp2_compat_harness.ranks import run_ranks  # noqa: E402
from fsdp2_compat_harness.trl_scenarios import train_trl  # noqa: E402
from support import trl_jobs  # noqa: E402

DEPENDS_ON = ("torch", "transformers", "accelerate", "trl")

TRL = guards.installed_version("trl")
pytestmark = [
    pytest.mark.skipif(trl_jobs.cannot_show_the_bug() is not None, reason=str(trl_jobs.cannot_show_the_bug())),
]

TOL = 1e-5
FAMILY, PATCH = "qwen3_vl", "qwen3vl"  # untied: accelerate leaves lm_head alone in a unit whose forward never runs


def _lm_head_errors(results):
    for rank, r in enumerate(results):
        assert r["error"] is None, "rank %d: %s" % (rank, r["error"])
        assert r["head_weight"] == "DTensor", r["head_weight"]
    assert results[0]["losses"] != results[1]["losses"], "same data on both ranks"
    return [r["lm_head_rel_to_max"] for r in results]


def _assert_dp_exact(results):
    for r in results:
        assert r["grads_checked"] > 0
        assert r["grad_err"] < TOL, (r["worst_grad"], r["grad_err"])
        assert r["lm_head_grad_err"] < TOL and r["lm_head_rel_to_max"] < TOL, r["lm_head_rel_to_max"]


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_distillation_lm_head_gradient_is_the_dp_average_however_compute_loss_is_called(convention):
    unpatched = _lm_head_errors(run_ranks(train_trl, 2, FAMILY, "distill", None,
                                          kwargs={"convention": convention, "steps": 1}))
    patched_results = run_ranks(train_trl, 2, FAMILY, "distill", PATCH, kwargs={"convention": convention, "steps": 1})
    patched = _lm_head_errors(patched_results)
    print("trl %s distill, _compute_loss called by %s: lm_head gradient vs DP average (max|a-b|/max|b|) "
          "unpatched %s, patched %s" % (TRL, convention, ", ".join("%.3g" % e for e in unpatched),
                                        ", ".join("%.3g" % e for e in patched)))
    assert min(unpatched) > 0.1, unpatched  # each rank keeps its own micro-batch gradient
    _assert_dp_exact(patched_results)
    for r in patched_results:  # the kernel got FSDP's unsharded parameter, not full_tensor()'s copy
        assert r["kernel_weights"] == [("Parameter", "torch.float32")], r["kernel_weights"]


@pytest.mark.parametrize("convention", ("class", "descriptor", "keywords"))
def test_async_distillation_lm_head_gradient_is_the_dp_average_however_compute_loss_is_called(convention):
    unpatched = _lm_head_errors(run_ranks(trl_jobs.async_distill_step, 2, FAMILY, None,
                                          kwargs={"convention": convention, "steps": 1}))
    patched_results = run_ranks(trl_jobs.async_distill_step, 2, FAMILY, PATCH,
                                kwargs={"convention": convention, "steps": 1})
    patched = _lm_head_errors(patched_results)
    print("trl %s async distill, _compute_loss called by %s: lm_head gradient vs DP average unpatched %s, "
          "patched %s" % (TRL, convention, ", ".join("%.3g" % e for e in unpatched),
                          ", ".join("%.3g" % e for e in patched)))
    assert min(unpatched) > 0.1, unpatched
    _assert_dp_exact(patched_results)


def test_compute_loss_seam_without_a_student_head_raises_under_strict_instead_of_running_unfixed(monkeypatch):
    import re

    import fsdp2_compat
    from trl.trainer.distillation_trainer import DistillationTrainer

    from fsdp2_compat.core import calls

    fsdp2_compat.apply(PATCH)
    assert hasattr(vars(DistillationTrainer)["_compute_loss"], "__wrapped__"), "the seam is not installed"
    trainer = DistillationTrainer.__new__(DistillationTrainer)
    monkeypatch.setenv("FSDP2_COMPAT_STRICT", "1")
    where = "trl.trainer.distillation_trainer.DistillationTrainer._compute_loss"
    for call in (lambda: trainer._compute_loss(object(), {}, 1),
                 lambda: DistillationTrainer._compute_loss(trainer, unwrapped_student=None, inputs={},
                                                           num_items_in_batch=1)):
        with pytest.raises(calls.SeamInputError, match=re.escape(where) + " was called without a student"):
            call()
