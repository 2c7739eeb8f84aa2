"""axolotl's LoRA kernels with DoRA on its own FSDP2 preparation: the unaveraged magnitude gradient, and the fix.

Through axolotl's released code (``patch_accelerate_fsdp2``: its
``fsdp2_prepare_model`` under the real ``Accelerator.prepare``;
``patch_self_attn_lora`` + ``apply_lora_kernel_patches``: its fused QKV / O /
embedding kernels) on a tiny Qwen2 turned PEFT DoRA model (every projection and
the input embedding), 2 CPU gloo ranks with different data, against an
unsharded reference with the same kernels trained on the data-parallel average
(fp32, 1e-5; ``support/axolotl_jobs.py``).  The one stand-in is
``trl_scenarios.cpu_fsdp`` (accelerate selects FSDP only for GPU-like devices).

Unpatched (axolotl 0.19.0): at the first step, on identical parameters, the
q/k/v/o ``lora_magnitude_vector`` gradients and the embedding's are each
rank's own (plain ``full_tensor()``), off the average by ~4e-2 / ~2e-2.  What
did not reproduce, asserted exact at that step: every ``lora_A`` / ``lora_B``
(axolotl unshards their units through FSDP), the embedding's
``lora_embedding_A`` / ``_B`` (the LoRA embedding is one unit whose forward is
the kernel, so its ``full_tensor()`` calls never see a DTensor) and the MLP
magnitudes (PEFT's own DoRA forward: axolotl's MLP kernel is Triton, CUDA only).
Patched (the model's patch, ``textlm``), two steps: every gradient, loss and
parameter equals the reference's.
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")
pytest.importorskip("accelerate", reason="needs accelerate (axolotl prepares through it)")
pytest.importorskip("peft", reason="needs peft (DoRA)")
pytest.importorskip("bitsandbytes", reason="axolotl.kernels.lora imports bitsandbytes (set tf516)")
pytest.importorskip("triton", reason="axolotl.kernels.lora imports triton (set tf516)")
pytest.importorskip("axolotl", reason="needs axolotl (the code under test: set tf516)")

from fsdp2_compat import registry  # noqa: E402
from fsdp2_compat.core import guards  # noqa: E402
from fsdp2_compat.integrations import axolotl as ax_integration  # noqa: E402
from fsdp2_compat.tooling.ranks import run_ranks  # noqa: E402
from support import axolotl_jobs  # noqa: E402

DEPENDS_ON = ("torch", "transformers", "accelerate", "peft", "axolotl")

AXOLOTL = guards.installed_version("axolotl")
pytestmark = [
    pytest.mark.skipif(not guards.in_range(AXOLOTL, ">=0.16.0,<=0.21.0"),
                       reason="axolotl %s: the DoRA magnitude reads are 0.16.0-0.21.0" % AXOLOTL),
    pytest.mark.xdist_group("axolotl"),
]

TOL = 1e-5
FAMILY = "qwen2"
PATCH = registry.for_model_type(FAMILY).name  # textlm
CASES = [(FAMILY, None), (FAMILY, [PATCH])]
EXACT_UNPATCHED = ("lora_ab", "embed_ab", "mlp_magnitude")  # claims that did not reproduce
TRAPPED = ("attn_magnitude", "embed_magnitude")


@pytest.fixture(scope="module")
def dora():
    """Both cases on one rank pair: ``{patched: [rank 0 result, rank 1 result]}``."""
    results = run_ranks(axolotl_jobs.dora_cases, 2, CASES, timeout=300, pg_timeout=60)
    return {bool(patches): [results[0][i], results[1][i]] for i, (_, patches) in enumerate(CASES)}


def test_the_patch_of_the_model_carries_both_magnitude_readers():
    keys = {t.key for t in registry.patch(PATCH).targets}
    assert {t.key for t in ax_integration.TARGETS} <= keys


def test_axolotl_prepares_every_adapter_part_as_a_unit_of_its_own(dora):
    for r in dora[False] + dora[True]:
        assert r["prepared_by"] == "axolotl.monkeypatch.accelerate.fsdp2", r["prepared_by"]
        assert r["units"] == ["lora_A", "lora_B", "lora_embedding_layer", "lora_magnitude_vector"], r["units"]
        assert r["counts"] == {"attn_magnitude": 8, "mlp_magnitude": 6, "embed_magnitude": 1, "lora_ab": 28,
                               "embed_ab": 2}, r["counts"]


def test_unpatched_the_kernels_train_attention_and_embedding_dora_magnitudes_on_each_ranks_own_gradient(dora):
    for rank, r in enumerate(dora[False]):
        assert r["error"] is None, "rank %d: %s" % (rank, r["error"])
        first = r["by_step"][0]  # identical parameters: only the reads differ
        for group in TRAPPED:
            assert first[group] > 1e-3, (rank, group, first)
        for group in EXACT_UNPATCHED:
            assert first[group] < TOL, (rank, group, first)
    assert dora[False][0]["losses"] != dora[False][1]["losses"], "same data on both ranks"


def test_patched_every_adapter_gradient_is_the_data_parallel_average_over_two_steps(dora):
    for rank, r in enumerate(dora[True]):
        assert r["error"] is None, "rank %d: %s" % (rank, r["error"])
        assert len(r["by_step"]) == 2
        for step in r["by_step"]:  # the second step proves the DoRA norm cache is not reused across steps
            assert max(step.values()) < TOL, (rank, step)
        assert r["grad_err"] < TOL, "rank %d worst gradient %s: %.2e" % (rank, r["worst_grad"], r["grad_err"])
        assert r["loss_err"] < TOL and r["param_err"] < TOL, (rank, r["loss_err"], r["param_err"])
        assert r["grads_checked"] > 80
    assert dora[True][0]["losses"] != dora[True][1]["losses"], "same data on both ranks"
