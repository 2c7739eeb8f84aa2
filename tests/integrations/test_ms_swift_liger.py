"""ms-swift 4.6.0's Liger losses (GRPO, GKD) on accelerate's FSDP2, where ``lm_head`` is a unit of its own.

Through ms-swift's released trainer code (``harness/fsdp2_compat_harness/engines/ms_swift.py``; GKD:
``support/swift_rl_jobs.py``), 2 CPU gloo ranks, different data, against an unsharded reference on the
data-parallel average (fp32, 1e-5).  accelerate >= 1.14 gives the
untied output embedding a tail unit ``[final norm, lm_head]``; a VLM's base model has no final norm among its
direct children, so there the tail is ``[lm_head]`` alone and its forward never runs.

- GRPO (``GRPOTrainer.compute_loss`` with ``use_liger_loss``: ``compute_liger_loss`` inside the root unit's
  forward, ``unwrapped_model.lm_head.weight`` into liger-kernel's ``LigerFusedLinearGRPOLoss``).  Unpatched,
  Qwen2.5-VL and Qwen3-VL: the weight reaches liger's matmul as a sharded ``DTensor`` and it fails
  (``aten.mm.default got mixed torch.Tensor and DTensor``).  Patched (the model's patch: its accelerate
  grouping target puts the decoder's final norm in the tail, whose forward then unshards the head, which
  stays unsharded: ``reshard_after_forward=False``), exact.  A text model (Qwen2: the tail holds its norm) is
  exact unpatched.  No ms-swift seam: the shared accelerate target fixes it.
- GKD (``GKDTrainer._compute_liger_loss``, the teacher prepared by ms-swift's ``prepare_fsdp`` as the trainer
  does under FSDP).  What did not reproduce as claimed: it never reaches the ``teacher_head.weight`` read.
  It calls the teacher's *base model* directly, outside the teacher root unit's forward, so that root is
  never lazily initialised nor unsharded: a text teacher fails in FSDP2's lazy init (``FSDP requires a single
  root module but got (..RMSNorm.., ..Linear..)``: the tail group is taken for a root), a VLM teacher at its
  vision patch embedding, a parameter of the never-unsharded root (``aten.convolution.default: got mixed
  torch.Tensor and DTensor``).  The same with the model's patch: no fsdp2-compat seam reaches it (recorded
  here so that a release that changes it shows up).
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")
pytest.importorskip("accelerate", reason="needs accelerate (ms-swift's --fsdp fsdp2 prepares through it)")
pytest.importorskip("swift", reason="needs ms-swift (the code under test: set tf516swift)")
pytest.importorskip("trl", reason="swift.rlhf_trainers imports trl (set tf516swift)")
pytest.importorskip("liger_kernel", reason="needs liger-kernel (the chunked losses: set tf516swift)")

from fsdp2_compat import registry  # noqa: E402
from fsdp2_compat.core import guards  # noqa: E402
from fsdp2_compat_harness.ranks import run_ranks  # noqa: E402
from support import swift_rl_jobs  # noqa: E402  (GKD; GRPO: tooling.engines.ms_swift)

DEPENDS_ON = ("torch", "transformers", "accelerate", "ms-swift", "trl", "liger-kernel")

SWIFT = guards.installed_version("ms-swift")
ACCELERATE = guards.installed_version("accelerate")
pytestmark = [
    pytest.mark.skipif(SWIFT != "4.6.0", reason="ms-swift %s: these proofs are of 4.6.0's code" % SWIFT),
    pytest.mark.skipif(not guards.in_range(ACCELERATE, ">=1.14.0,<=1.15.0"),
                       reason="accelerate %s: the lm_head tail unit is 1.14.0+ (proven to 1.15.0)" % ACCELERATE),
    pytest.mark.xdist_group("ms_swift_liger"),
]

TOL = 1e-5
VLMS = ("qwen2_5_vl", "qwen3_vl")
MIXED = "got mixed torch.Tensor and DTensor"


def _patch(family):
    return registry.for_model_type(family).name


CASES = ([("grpo", f, None) for f in VLMS] + [("grpo", f, _patch(f)) for f in VLMS] + [("grpo", "qwen2", None)]
         + [("gkd", f, p) for f in ("qwen2", "qwen2_5_vl") for p in (None, _patch(f))])


@pytest.fixture(scope="module")
def liger():
    """Every case on one rank pair: ``{(trainer, family, patches): [rank 0 result, rank 1 result]}``."""
    results = run_ranks(swift_rl_jobs.liger_cases, 2, CASES, timeout=300, pg_timeout=60)
    return {case: [results[0][i], results[1][i]] for i, case in enumerate(CASES)}


def _exact(ranks):
    for rank, r in enumerate(ranks):
        assert r["error"] is None, "rank %d: %s" % (rank, r["error"])
        assert r["grads_checked"] > 50 and r["loss_err"] < TOL and r["param_err"] < TOL, r
        assert r["grad_err"] < TOL, (rank, r["worst_grad"], r["grad_err"])
    assert ranks[0]["losses"] != ranks[1]["losses"], "same data on both ranks"


@pytest.mark.parametrize("family", VLMS)
def test_unpatched_grpo_liger_reads_a_vlm_head_still_sharded_in_its_own_unit(liger, family):
    for r in liger[("grpo", family, None)]:
        assert r["head_unit"] == "lm_head", r["head_unit"]
        assert r["read"] == ["DTensor"], r["read"]
        assert r["error"] and "step 0" in r["error"] and "aten.mm.default " + MIXED in r["error"], r["error"]


@pytest.mark.parametrize("family", VLMS)
def test_patched_grpo_liger_trains_a_vlm_to_the_data_parallel_average(liger, family):
    ranks = liger[("grpo", family, _patch(family))]
    _exact(ranks)
    for r in ranks:
        assert r["head_unit"] == "model.language_model.norm", r["head_unit"]  # the tail unit holds the norm
        assert set(r["read"]) == {"Parameter"}, r["read"]  # liger got the unsharded head


def test_grpo_liger_on_a_text_model_is_right_unpatched(liger):
    ranks = liger[("grpo", "qwen2", None)]
    _exact(ranks)
    for r in ranks:
        assert r["head_unit"] == "model.norm" and set(r["read"]) == {"Parameter"}, r


@pytest.mark.parametrize("family,expected", [("qwen2", "FSDP requires a single root module"),
                                             ("qwen2_5_vl", "aten.convolution.default: " + MIXED)])
def test_gkd_liger_fails_in_the_teacher_forward_before_any_head_read_patched_or_not(liger, family, expected):
    for patches in (None, _patch(family)):
        for r in liger[("gkd", family, patches)]:
            assert r["error"] and "step 0" in r["error"] and expected in r["error"], (patches, r["error"])
            assert r["read"] == [], r["read"]  # liger's JSD loss was never reached
