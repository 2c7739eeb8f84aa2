"""SkyRL's own FSDPStrategy + HFModelWrapper, end to end on 2 CPU gloo ranks.

``fsdp2_compat_harness.engines.skyrl_strategy``: the strategy and model wrapper
as SkyRL's FSDP policy worker drives them (meta init on rank 1, ``prepare``,
``backward`` per micro-batch, ``optimizer_step`` with SkyRL's AdamW), a tiny
model loaded from a saved directory, different data on each rank.  Unpatched,
the GLM family crashes with the exact upstream error and the controls train
correctly; patched, every gradient, the loss, the gradient norm and the
parameters after two steps match an unsharded reference trained on the
data-parallel average (fp32, 1e-5).  Generic over the installed ``skyrl``
(0.3.0 in tf5, 0.4.0 on Python 3.12).

Mixed text/image ranks (issue #20) through the same strategy: one rank's batch
text-only, the other's with images, then the reverse.  Without the family's
mixed-ranks targets the text-only rank skips the vision units' collectives and
gloo reports the mismatch (under a 20 s process-group timeout: never a hang);
with the whole patch both steps match the data-parallel reference.

Stand-ins (CUDA-bound only, see ``tooling/engines/cpu.py``): CPU copies of
SkyRL's three CUDA-only helpers, used only where the installed helpers are the
fingerprinted code they copy; ``flash_attn.bert_padding`` while
``model_wrapper`` imports.  Nothing fsdp2-compat patches is replaced.
"""

import os
import tempfile

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")

from fsdp2_compat import registry  # noqa: E402
from fsdp2_compat_harness import tiny as tiny_models  # noqa: E402
from fsdp2_compat_harness.engines import common, skyrl_strategy  # noqa: E402
from fsdp2_compat_harness.ranks import RankError, run_ranks  # noqa: E402
from support import mixed_jobs  # noqa: E402

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("torch", "transformers", "skyrl")

RUNNABLE = skyrl_strategy.unrunnable()
pytestmark = pytest.mark.skipif(RUNNABLE is not None, reason=str(RUNNABLE))

TOL = 1e-5
# How SkyRL's strategy fails unpatched (observed); absent: trains correctly as released.
UPSTREAM_FAILURE = {
    "glm4v": "step 0: RuntimeError: aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor",
    "glm4v_moe": "step 0: RuntimeError: aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor",
}
SKYRL_TARGET = "skyrl:skyrl.backends.skyrl_train.distributed.fsdp_utils.apply_fsdp2"
# SkyRL has no fused forwards: the wrap selection is all there is to fix.  GLM-4.1V / GLM-4.5V, and
# Qwen3-VL as the control whose own auxiliary embedding (pos_embed) is called as a module (its patch
# has no SkyRL target: a patched run would be the unpatched one).
SKYRL_FAMILIES = ("glm4v", "glm4v_moe", "qwen3_vl")


def _family(family):
    return pytest.param(family, marks=pytest.mark.wrappable(family))  # skips at setup unless tiny.wrappable


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("skyrl-strategy-models"))
    return lambda family: common.model_dir(family, root, tokenizer=False)


def _assert_matches(results):
    for rank, r in enumerate(results):
        assert r["error"] is None, "rank %d: %s" % (rank, r["error"])
        assert r["grads_checked"] > 0
        assert r["loss_err"] < TOL, (rank, r["losses"], r["loss_err"])
        assert r["grad_err"] < TOL, "rank %d worst gradient %s: %.2e" % (rank, r["worst_grad"], r["grad_err"])
        assert r["grad_norm_err"] < TOL and r["param_err"] < TOL, r
    assert results[0]["losses"] != results[1]["losses"]  # different data on each rank


@pytest.mark.parametrize("family", [_family(f) for f in SKYRL_FAMILIES])
def test_unpatched_strategy_fails_exactly_where_upstream_has_the_bug(model_dirs, family):
    results = run_ranks(skyrl_strategy.train_skyrl_strategy, 2, family, model_dirs(family), None, kwargs={"steps": 1})
    r = results[0]
    assert r["activation"]["requested"] == []
    expected = UPSTREAM_FAILURE.get(family)
    if expected is None:
        _assert_matches(results)
    else:
        assert "model.visual.embeddings.position_embedding" in r["units"], r["units"]
        assert r["error"] is not None and r["error"].startswith(expected), r["error"]


@pytest.mark.parametrize("family", [_family(f) for f in SKYRL_FAMILIES if f in UPSTREAM_FAILURE])
def test_patched_strategy_matches_the_dp_average(model_dirs, family):
    patch = registry.for_model_type(family).name
    results = run_ranks(skyrl_strategy.train_skyrl_strategy, 2, family, model_dirs(family), patch)
    _assert_matches(results)
    r = results[0]
    assert r["activation"]["outcomes"] == {SKYRL_TARGET: "applied"}, r["activation"]  # the wrap selection fixes it
    assert "model.visual.embeddings.position_embedding" not in r["units"], r["units"]


MIXED_FAMILY = "glm4v"
PG_TIMEOUT = 20
MISMATCH = "Received data size doesn't match expected size. Is there a distributed collective mismatch"


@pytest.mark.wrappable(MIXED_FAMILY)
def test_patched_strategy_trains_text_only_and_image_ranks_to_the_dp_average(model_dirs):
    patch = registry.for_model_type(MIXED_FAMILY).name
    results = run_ranks(skyrl_strategy.train_skyrl_strategy, 2, MIXED_FAMILY, model_dirs(MIXED_FAMILY), patch,
                        kwargs={"mixed": True})
    _assert_matches(results)
    # each rank was text-only on one of the two steps: one dummy vision forward per micro-batch of that step
    per_step = skyrl_strategy.SAMPLES_PER_RANK // skyrl_strategy.MICRO_BATCH
    assert [r["dummy_forwards"] for r in results] == [per_step, per_step]


@pytest.mark.wrappable(MIXED_FAMILY)
def test_without_the_mixed_ranks_targets_a_text_only_rank_breaks_the_strategy_step(model_dirs):
    patches = [registry.for_model_type(MIXED_FAMILY).name] + ["-" + t.key for t in registry.MIXED_MEDIA]
    with tempfile.TemporaryDirectory(prefix="skyrl_mixed_") as tmp:
        try:
            got = run_ranks(mixed_jobs.strategy_with_stderr_file, 2, tmp, MIXED_FAMILY, model_dirs(MIXED_FAMILY),
                            patches, kwargs={"mixed": True, "steps": 1}, timeout=PG_TIMEOUT + 60, retries=0,
                            pg_timeout=PG_TIMEOUT)
            outcomes = [r["error"] for r in got]
        except RankError as exc:
            outcomes = [exc.errors.get(rank, ("reported nothing else", ""))[0] for rank in range(2)]
        stderr = [open(os.path.join(tmp, "rank%d.err" % rank), errors="replace").read()
                  if os.path.exists(os.path.join(tmp, "rank%d.err" % rank)) else "" for rank in range(2)]
    assert any(MISMATCH in str(o) or MISMATCH in e for o, e in zip(outcomes, stderr)), (outcomes, stderr)
    assert not any(o is None for o in outcomes), outcomes  # no rank trained through it
