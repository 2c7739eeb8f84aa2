"""LoRA adapters on a VLM under FSDP2 (issue #42 item 5): the four bug classes with the base model, tower included,
frozen by PEFT; real FSDP2, 2 CPU gloo ranks with different data, against the unsharded LoRA model trained on
the data-parallel average.

- class 1: GLM-4.1V's frozen tower still reads its ``position_embedding`` raw: through verl's / SkyRL's
  ``apply_fsdp2`` the same ``aten.grid_sampler_2d`` crash as without adapters; ``glm4v`` exact;
- class 3: a frozen tower still all-gathers: a text-only rank beside an image rank aborts gloo; ``qwen2vl``
  exact (the text-only rank's second micro-batch walks the dummy's units, forward collectives only);
- class 4: LoRA on every expert (transformers 4.x: only the experts a token reaches run): gloo aborts; ``moe``
  exact, the ranks' experts asserted to differ;
- class 2: verl's fused forwards (0.7.1+, ``lm_head`` its own unit) still read the frozen head raw: the same
  ``aten.mm`` crash (Qwen2.5-VL); ``qwen2vl`` exact.  The head is frozen under LoRA, so verl 0.9's plain
  ``full_tensor()`` (Qwen3-VL) has no gradient to average: exact unpatched, and patched.

pytorch #186998: a unit whose first forward runs with every parameter frozen (a LoRA warm-up with the tower
frozen) initialises no reduce dtype; unfrozen later, torch 2.8-2.13 raise ``attempting to assign a gradient with
dtype 'c10::BFloat16' to a tensor with grad_dtype 'Float'`` in its first backward (bf16 parameters, fp32 reduce);
torch 2.14.0+ take the dtypes from the parameters, and every multimodal patch applies that rule before
(``fixes/frozen_units.py``): the vision gradients then match the unsharded model's within bf16 tolerance.
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")
pytest.importorskip("peft", reason="needs peft (LoRA adapters)")

from fsdp2_compat.core import guards  # noqa: E402
from fsdp2_compat_harness import lora  # noqa: E402
from fsdp2_compat_harness.ranks import RankError, run_ranks  # noqa: E402
from support import accum_jobs, lora_jobs, moe_jobs  # noqa: E402

DEPENDS_ON = ("torch", "transformers", "peft", "verl", "skyrl")

MISMATCH = "Received data size doesn't match expected size"
# One wrapping framework: the classes act on FSDP2's units whoever makes them (each framework's own proofs without
# adapters are in test_wrap_selection, test_mixed_ranks and test_moe_experts); the first installed of these.
FRAMEWORK = next((f for f in ("verl", "skyrl") if guards.installed_version(f)), None)
FRAMEWORKS = [pytest.param(FRAMEWORK, marks=pytest.mark.skipif(FRAMEWORK is None, reason="neither verl nor skyrl "
                                                                "in this pinned set"))]
TRANSFORMERS = guards.installed_version("transformers")
TORCH = guards.installed_version("torch")
_RESULTS = {}


def _mixed(framework, patches, tmp_path):
    tmp_path.mkdir()
    try:
        return run_ranks(lora_jobs.mixed, 2, framework, patches, str(tmp_path), timeout=180, retries=0,
                         pg_timeout=20)
    except RankError as exc:
        errors = [exc.errors.get(r, ("", ""))[0] for r in range(2)]
        stderr = "".join(p.read_text(errors="replace") for p in tmp_path.glob("rank*.err"))
        return {"died": errors, "stderr": stderr}


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_class_1_a_frozen_tower_still_reads_its_position_embedding_raw(framework):
    unpatched = run_ranks(lora_jobs.selection, 2, framework, None)
    assert all("aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor" in (r["error"] or "")
               for r in unpatched), unpatched
    patched = run_ranks(lora_jobs.selection, 2, framework, ["glm4v"])
    for rank, r in enumerate(patched):
        accum_jobs.assert_close(r, "fp32", "%s GLM-4.1V LoRA rank %d" % (framework, rank))
        assert r["grads_checked"] > 0, r  # the adapters' gradients, against the reference's


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_class_3_a_frozen_tower_still_all_gathers_and_the_text_only_rank_walks_it(framework, tmp_path):
    unpatched = _mixed(framework, None, tmp_path / "unpatched")
    assert isinstance(unpatched, dict) and MISMATCH in unpatched["stderr"] + " ".join(unpatched["died"]), unpatched
    patched = _mixed(framework, ["qwen2vl"], tmp_path / "patched")
    assert isinstance(patched, list), patched
    for rank, r in enumerate(patched):
        accum_jobs.assert_close(r, "fp32", "%s Qwen2.5-VL LoRA, mixed ranks, rank %d" % (framework, rank))
    # rank 1 text-only on both steps: the dummy recorded, then walked (its frozen tower: forward collectives only)
    assert [(r["dummy_forwards"], r["walks"]) for r in patched] == [(0, 0), (2, 1)], patched


VERL = guards.installed_version("verl")


@pytest.mark.skipif(not VERL or not guards.in_range(VERL, ">=0.7.1"),
                    reason="verl %s: lm_head shares the root unit (verl < 0.7.1), or no verl" % VERL)
@pytest.mark.parametrize("family, patch", [pytest.param("qwen2_5_vl", "qwen2vl", marks=pytest.mark.wrappable("qwen2_5_vl")),
                                           pytest.param("qwen3_vl", "qwen3vl", marks=pytest.mark.wrappable("qwen3_vl"))])
def test_class_2_verl_fused_forwards_read_the_frozen_head_raw(family, patch):
    unpatched = run_ranks(lora_jobs.fused, 2, family, None)
    if family == "qwen3_vl" and guards.in_range(VERL, ">=0.9.0"):  # plain full_tensor(): a frozen head, nothing lost
        for rank, r in enumerate(unpatched):
            _assert_fused_exact(r, "verl %s Qwen3-VL LoRA unpatched rank %d" % (VERL, rank))
    else:
        assert all("aten.mm.default got mixed torch.Tensor and DTensor" in (r["error"] or "") for r in unpatched), \
            unpatched
    for rank, r in enumerate(run_ranks(lora_jobs.fused, 2, family, [patch])):
        _assert_fused_exact(r, "verl %s %s LoRA fused rank %d" % (VERL, family, rank))


def _assert_fused_exact(r, where):
    """``train_fused``'s result equals the unsharded LoRA model's on the DP average (fp32), adapters trained."""
    assert r["error"] is None, (where, r["error"])
    assert r["loss_err"] < accum_jobs.TOL and r["logprob_err"] < accum_jobs.TOL and r["param_err"] < accum_jobs.TOL, \
        (where, r)
    assert r["grad_err"] < accum_jobs.TOL, (where, r["worst_grad"], r["grad_err"])
    assert r["grads_checked"] > 0, (where, r)  # the adapters' gradients (every base parameter is frozen)


@pytest.mark.skipif(not TRANSFORMERS or not guards.in_range(TRANSFORMERS, "<5.0.0rc0"),
                    reason="transformers %s keeps 3-D experts: every rank has every gradient" % TRANSFORMERS)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_class_4_lora_on_experts_no_token_reached_aborts_unpatched_and_is_exact_patched(framework):
    results, stderr, differ = moe_jobs.run(framework, "qwen3_moe", None, fn=lora_jobs.moe)
    assert differ, "the ranks' tokens reached the same experts: nothing to prove"
    assert results is None and any(MISMATCH in s for s in stderr), stderr
    results, _, differ = moe_jobs.run(framework, "qwen3_moe", ["moe"], fn=lora_jobs.moe)
    assert differ and results is not None
    for rank, r in enumerate(results):
        accum_jobs.assert_close(r, "fp32", "%s Qwen3-MoE LoRA experts rank %d" % (framework, rank))


@pytest.mark.depends_on("torch", "peft")
def test_pytorch_186998_a_unit_first_run_frozen_fails_when_unfrozen_and_is_right_patched():
    (r, _) = run_ranks(lora.unfreeze, 2, "fully_shard", None)
    if guards.in_range(TORCH, ">=2.8.0,<2.14.0"):
        assert r["error"] and r["error"].startswith("step 1: RuntimeError: attempting to assign a gradient with "
                                                    "dtype 'c10::BFloat16' to a tensor with grad_dtype 'Float'"), r
    else:
        assert r["error"] is None, r
    for rank, r in enumerate(run_ranks(lora.unfreeze, 2, "fully_shard", ["qwen2vl"])):
        assert r["error"] is None and r["vision_grad_dtypes"] == ["torch.float32"], (rank, r)
        # bf16 compute against the fp32 reference: accum_jobs' bf16 bound relative to the largest gradient
        assert r["vision_rel_to_max"] < accum_jobs.BF16_REL_TO_MAX, (rank, r)
