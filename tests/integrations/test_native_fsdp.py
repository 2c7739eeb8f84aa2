"""transformers' native FSDP2 (``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))``).

The released ``apply_fully_sharded_data_parallelism`` shards tiny checkpoints on two CPU gloo ranks with
different data per rank, against an unsharded reference of the same checkpoint trained on the data-parallel
average (``native_scenarios``; fp32, 1e-5).  What each bug class does there (transformers 5.15.0+):

- class 2, a Liger-style ``lm_head.weight`` reader inside the forward, on Phi (final norm ``final_layernorm``: the
  head is a unit alone): unpatched ``aten.mm.default got mixed torch.Tensor and DTensor``; ``full_tensor()``: an
  unaveraged ``lm_head`` gradient; patched (``textlm``: ``tail_unit.native_apply_seam``) the unit is
  ``[lm_head, model.final_layernorm]`` and every gradient is exact;
- class 3, a text-only rank beside an image rank (Qwen2.5-VL, Qwen3-VL, GLM-4.1V, Qwen3.5: the tower in the root
  unit): unpatched gloo ``Received data size doesn't match expected size``; patched with the family's patch exact,
  with the dummy, and a walk of it on a rank's second text-only micro-batch;
- the catalogued VLMs' own head (in the root unit): a raw reader exact unpatched;
- class 1 (GLM-4.1V ``position_embedding``, default plan: in the root unit) and class 4 (Qwen3-MoE, 3-D experts,
  the ranks' tokens reaching different experts): exact unpatched;
- a user ``fsdp_plan`` (5.23.0+) that frees ``lm_head`` or names GLM-4.1V's ``position_embedding``: the crash,
  patched too (not covered: ``transformers_fsdp.PATHS``);
- HSDP (``dp_replicate_size=2, fsdp_size=1``, 5.23.0+): the same crash and fixes (Phi; a text-only replica);
  ``ep_size=2`` (5.19.0+, Qwen3-MoE's experts on their own mesh): exact unpatched;
- CPU offload, with the named stand-in ``unpinned_offload`` (``pin_memory=False``; the released pinned policy needs
  an accelerator): ``gather_param`` and the paired head exact, ``full_tensor()`` still unaveraged, the text-only
  dummy exact.  What only a GPU shows (devices) is ``benchmarks/gpu_check.py``'s.
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (its native FSDP2)")

from fsdp2_compat import registry  # noqa: E402
from fsdp2_compat.core import guards  # noqa: E402
from fsdp2_compat_harness import native_scenarios  # noqa: E402
from support import accum_jobs  # noqa: E402

DEPENDS_ON = ("torch", "transformers")

TRANSFORMERS = guards.installed_version("transformers")
pytestmark = [
    pytest.mark.skipif(not guards.in_range(TRANSFORMERS, ">=5.15.0"),
                       reason="transformers %s: native FSDP2 shards from 5.15.0" % TRANSFORMERS),
    pytest.mark.xdist_group("native_fsdp"),  # one rank pair serves the module's patched cases
]

TOL = 1e-5
MIXED = ("step 0: RuntimeError: aten.mm.default got mixed torch.Tensor and DTensor, need to convert all "
         "torch.Tensor to DTensor before calling distributed operators!")
GLOO = "Received data size doesn't match expected size"
VLMS = ("qwen2_5_vl", "qwen3_vl", "glm4v", "qwen3_5")
BUILD = {"qwen3_5": accum_jobs.tiny_qwen3_5}
# Rank 0 image / rank 1 text, the reverse, then rank 1 text again (its second text-only micro-batch: the walk).
MIXED_KINDS = (("image", "text"), ("text", "image"), ("image", "text"))
TWO = (("image", "image"), ("image", "image"))


def _vlm(family, **case):
    return dict(case, family=family, build=BUILD.get(family))


HEAD = {(read, patch, offload): dict(family="phi", read=read, patches=patch, offload=offload, kinds=TWO)
        for read, patch, offload in [("raw", None, None), ("full_tensor", None, None), ("raw", "textlm", None),
                                     ("full_tensor", "textlm", None), ("full_tensor", None, "unpinned"),
                                     ("raw", "textlm", "unpinned"), ("gather", None, "unpinned")]}
TEXT_ONLY = {f: _vlm(f, patches=registry.for_model_type(f).name, kinds=MIXED_KINDS) for f in VLMS}
TEXT_ONLY_OFFLOAD = _vlm("qwen3_vl", patches="qwen3vl", kinds=MIXED_KINDS, offload="unpinned")
RIGHT = {"glm4v": _vlm("glm4v", kinds=TWO), "qwen3_moe": dict(family="qwen3_moe", kinds=TWO)}
# The catalogued VLMs' default plans leave lm_head in the root unit (unsharded through the forward): a Liger-style
# reader of lm_head.weight, raw, is right as released (class 2 needs a head alone in its unit: Phi above).
VLM_READS = {f: _vlm(f, read="raw", kinds=TWO[:1]) for f in VLMS}
# 5.23.0+ take a user fsdp_plan: one that frees lm_head, or names GLM-4.1V's raw-read position_embedding, shards it
# as asked; the patches leave it (readers must use fsdp2_compat.gather_param).
USER_PLANS = guards.in_range(TRANSFORMERS, ">=5.23.0")
GLM_PLAN = {"model.visual.blocks.*": "free_full_weight",
            "model.visual.embeddings.position_embedding": "free_full_weight"}
AS_ASKED = {"phi": dict(family="phi", read="raw", patches="textlm", kinds=TWO[:1],
                        config={"fsdp_plan": {"lm_head": "free_full_weight"}}),
            "glm4v": _vlm("glm4v", patches="glm4v", kinds=TWO[:1], config={"fsdp_plan": GLM_PLAN})}
# HSDP (5.23.0+: dp_replicate_size; 2 ranks as 2 replicas of 1 shard) and experts on their own mesh (5.19.0+: ep_size)
HSDP_CONFIG = {"dp_replicate_size": 2, "fsdp_size": 1}
HSDP = {"phi raw": dict(family="phi", read="raw", kinds=TWO[:1], config=HSDP_CONFIG),
        "phi textlm": dict(family="phi", read="raw", patches="textlm", kinds=TWO, config=HSDP_CONFIG),
        "qwen2_5_vl": _vlm("qwen2_5_vl", patches="qwen2vl", kinds=MIXED_KINDS, config=HSDP_CONFIG)}
EXPERT_MESH = guards.in_range(TRANSFORMERS, ">=5.19.0")
EP = dict(family="qwen3_moe", kinds=TWO, config={"ep_size": 2})
CASES = list(HEAD.values()) + list(TEXT_ONLY.values()) + [TEXT_ONLY_OFFLOAD] + list(RIGHT.values())
CASES += list(VLM_READS.values())
CASES += list(AS_ASKED.values()) + list(HSDP.values()) if USER_PLANS else []
CASES += [EP] if EXPERT_MESH else []


@pytest.fixture(scope="module")
def ran():
    """Every non-aborting case on one rank pair: ``{id(case): [rank 0, rank 1]}``."""
    results, gloo, error = native_scenarios.collect(CASES, timeout=600)
    assert gloo is None and error is None, (gloo, error)
    return {id(c): r for c, r in zip(CASES, results)}


def _exact(results):
    for rank, r in enumerate(results):
        assert r["error"] is None, "rank %d: %s" % (rank, r["error"])
        assert r["loss_err"] < TOL and r["param_err"] < TOL, (rank, r["loss_err"], r["param_err"])
        assert r["grad_err"] < TOL, "rank %d worst gradient %s: %.2e" % (rank, r["worst_grad"], r["grad_err"])
        assert r["grads_checked"] > 10, r["grads_checked"]
    assert results[0]["losses"] != results[1]["losses"], "same data on both ranks"


def _print(name, results):
    r = results[0]
    print("transformers %s native FSDP2 %s: error=%s lm_head grad err %s worst grad %s %.3g; head unit %s" % (
        TRANSFORMERS, name, r["error"], ", ".join("%.3g" % x.get("lm_head_grad_err", 0) for x in results),
        r.get("worst_grad"), r.get("grad_err", 0), r.get("head_unit")))


def test_unpatched_head_reader_crashes_in_a_lone_head_unit(ran):
    results = ran[id(HEAD["raw", None, None])]
    _print("phi raw", results)
    for r in results:
        assert r["error"] == MIXED, r["error"]
        assert r["head_unit"] == ["lm_head"], r["head_unit"]  # no norm called "norm": the head alone


@pytest.mark.parametrize("offload", [None, "unpinned"])
def test_unpatched_full_tensor_reader_trains_lm_head_on_one_rank(ran, offload):
    results = ran[id(HEAD["full_tensor", None, offload])]
    _print("phi full_tensor offload=%s" % offload, results)
    for r in results:
        assert r["error"] is None and r["worst_grad"] == "lm_head.weight", r
        assert r["lm_head_grad_err"] > 1e-2, r["lm_head_grad_err"]  # measured 0.08 on 5.16.1


@pytest.mark.parametrize("read,offload", [("raw", None), ("full_tensor", None), ("raw", "unpinned")])
def test_patched_head_joins_the_final_norm_and_trains_exactly(ran, read, offload):
    results = ran[id(HEAD[read, "textlm", offload])]
    _print("phi %s textlm offload=%s" % (read, offload), results)
    _exact(results)
    for r in results:
        assert r["head_unit"] == ["lm_head", "model.final_layernorm"], r["head_unit"]
        assert r["native_pairs"] == 1, r["native_pairs"]
        assert r["shard_device"] == "cpu"


def test_gather_param_under_offload_is_exact(ran):
    results = ran[id(HEAD["gather", None, "unpinned"])]
    _print("phi gather_param offload", results)
    _exact(results)


@pytest.mark.parametrize("family", VLMS)
def test_patched_text_only_rank_trains_exactly(ran, family):
    results = ran[id(TEXT_ONLY[family])]
    _print("%s text-only rank, %s" % (family, TEXT_ONLY[family]["patches"]), results)
    _exact(results)
    assert [r["dummy_forwards"] for r in results] == [1, 2], results  # one per text-only micro-batch ...
    assert [r["walks"] for r in results] == [0, 1], results  # ... rank 1's second one walked
    assert "lm_head" not in results[0]["wrapped"], results[0]["wrapped"]  # tower and head in the root unit


def test_patched_text_only_rank_under_offload_is_exact(ran):
    results = ran[id(TEXT_ONLY_OFFLOAD)]
    _print("qwen3_vl text-only rank, offload", results)
    _exact(results)
    assert [r["dummy_forwards"] for r in results] == [1, 2] and results[0]["shard_device"] == "cpu", results


@pytest.mark.parametrize("family", sorted(RIGHT))
def test_right_as_released(ran, family):
    """GLM-4.1V's position_embedding (class 1) and Qwen3-MoE's 3-D experts (class 4) under the default plans."""
    results = ran[id(RIGHT[family])]
    _print("%s unpatched" % family, results)
    _exact(results)
    if family == "qwen3_moe":  # the ranks' tokens reached different experts: what breaks transformers 4.x
        from fsdp2_compat_harness.moe_scenarios import differing_experts

        assert differing_experts(results), [r["hits"] for r in results]


@pytest.mark.parametrize("family", VLMS)
def test_a_vlm_head_reader_is_right_as_released(ran, family):
    results = ran[id(VLM_READS[family])]
    _print("%s raw lm_head reader, unpatched" % family, results)
    _exact(results)
    assert "lm_head" not in results[0]["wrapped"], results[0]["wrapped"]  # the head in the root unit


@pytest.mark.parametrize("family", VLMS)
def test_unpatched_text_only_rank_aborts_gloo(family):
    """The same steps unpatched: the root unit's reduce-scatter is shorter on the text-only rank."""
    case = dict(TEXT_ONLY[family], patches=None, kinds=MIXED_KINDS[:1])
    results, gloo, _ = native_scenarios.collect([case], pg_timeout=20, timeout=200)
    print("transformers %s native FSDP2 %s unpatched text-only rank: %s" % (TRANSFORMERS, family, gloo))
    assert results == [None] and gloo is not None and GLOO in gloo, (results, gloo)


