"""The collective guard (``FSDP2_COMPAT_GUARD=1``, ``fsdp2_compat.guard``) on real FSDP2, 2 CPU gloo ranks.

Three divergences, unpatched: rank 0 an image and rank 1 text only (the vision units skipped on rank 1),
rank 0 an image and a video and rank 1 an image (the tower twice on rank 0), and two ranks whose tokens reach
different MoE experts (transformers 4.x keeps experts as an ``nn.ModuleList`` and runs only the reached ones:
the decoder layer's reduce-scatter differs).  Guarded, both ranks raise ``GuardError`` in the same step,
within seconds, naming the unit, what each rank was about to do, the cause and the patch; unguarded, the same
scenario ends in gloo's ``Received data size doesn't match expected size``.  With a family's patch (its
accumulation fix wraps ``FSDPParamGroup.post_backward``) and the guard both on, deferred sync over mixed
micro-batches trains exactly as without the guard.  A short process-group timeout bounds every run.
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")

from support import guard_jobs  # noqa: E402

from fsdp2_compat_harness.ranks import RankError, run_ranks  # noqa: E402

DEPENDS_ON = ("torch", "transformers")

PG_TIMEOUT = 15
GLOO = "Received data size doesn't match expected size"


def _ranks(tmp_path, case, guard_on, patches=None):
    """Both ranks' results, or the ranks' stderr when gloo aborted them."""
    try:
        return run_ranks(guard_jobs.step, 2, str(tmp_path), case, guard_on, patches, pg_timeout=PG_TIMEOUT,
                         retries=0, timeout=PG_TIMEOUT + 120), None
    except RankError as exc:
        text = str(exc) + "".join((tmp_path / ("rank%d.err" % r)).read_text(errors="replace")
                                  for r in range(2) if (tmp_path / ("rank%d.err" % r)).exists())
        return None, text


def _moe_available():
    from fsdp2_compat_harness import tiny

    if "qwen3_moe" not in getattr(getattr(tiny, "moe", None), "CLASSES", {}):
        return "no tiny qwen3_moe in this checkout"
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return "transformers %s keeps experts as 3-D parameters: every rank has a gradient" % transformers.__version__
    return None


@pytest.mark.parametrize("case, unit, cause", [
    ("text-only", "model.visual.blocks.0", "skipped the media tower"),
    ("image+video", "model.visual.blocks.0", "a 2nd time"),
])
def test_a_tower_divergence_raises_on_every_rank_naming_the_unit(tmp_path, case, unit, cause):
    results, aborted = _ranks(tmp_path, case, guard_on=True)
    assert aborted is None, aborted
    for rank, r in enumerate(results):
        assert r["type"] == "GuardError", (rank, r)
        assert "unit %r" % unit in r["error"], r["error"]
        assert cause in r["error"], r["error"]
        assert "rank 0: all-gather of %s (forward" % unit in r["error"], r["error"]
        assert "fix: set FSDP2_COMPAT_PATCHES=qwen2vl" in r["error"], r["error"]
        assert "this is rank %d" % rank in r["error"]
        assert r["seconds"] < PG_TIMEOUT, r  # in the step, not after a collective timeout
    assert results[0]["error"].rsplit("\n", 1)[0] == results[1]["error"].rsplit("\n", 1)[0]


@pytest.mark.parametrize("case", ["text-only", "image+video"])
def test_the_same_tower_divergence_unguarded_is_glooss_size_mismatch(tmp_path, case):
    results, aborted = _ranks(tmp_path, case, guard_on=False)
    assert results is None and GLOO in aborted, (results, aborted)


def test_patched_the_guard_sees_no_divergence(tmp_path):
    results, aborted = _ranks(tmp_path, "text-only", guard_on=True, patches="qwen2vl")
    assert aborted is None, aborted
    assert [r["error"] for r in results] == [None, None], results
    assert all(r["checks"] > 0 for r in results), results  # the guard checked every unit collective


@pytest.mark.skipif(_moe_available() is not None, reason=str(_moe_available()))
def test_an_expert_no_token_reached_raises_naming_the_experts(tmp_path):
    results, aborted = _ranks(tmp_path, "experts", guard_on=True)
    assert aborted is None, aborted
    assert results[0]["experts"] != results[1]["experts"], results  # the ranks' expert sets differ
    for r in results:
        assert r["type"] == "GuardError", r
        assert "reduce-scatter of model.layers." in r["error"], r["error"]
        assert "MoE experts inside unit 'model.layers." in r["error"] or "MoE experts inside unit model.layers." \
            in r["error"], r["error"]
        assert ".mlp.experts." in r["error"], r["error"]
        assert r["seconds"] < PG_TIMEOUT, r


@pytest.mark.skipif(_moe_available() is not None, reason=str(_moe_available()))
def test_the_same_expert_skip_unguarded_is_glooss_size_mismatch(tmp_path):
    results, aborted = _ranks(tmp_path, "experts", guard_on=False)
    assert results is None and GLOO in aborted, (results, aborted)


def test_guard_and_the_accumulation_fix_compose():
    """Both wrap the path of a reduce-scatter (the fix ``post_backward``, the guard ``foreach_reduce``): with
    both on, deferred sync over mixed micro-batches gives exactly the gradients of the fix alone."""
    guarded = run_ranks(guard_jobs.accumulate, 2, True, "qwen2vl", pg_timeout=PG_TIMEOUT, timeout=300)
    plain = run_ranks(guard_jobs.accumulate, 2, False, "qwen2vl", pg_timeout=PG_TIMEOUT, timeout=300)
    from fsdp2_compat.core import guards

    # torch 2.15.0 rewrote accumulation: the fix declares itself not needed there and leaves post_backward alone
    fix_wraps = guards.in_range(guards.installed_version("torch"), "<2.15.0")
    for rank in range(2):
        assert guarded[rank]["wrapped"] == {"post_backward": "FunctionWrapper" if fix_wraps else "function",
                                            "foreach_reduce": True}
        assert plain[rank]["wrapped"]["foreach_reduce"] is False and plain[rank]["checks"] == 0
        assert guarded[rank]["checks"] > 0
        g, p = guarded[rank]["grads"], plain[rank]["grads"]
        assert g.keys() == p.keys()
        for name in g:
            assert (g[name] is None) == (p[name] is None), name
            if g[name] is not None:
                assert bool((g[name] == p[name]).all()), name
