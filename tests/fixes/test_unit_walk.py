"""The text-only dummy at the collectives' floor (issue #40): ``fixes.unit_walk`` on real FSDP2, CPU gloo.

A rank's first text-only micro-batch runs the real dummy media path and
records what its FSDP2 units did; later ones walk the units through their own
hooks without the tower's code.  Proven here:

- on a pure-torch toy, one rank, ``unit_walk.zero`` called directly: the walk
  issues the recorded collectives (unit, kind, parameters reduced) and gives the
  same parameters a gradient (an exact zero) as the dummy, and no other, a frozen
  block included; a record it cannot mirror (a unit called twice, a module called
  inside a unit that does not hold it) keeps the real dummy and says why; a record
  whose backward never came is made again; a forward without grad is recorded at
  once and walked without grad;
- on the tiny VLM families, sharded by a framework's own entry point
  (``mixed_jobs.generic_framework``), 2 ranks: an image micro-batch, the
  recorded dummy and the walk issue the same collective sequence, with gradient
  checkpointing off, reentrant and non-reentrant, and the walk calls no module of
  the tower but its units.

The gradient claim (2 ranks with different data, a walking text-only rank
beside an image rank, against the DP-average reference) is in
``tests/integrations/test_mixed_ranks.py`` and ``test_mixed_families.py``.
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")

from fsdp2_compat_harness.ranks import run_ranks  # noqa: E402
from support import mixed_jobs, walk_jobs  # noqa: E402

DEPENDS_ON = ("torch", "transformers")

_RESULTS = {}


def _toy(case):
    if "toy" not in _RESULTS:
        (_RESULTS["toy"],) = run_ranks(walk_jobs.toy_cases, 1, tuple(walk_jobs._MODES), timeout=120, pg_timeout=30)
    return _RESULTS["toy"][case]


@pytest.mark.xdist_group("unit-walk-toy")
def test_the_walk_issues_the_recorded_collectives_and_runs_none_of_the_tower():
    r = _toy("walk")
    assert r["walks"] == [0, 1, 1], r
    assert r["traces"][0] and r["traces"][1] == r["traces"][0] == r["traces"][2], r["traces"]
    assert r["tower_calls"][0] > 0 and r["tower_calls"][1:] == [0, 0], r["tower_calls"]
    assert r["why_not"] == [None, None, None], r


@pytest.mark.xdist_group("unit-walk-toy")
def test_the_walk_gives_the_recorded_parameters_a_zero_gradient_and_no_other():
    r = _toy("walk")
    record, walk = r["grads"][0], r["grads"][1]
    assert walk == record, (record, walk)
    # reached by the media path: an exact zero; never used (the blocks' spare, the root's unused): none
    assert walk["tower.0.lin.weight"] == 0.0 and walk["proj.weight"] == 0.0, walk
    assert walk["tower.0.spare.weight"] is None and walk["unused.weight"] is None, walk
    assert walk["text.weight"] > 0, walk


@pytest.mark.xdist_group("unit-walk-toy")
def test_a_frozen_block_is_walked_as_it_ran_without_a_gradient():
    r = _toy("frozen block")
    assert r["walks"] == [0, 1] and r["traces"][0] == r["traces"][1], r
    assert r["grads"][0] == r["grads"][1] and r["grads"][1]["tower.0.lin.weight"] is None, r["grads"]


@pytest.mark.xdist_group("unit-walk-toy")
@pytest.mark.parametrize("case,why", [("twice", "the media path calls FSDPBlock 2 times"),
                                      ("foreign", "FSDPBlock calls Linear, which it does not hold")])
def test_a_record_the_walk_cannot_mirror_keeps_the_real_dummy_and_says_why(case, why):
    r = _toy(case)
    assert r["walks"] == [0, 0], r
    assert r["why_not"] == [why, why], r
    assert r["tower_calls"][1] == r["tower_calls"][0] > 0 and r["traces"][1] == r["traces"][0], r


@pytest.mark.xdist_group("unit-walk-toy")
def test_a_record_whose_backward_never_came_is_made_again():
    r = _toy("no backward")
    assert r["walks"] == [0, 0, 1], r
    assert r["why_not"] == ["not recorded yet", None, None], r
    assert r["traces"][2] == r["traces"][1], r["traces"]


@pytest.mark.xdist_group("unit-walk-toy")
def test_without_grad_the_record_is_complete_at_once_and_walked_without_grad():
    r = _toy("no grad")
    assert r["walks"] == [0, 1, 0, 1], r  # the grad-on mode has a record of its own
    assert r["traces"][1] == r["traces"][0] and r["traces"][3] == r["traces"][2], r["traces"]
    assert not any(kind == "reduce-scatter" for kind, *_ in r["traces"][1]), r["traces"][1]


# ---------------------------------------------------------------------------
# the tiny VLM families, through a framework's own sharding

FRAMEWORK, NO_FRAMEWORK = mixed_jobs.generic_framework()
# gradient checkpointing modes on the three families every trainer runs; the others without
GC_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "glm4v")
FAMILIES = GC_FAMILIES + ("glm4v_moe", "glm46v", "qwen3_vl_moe", "lfm2_vl", "paddleocr_vl", "qwen2_audio", "voxtral",
                          "audioflamingo3", "hunyuan_vl", "cosmos3_edge", "chameleon", "glm_image")
# their media path calls one unit twice (a view, then a crop): recorded, not walked
NOT_WALKED = {"step3p7": "the media path calls FSDPStep3p7VisionEncoderLayer 2 times",
              "deepseek_ocr2": "the media path calls FSDPDeepseekOcr2SamVisionLayer 2 times"}
CONFIGS = [(f, None) for f in FAMILIES + tuple(NOT_WALKED)] + [(f, gc) for f in GC_FAMILIES
                                                                for gc in ("reentrant", "non-reentrant")]


def _runnable(family):
    from fsdp2_compat_harness import tiny

    if NO_FRAMEWORK:
        return NO_FRAMEWORK
    reason = tiny.unwrappable(family)
    return str(reason) if reason else mixed_jobs.cannot_wrap(FRAMEWORK, family)


def _families():
    if "families" not in _RESULTS:
        configs = [c for c in CONFIGS if _runnable(c[0]) is None]
        (_RESULTS["families"], _) = run_ranks(walk_jobs.family_traces, 2, FRAMEWORK, configs, timeout=600,
                                               pg_timeout=30)
    return _RESULTS["families"]


@pytest.mark.parametrize("family,gc", [pytest.param(f, gc, marks=pytest.mark.xdist_group("unit-walk-families"),
                                                    id="%s-%s" % (f, gc or "no-gc")) for f, gc in CONFIGS])
def test_image_dummy_and_walk_issue_the_same_collectives(family, gc):
    if _runnable(family):
        pytest.skip(_runnable(family))
    r = _families()[(family, gc)]
    assert "error" not in r, r
    image, recorded, walked = r["traces"]
    assert image and recorded == image, (image, recorded)
    assert walked == recorded, (recorded, walked)
    if family in NOT_WALKED:
        assert r["walks"] == [0, 0, 0] and r["why_not"] == NOT_WALKED[family], r
        return
    assert r["walks"] == [0, 0, 1] and r["why_not"] is None, r
    assert r["tower_calls"][1] > 0 and r["tower_calls"][2] == 0, r["tower_calls"]