@pytest.mark.skipif(not USER_PLANS, reason="transformers %s: a user fsdp_plan arrived in 5.23.0" % TRANSFORMERS)
@pytest.mark.parametrize("family", sorted(AS_ASKED))
def test_a_user_plan_that_shards_a_raw_read_is_not_covered(ran, family):
    """What ``transformers_fsdp.PATHS`` records as not covered: the plan's unit, the reader's crash, patched."""
    results = ran[id(AS_ASKED[family])]
    _print("%s user plan %s" % (family, AS_ASKED[family]["config"]["fsdp_plan"]), results)
    op = "aten.mm.default" if family == "phi" else "aten.grid_sampler_2d.default"
    for r in results:
        assert r["error"] == MIXED.replace("aten.mm.default", op), r["error"]
        assert r["native_pairs"] == 0, r  # a freed head is left as asked


@pytest.mark.skipif(not USER_PLANS, reason="transformers %s: dp_replicate_size (HSDP) arrived in 5.23.0" % TRANSFORMERS)
def test_hsdp_keeps_the_bugs_and_the_fixes(ran):
    """``dp_replicate_size=2, fsdp_size=1``: Phi's lone head still crashes a raw reader unpatched and trains exactly
    patched; a text-only replica beside an image replica trains exactly patched (unpatched: the next test)."""
    for r in ran[id(HSDP["phi raw"])]:
        assert r["error"] == MIXED and r["head_unit"] == ["lm_head"], r
    for key in ("phi textlm", "qwen2_5_vl"):
        results = ran[id(HSDP[key])]
        _print("HSDP %s" % key, results)
        _exact(results)
    assert [r["walks"] for r in ran[id(HSDP["qwen2_5_vl"])]] == [0, 1]


@pytest.mark.skipif(not USER_PLANS, reason="transformers %s: dp_replicate_size (HSDP) arrived in 5.23.0" % TRANSFORMERS)
def test_unpatched_text_only_replica_aborts_gloo_under_hsdp():
    case = dict(HSDP["qwen2_5_vl"], patches=None, kinds=MIXED_KINDS[:1])
    results, gloo, _ = native_scenarios.collect([case], pg_timeout=20, timeout=200)
    assert results == [None] and gloo is not None and GLOO in gloo, (results, gloo)


@pytest.mark.skipif(not EXPERT_MESH, reason="transformers %s: ep_size arrived in 5.19.0" % TRANSFORMERS)
def test_experts_on_their_own_mesh_are_right_as_released(ran):
    """``ep_size=2``: Qwen3-MoE's experts dispatched to their own mesh (all-to-all), ranks reaching different experts:
    exact unpatched (3-D experts: every rank has every gradient)."""
    from fsdp2_compat_harness.moe_scenarios import differing_experts

    results = ran[id(EP)]
    _print("qwen3_moe ep_size=2", results)
    _exact(results)
    assert differing_experts(results), [r["hits"] for r in results]
