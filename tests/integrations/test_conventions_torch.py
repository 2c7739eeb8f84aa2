"""torch's two accumulation seams hold however their methods are called (issue #22, calling conventions).

``FSDPParam.to_accumulated_grad_if_needed`` and ``FSDPParamGroup.post_backward``
are method seams.  Here every ``FSDPParam`` and ``FSDPParamGroup`` of a real
``fully_shard``-ed model gets a subclass whose override reaches torch's method
one way (``tooling.conventions``: the instance, the class with an explicit
self, ``super()``, ``MethodType`` re-binding, the class attribute itself, every
argument by keyword), so torch's own backward goes through that convention.
The scenario is ``accum_jobs.toy_accumulation`` (bf16 params, fp32 reduce, a
deferred text-only micro-batch that skips a unit, two CPU gloo ranks with
different data): unpatched, torch crashes with the ``_unsharded_param``
``AttributeError``; patched, every gradient matches what synchronising every
micro-batch reduces, and the fp32 data-parallel-average reference.
"""

import re

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")

from fsdp2_compat.core import guards  # noqa: E402
from fsdp2_compat_harness.conventions import CONVENTIONS  # noqa: E402
from fsdp2_compat_harness.ranks import run_ranks  # noqa: E402
from support import accum_jobs  # noqa: E402

DEPENDS_ON = ("torch",)

TORCH = guards.installed_version("torch")
pytestmark = pytest.mark.skipif(
    not guards.in_range(TORCH, ">=2.7.0,<2.15.0"),
    reason="torch %s: the FSDP2 accumulation bugs are in 2.7.0-2.14.1 (2.15.0 rewrote accumulation)" % TORCH,
)

BF16_GRAD = 1e-2  # bf16 toy against the fp32 reference (as test_grad_accumulation)
# the class name is the convention's subclass of FSDPParam
NEVER_GATHERED = re.compile(r"AttributeError: 'FSDPParam\w*' object has no attribute '_unsharded_param'$")


_EVERY = []


def _synchronising_every_micro_batch():
    """Upstream torch with sync on every micro-batch (nothing to fix there): the gradients to match, run once."""
    if not _EVERY:
        _EVERY.append(run_ranks(accum_jobs.toy_accumulation, 2, None, kwargs={"sync": "every"}))
    return _EVERY[0]


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_deferred_accumulation_over_a_skipped_unit_trains_however_torch_reaches_the_seams(convention):
    unpatched = run_ranks(accum_jobs.toy_accumulation, 2, None, kwargs={"convention": convention})
    patched = run_ranks(accum_jobs.toy_accumulation, 2, ["t-accum"], kwargs={"convention": convention})
    every = _synchronising_every_micro_batch()
    for rank, (u, p, e) in enumerate(zip(unpatched, patched, every)):
        assert u["adopted"] == p["adopted"] == 8, u["adopted"]  # 2 groups, 6 parameters: all go by the convention
        assert u["error"] is not None and NEVER_GATHERED.match(u["error"]), (rank, u["error"])
        assert p["error"] is None and e["error"] is None, (rank, p["error"], e["error"])
        assert p["grad_err"] < BF16_GRAD, (rank, p["grad_err"])
        for name, g in p["grads"].items():  # deferred + the seams == synchronising every micro-batch
            worst = max(abs(a - b) for a, b in zip(_flat(g), _flat(e["grads"][name])))
            assert worst < 1e-6, (rank, name, worst)


def _flat(values):
    return [v for row in values for v in _flat(row)] if isinstance(values, list) else [values]


def test_post_backward_seam_called_without_its_group_says_so_and_raises_under_strict(monkeypatch, caplog):
    import logging

    import fsdp2_compat
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from fsdp2_compat.core import calls

    fsdp2_compat.apply("qwen3vl")  # carries both torch seams; torch is imported: they apply at once
    seam = vars(FSDPParamGroup)["post_backward"]
    assert hasattr(seam, "__wrapped__"), "the seam is not installed"
    where = "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup.post_backward"
    monkeypatch.setenv("FSDP2_COMPAT_STRICT", "1")
    with pytest.raises(calls.SeamInputError, match=re.escape(where) + " was called without its FSDPParamGroup"):
        seam()
    monkeypatch.delenv("FSDP2_COMPAT_STRICT")
    calls._warned.clear()
    with caplog.at_level(logging.WARNING, logger="fsdp2_compat"), pytest.raises(TypeError):
        seam()  # not strict: warned, then torch's own method refuses the call
    assert any(where in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
