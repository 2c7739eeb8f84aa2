"""ms-swift 4.6.0 with ``--fsdp fsdp2``: its own loader and templates, a text-only rank against a media rank.

Through ms-swift's released code (``harness/fsdp2_compat_harness/engines/ms_swift.py``: its ``ModelLoader`` subclasses
build the model from a saved tiny checkpoint, its templates' ``register_post_encode_hook`` runs ``_post_encode``
before every forward) on accelerate's real FSDP2 preparation (``TRANSFORMER_BASED_WRAP``), 2 CPU gloo ranks,
different data per rank, against an unsharded reference loaded the same way and trained on the data-parallel average
(fp32, 1e-5).  Each step one rank has media (an image, or an image and a video) and the other is text-only.

- Qwen3-VL: the loader's ``_compat_qwen3_vl_mixed_data`` replaces the base model's instance ``forward`` and
  adds its own dummy image only under DeepSpeed; the template passes the media on.  Unpatched, the text-only
  rank skips every vision unit: gloo ``Received data size doesn't match expected size``.  Patched (its
  model's patch, ``qwen3vl``), requested before or after ms-swift loaded the model (a late request rebinds
  the saved ``origin_forward``, and ``status`` names it), exact, with one tower call per micro-batch on every
  rank, an image and a video on one rank included (``fixes.media_merge``).
- Qwen2.5-VL, GLM-4.1V and Qwen3.5 (a tiny Qwen3.5 built in ``tooling/engines/ms_swift.py``: ``tooling.tiny``
  has none): the template runs the tower itself on every micro-batch (a black image for a text-only one) and
  calls the model with ``inputs_embeds``.  Unpatched, exact (the template's own dummy keeps the ranks
  together); patched, exact too, and no second tower call: one per micro-batch on every rank from the second
  micro-batch on (the first one, before ``fixes.mixed_media`` counts the tower's calls, runs its dummy on
  every rank alike: two calls, the same on every rank).
"""

import os
import tempfile

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")
pytest.importorskip("accelerate", reason="needs accelerate (ms-swift's --fsdp fsdp2 prepares through it)")
pytest.importorskip("swift", reason="needs ms-swift (the code under test: set swift460)")

from fsdp2_compat import registry  # noqa: E402
from fsdp2_compat.core import guards  # noqa: E402
from fsdp2_compat.integrations import ms_swift  # noqa: E402
from fsdp2_compat_harness.ranks import RankError, run_ranks  # noqa: E402
from fsdp2_compat_harness.engines import ms_swift as swift_engine  # noqa: E402

DEPENDS_ON = ("torch", "transformers", "accelerate", "ms-swift")

SWIFT = guards.installed_version("ms-swift")
pytestmark = [
    pytest.mark.skipif(SWIFT != "4.6.0", reason="ms-swift %s: these proofs are of 4.6.0's code" % SWIFT),
    pytest.mark.xdist_group("ms_swift"),
]

TOL = 1e-5
MISMATCH = "Received data size doesn't match expected size"
STEPS = 3


def _patch(family):
    return registry.for_model_type(family).name


def _case(family, patched, **kw):
    return dict(family=family, patches=_patch(family) if patched else None, **kw)


CASES = {
    "qwen3_vl": _case("qwen3_vl", True),
    "qwen3_vl late": _case("qwen3_vl", True, late=True),
    "qwen3_vl image+video": _case("qwen3_vl", True, media=("image", "video")),
    "qwen2_5_vl unpatched": _case("qwen2_5_vl", False),
    "qwen2_5_vl": _case("qwen2_5_vl", True),
    "qwen2_5_vl image+video": _case("qwen2_5_vl", True, media=("image", "video")),
    "glm4v unpatched": _case("glm4v", False),
    "glm4v": _case("glm4v", True),
    "qwen3_5 unpatched": _case("qwen3_5", False),
    "qwen3_5": _case("qwen3_5", True),
    "qwen3_5 image+video": _case("qwen3_5", True, media=("image", "video")),
}
TEMPLATE_RUNS_TOWER = ("qwen2_5_vl", "glm4v", "qwen3_5")


@pytest.fixture(scope="module")
def swift():
    """Every case of ``CASES`` on one rank pair: ``{name: [rank 0 result, rank 1 result]}``."""
    names = list(CASES)
    with tempfile.TemporaryDirectory(prefix="fsdp2_compat_swift_") as tmp:
        results = run_ranks(swift_engine.swift_cases, 2, tmp, [CASES[n] for n in names], timeout=300, pg_timeout=60)
    return {n: [results[0][i], results[1][i]] for i, n in enumerate(names)}


def _exact(ranks):
    for rank, r in enumerate(ranks):
        assert r["error"] is None, "rank %d: %s" % (rank, r["error"])
        assert r["grads_checked"] > 100 and r["loss_err"] < TOL and r["param_err"] < TOL, r
        assert r["grad_err"] < TOL, (rank, r["worst_grad"], r["grad_err"])
        assert len(r["losses"]) == STEPS
    assert ranks[0]["losses"] != ranks[1]["losses"], "same data on both ranks"


