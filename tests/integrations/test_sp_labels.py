"""verl 0.6.0-0.7.1 fused forwards under Ulysses SP use the wrong labels: proven on real FSDP2 through verl's actor.

Issue #42 item 3.  verl's own ``apply_monkey_patch(ulysses_sp_size=2, use_remove_padding=True,
use_fused_kernels=True)``, ``apply_fsdp2`` and ``DataParallelPPOActor._forward_micro_batch`` on 2 CPU gloo
ranks forming one SP group (each rank holds a different shard of the packed micro-batch; an SP group shares
its micro-batch by construction), against an unsharded reference through the same actor with SP off
(``fsdp2_compat_harness.ulysses``: flash-attn's kernels and ``bert_padding`` helpers replaced by exact
pure-torch stand-ins, named there).  Unpatched: the labels the fused kernel used differ from this rank's slice
of the global roll (a VLM: SP rank 1 uses SP rank 0's; text: the shard's last label), and the ``lm_head``
gradient is off; patched (the family's patch: ``fixes.gather``'s SP-caller seam): every label right, every
gradient within 1e-5 of the reference.  The same through verl's ``FSDPEngineWithLMHead`` (its other caller,
``forward_step``; ``train_engine_sp``), whose 0.7.x ``forward_step`` autocasts to bf16 whatever the policy: the
labels exact, the gradients within bf16 tolerance of a reference under the same autocast.  GLM-4.1V runs the same forward code (``glm4v.py``, fingerprinted with
these) but not to the label on transformers 4.57 (its mask code fails first on 3-row position ids with remove
padding, patched or not; verl <= 0.7.1 cannot import on 5.x): covered by code identity, said in the docs.
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")

from fsdp2_compat import registry  # noqa: E402
from fsdp2_compat.core import guards  # noqa: E402
from fsdp2_compat_harness.ranks import run_ranks  # noqa: E402
from fsdp2_compat_harness.ulysses import FORWARD, train_engine_sp, train_sp  # noqa: E402

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("torch", "transformers", "verl")

VERL = guards.installed_version("verl")
pytestmark = pytest.mark.skipif(
    VERL is None or not guards.in_range(VERL, ">=0.7.0,<0.8.0.dev0"),
    reason="the bug is in verl 0.6.0-0.7.1 (0.8.0 passes shift_labels); 0.6.x's actor autocasts to bf16 whatever "
           "the policy, so the fp32 proof runs on 0.7.0-0.7.1",
)

TOL = 1e-5


@pytest.mark.parametrize("family", sorted(FORWARD))
def test_sp_labels_are_wrong_unpatched_and_exact_patched(family):
    patch = registry.for_model_type(family).name
    unpatched = run_ranks(train_sp, 2, family, None, pg_timeout=60)
    patched = run_ranks(train_sp, 2, family, patch, pg_timeout=60)
    for r in unpatched + patched:
        assert r["error"] is None, r["error"]
        assert r["forward"] == "verl.models.transformers." + FORWARD[family], r["forward"]
    wrong = [r["labels_wrong"] for r in unpatched]
    print("verl %s %s Ulysses SP 2, unpatched: labels wrong per rank and step %s of %d local; lm_head gradient "
          "error %.3g; patched: %.2g" % (VERL, family, wrong, unpatched[0]["local_len"],
                                         unpatched[0]["lm_head_grad_err"], patched[0]["lm_head_grad_err"]))
    if FORWARD[family] == "dense_common":  # text: each shard but the last has its last label wrong
        assert wrong[0] == [1, 1] and wrong[1] == [0, 0], wrong
    else:  # a VLM: SP rank 0 is right, SP rank 1 used SP rank 0's labels
        assert wrong[0] == [0, 0] and min(wrong[1]) > unpatched[1]["local_len"] // 3, wrong
    assert unpatched[0]["lm_head_grad_err"] > 1e-2 and unpatched[0]["logprob_err"] > 1e-2, unpatched[0]
    assert all(r["sp_caller"] == [] for r in unpatched), unpatched[0]["sp_caller"]
    for rank, r in enumerate(patched):
        assert r["sp_caller"] == ["applied"], r["sp_caller"]
        assert r["labels_wrong"] == [0, 0], (rank, r["labels_wrong"])
        assert r["logprob_err"] < TOL and r["loss_err"] < TOL, r
        assert r["grad_err"] < TOL, "rank %d worst gradient %s: %.2e" % (rank, r["worst_grad"], r["grad_err"])
        assert r["lm_head_grad_err"] < TOL and r["param_err"] < TOL, r


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from fsdp2_compat_harness.engines import common, verl_engine

    why = verl_engine.unrunnable()
    if why is not None:
        pytest.skip(why)
    root = str(tmp_path_factory.mktemp("verl-sp-models"))
    return lambda family: common.model_dir(family, root)


@pytest.mark.parametrize("family", sorted(FORWARD))
def test_sp_labels_through_verls_engine(model_dirs, family):
    from fsdp2_compat_harness.engines.common import BF16_TOL

    patch = registry.for_model_type(family).name
    unpatched = run_ranks(train_engine_sp, 2, family, model_dirs(family), None, pg_timeout=60)
    patched = run_ranks(train_engine_sp, 2, family, model_dirs(family), patch, pg_timeout=60)
    for r in unpatched + patched:
        assert r["error"] is None, r["error"]
        assert r["forward"] == "verl.models.transformers." + FORWARD[family], r["forward"]
    wrong = [r["labels_wrong"][0] for r in unpatched]
    print("verl %s engine %s Ulysses SP 2, unpatched: labels wrong per rank %s of %d local; lm_head gradient error "
          "%.3g; patched: %.2g (bf16 autocast)" % (VERL, family, wrong, unpatched[0]["local_len"],
                                                   unpatched[0]["step0_lm_head_grad_err"],
                                                   patched[0]["step0_lm_head_grad_err"]))
    assert (wrong == [1, 0]) if FORWARD[family] == "dense_common" else (wrong[0] == 0 and wrong[1] > 10), wrong
    assert unpatched[0]["step0_lm_head_grad_err"] > 5 * BF16_TOL, unpatched[0]
    assert all(r["sp_caller"] == [] for r in unpatched)
    for rank, r in enumerate(patched):
        assert r["sp_caller"] == ["applied"], r["sp_caller"]
        assert r["labels_wrong"] == [0], (rank, r["labels_wrong"])
        assert r["step0_grad_err"] < BF16_TOL, (rank, r["step0_worst_grad"], r["step0_grad_err"])