def test_the_installed_ms_swift_has_the_code_each_recorded_path_was_proven_on():
    import importlib

    from fsdp2_compat.core import covered

    for path in ms_swift.PATHS:
        obj = importlib.import_module(path.module)
        for part in path.attr.split("."):
            obj = getattr(obj, part)
        obj = getattr(obj, "__wrapped__", obj)  # profiling_decorator: functools.wraps
        assert guards.fingerprint(obj) == path.fingerprints[SWIFT], path
    # what `status` says of them, read from the installed files without importing ms-swift
    rows = covered.rows([ms_swift.INTEGRATION])
    assert [r["path"] for r in rows] == ["%s.%s" % (p.module, p.attr) for p in ms_swift.PATHS]
    assert [r["outcome"] for r in rows] == ["proven"] * (len(rows) - 1) + ["proven broken"], rows
    assert all(r["detail"].startswith("code of %s: " % SWIFT) for r in rows), rows


def test_ms_swift_has_an_integration_and_no_target_of_its_own():
    from fsdp2_compat import integrations

    assert integrations.get("ms-swift") is ms_swift.INTEGRATION and ms_swift.TARGETS == ()
    assert not [t for t in registry.targets() if t.dist == "ms-swift"]


def test_unpatched_a_text_only_rank_breaks_qwen3_vl_under_ms_swifts_own_forward(tmp_path):
    case = _case("qwen3_vl", False)
    try:
        got = run_ranks(swift_engine.swift_cases, 2, str(tmp_path), [case], timeout=120, retries=0, pg_timeout=20)
        outcomes = [r[0]["error"] for r in got]
    except RankError as exc:
        outcomes = [exc.errors.get(rank, ("reported nothing else", ""))[0] for rank in range(2)]
    stderr = "".join((tmp_path / ("rank%d.err" % r)).read_text(errors="replace")
                     for r in range(2) if (tmp_path / ("rank%d.err" % r)).exists())
    assert any(MISMATCH in (o or "") for o in outcomes) or MISMATCH in stderr, (outcomes, stderr[-2000:])
    assert not any(o is None for o in outcomes), outcomes  # no rank trained through it


def test_ms_swifts_loader_replaces_the_qwen3_vl_instance_forward(swift):
    for name, ranks in swift.items():
        for r in ranks:
            assert r["origin_forward"] == name.startswith("qwen3_vl"), (name, r["loader"])
    assert {swift[n][0]["loader"] for n in CASES} == {"Qwen3VLLoader", "Qwen2_5VLLoader", "GLM4vLoader",
                                                      "Qwen3_5Loader"}


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("qwen3_vl")])
def test_patched_qwen3_vl_trains_to_the_data_parallel_average_with_one_tower_call_per_micro_batch(swift, name):
    """One tower call per micro-batch: the image's, or the text-only dummy's; a rank's later text-only
    micro-batches walk the dummy's units instead (fixes.unit_walk: no tower call, the same collectives)."""
    ranks = swift[name]
    _exact(ranks)
    for rank, r in enumerate(ranks):
        text_only_steps = [s for s in range(STEPS) if s % 2 != rank]
        assert r["tower_calls"] == [0 if s in text_only_steps[1:] else 1 for s in range(STEPS)], (rank, r)
        assert r["stats"]["dummy_forwards"] == len(text_only_steps), (rank, r["stats"])  # through origin_forward
        assert r["walks"] == len(text_only_steps) - 1, (rank, r["walks"])


def test_a_request_after_ms_swift_loaded_the_model_rebinds_its_saved_origin_forward_and_says_so(swift):
    for r in swift["qwen3_vl late"]:
        details = " ".join(row.get("detail") or "" for row in r["status_rows"])
        assert "Qwen3VLModel.origin_forward" in details, r["status_rows"]
    for r in swift["qwen3_vl"]:  # requested before the load: ms-swift saved the wrapper itself
        assert r["stats"]["dummy_forwards"] > 0


@pytest.mark.parametrize("family", TEMPLATE_RUNS_TOWER)
def test_unpatched_the_template_that_runs_the_tower_keeps_the_ranks_together(swift, family):
    ranks = swift[family + " unpatched"]
    _exact(ranks)
    for r in ranks:
        assert r["tower_calls"] == [1] * STEPS, r["tower_calls"]


@pytest.mark.parametrize("name", [n for n in CASES if n.split()[0] in TEMPLATE_RUNS_TOWER and "unpatched" not in n])
def test_patched_no_second_tower_call_where_the_template_ran_the_tower(swift, name):
    ranks = swift[name]
    _exact(ranks)
    for rank, r in enumerate(ranks):
        # the first micro-batch: the template's call and the fix's dummy, on every rank alike; then one
        assert r["tower_calls"] == [2] + [1] * (STEPS - 1), (rank, r["tower_calls"])
        assert r["stats"] == {"dummy_forwards": 1, "caller_ran_tower": STEPS - 1}, (rank, r["stats"])
