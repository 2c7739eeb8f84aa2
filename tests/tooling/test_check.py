"""``fsdp2-compat check``: the README's first command, on the installed stack."""

import json

import pytest

from fsdp2_compat import integrations
from fsdp2_compat.core import guards

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("torch", "transformers", "verl", "skyrl", "skyrl-train", "areal", "llamafactory", "trl", "accelerate")

# Frameworks with a wrap selection of their own (TRL leaves wrapping to accelerate: its rows are below).
FRAMEWORKS = [i.dist for i in integrations.wrapping() if guards.installed_version(i.dist)]
needs_framework = pytest.mark.skipif(not FRAMEWORKS, reason="no verl / SkyRL installed in this pinned set")


@needs_framework
def test_check_shows_the_crash_unpatched_and_the_fix_patched(python):
    proc = python(
        """
        import sys
        from fsdp2_compat.tooling import check
        check.engine_cases = lambda families=None: []  # the engine rows: the test below
        check.accelerate_cases = lambda families=None: []  # accelerate's rows: their own test
        from fsdp2_compat.cli import main
        sys.exit(main(["check", "--json", "--families", "glm4v,qwen2"]))
        """
    )
    report = json.loads(proc.stdout)
    assert report["failed"] == 0
    glm = [r for r in report["rows"] if r["family"] == "glm4v"]
    importable = {r["framework"] for r in report["rows"] if r["fixed"] is not None}
    assert importable, report["rows"]
    assert {r["framework"] for r in glm} == importable
    for row in glm:
        assert "aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor" in row["unpatched"], row
        assert row["patched"] == "ok" and row["loss_match"] and row["patch"] == "glm4v"


def _check_json(python, families):
    """``fsdp2-compat check --json --families FAMILIES`` in a fresh process of this set: the parsed report
    (only the JSON reaches stdout, or this fails)."""
    proc = python("import sys; from fsdp2_compat.cli import main; "
                  "sys.exit(main(['check', '--json', '--families', %r]))" % families)
    return json.loads(proc.stdout)


def _runnable_engines():
    from fsdp2_compat.tooling import check
    from fsdp2_compat.tooling.engines import skyrl_strategy, verl_engine

    harness = {"verl_engine": verl_engine, "skyrl_strategy": skyrl_strategy}
    return {kind: harness[name].runnable() for kind, (_, name, _) in check.ENGINES.items()}


def test_check_trains_glm4v_through_each_training_engine_installed(python):
    """The README's first command shows the whole path: verl's FSDP engine and SkyRL's strategy, where they run."""
    runnable = _runnable_engines()
    if not any(v is True for v in runnable.values()):
        pytest.skip("no training engine runs here: %s" % runnable)
    proc = python(
        """
        import sys
        from fsdp2_compat.tooling import check
        check.selection_cases = lambda families=None: []
        check.fused_cases = lambda families=None: []
        check.trl_cases = lambda families=None: []
        from fsdp2_compat.cli import main
        sys.exit(main(["check", "--json", "--families", "glm4v"]))
        """
    )
    report = json.loads(proc.stdout)  # the ranks' prints must not reach stdout
    assert report["failed"] == 0
    rows = {r["kind"]: r for r in report["rows"]}
    assert set(rows) == {kind for kind, ok in runnable.items() if ok is True}, (rows, runnable)
    for kind, row in rows.items():
        assert row["family"] == "glm4v" and row["patch"] == "glm4v", row
        assert row["unpatched"].startswith("step 0: RuntimeError: aten.grid_sampler_2d.default got mixed"), row
        # fp32's 1e-5, except verl 0.7.0's engine, which autocasts its forward to bf16 whatever the policy.
        bf16 = kind == "verl engine" and not guards.in_range(guards.installed_version("verl"), ">=0.8.0")
        assert row["tol"] == (1e-2 if bf16 else 1e-5), row
        assert row["patched"] == "ok" and row["fixed"] and row["loss_err"] < row["tol"], row


@needs_framework
def test_check_fails_when_a_patch_does_not_fix_its_case(python):
    # Pair GLM4V with a patch that does not touch the wrap selection: the
    # patched run still crashes, and check must say so with exit status 1.
    proc = python(
        """
        import sys
        from fsdp2_compat.tooling import check
        check.selection_cases = lambda families=None: [("glm4v", "qwen3vl")]
        check.fused_cases = lambda families=None: []
        check.engine_cases = lambda families=None: []
        from fsdp2_compat.cli import main
        sys.exit(main(["check", "--json", "--families", "glm4v"]))
        """,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["failed"] >= 1
    assert all("grid_sampler_2d" in r["patched"] for r in report["rows"] if r["fixed"] is False)
    # What upstream printed while the failing cases ran is kept, per case.
    assert all(set(r["output"]) == {"unpatched", "patched"} for r in report["rows"])


@pytest.mark.skipif(guards.installed_version("llamafactory") is None, reason="llamafactory not in this pinned set")
def test_check_rows_for_llamafactory_keep_its_log_and_show_the_layer_class_lookup_fixed(python):
    """LLaMA-Factory logs to a stdout handler of its own: captured per case, never in the JSON stream."""
    report = _check_json(python, "glm4v")
    [row] = [r for r in report["rows"] if r["framework"] == "llamafactory"]
    assert "aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor" in row["unpatched"], row
    assert row["patched"] == "ok" and row["loss_match"] and row["fixed"], row
    assert "Could not identify Transformer Layer class" in row["output"]["unpatched"], row["output"]
    assert "Applying per-layer FSDP to Glm4vVisionBlock" in row["output"]["patched"], row["output"]


VERL = guards.installed_version("verl")


@pytest.mark.skipif(VERL is None or not guards.in_range(VERL, ">=0.9.0"),
                    reason="plain full_tensor() (runs, unaveraged lm_head gradient) is verl >= 0.9 only")
def test_check_shows_the_unaveraged_gradient_on_two_ranks(python):
    report = _check_json(python, "qwen3_vl")  # the rank processes' prints must not reach stdout
    assert report["failed"] == 0
    [one_rank] = [r for r in report["rows"] if r["kind"] == "fused forward"]
    [two_ranks] = [r for r in report["rows"] if r["kind"] == "fused, 2 ranks"]
    assert one_rank["unpatched"] == "ok"  # one rank cannot see it ...
    assert "Monkey patch" in one_rank["output"]["unpatched"]  # verl's prints: captured, not on stdout
    assert two_ranks["unpatched"].startswith("runs, but the lm_head.weight gradient misses the data-parallel average")
    assert two_ranks["patched"] == "ok" and two_ranks["fixed"] and two_ranks["patch"] == "qwen3vl"  # ... two can


TRL = guards.installed_version("trl")


@pytest.mark.skipif(TRL is None or not guards.in_range(TRL, ">=1.16.0"),
                    reason="TRL's check rows need trl >= 1.16.0 (its fused head runs on CPU from 1.16.0)")
def test_check_shows_trls_unaveraged_lm_head_gradient_and_the_fix(python):
    from fsdp2_compat.tooling.check import TRL_KIND

    report = _check_json(python, "qwen3_vl")  # TRL's and the ranks' prints must not reach stdout
    assert report["failed"] == 0
    [row] = [r for r in report["rows"] if r["framework"] == "trl"]
    assert row["kind"] == TRL_KIND and row["version"] == TRL and row["patch"] == "qwen3vl"
    assert row["unpatched"].startswith("runs, but the lm_head.weight gradient misses the data-parallel average by")
    assert float(row["unpatched"].rsplit(" ", 1)[1]) > 1e-3
    assert row["patched"] == "ok" and row["loss_match"] and row["fixed"]


ACCELERATE = guards.installed_version("accelerate")


@pytest.mark.skipif(not guards.in_range(ACCELERATE or "0", ">=1.14.0,<=1.15.0"),
                    reason="accelerate's check rows need its tail unit (1.14.0-1.15.0)")
def test_check_shows_accelerates_tail_unit_bugs_and_the_fix(python):
    proc = python(
        """
        import sys
        from fsdp2_compat.tooling import check
        from fsdp2_compat.tooling import mixed
        for name in ("selection_cases", "fused_cases", "trl_cases", "engine_cases"):
            setattr(check, name, lambda families=None: [])
        mixed.cases = lambda versions, families=None: []  # the mixed-ranks rows: their own test
        from fsdp2_compat.cli import main
        sys.exit(main(["check", "--json", "--families", "qwen2_5_vl,qwen2"]))
        """
    )
    report = json.loads(proc.stdout)
    rows = {r["family"]: r for r in report["rows"] if r["framework"] == "accelerate"}
    assert report["failed"] == 0 and set(rows) == {"qwen2_5_vl", "qwen2"}, report["rows"]
    assert "aten.mm.default got mixed torch.Tensor and DTensor" in rows["qwen2_5_vl"]["unpatched"]
    tied = rows["qwen2"]["unpatched"]
    if guards.in_range(ACCELERATE, "==1.14.0"):
        assert "already managed by another FSDP group" in tied, tied
    else:
        assert tied == "ok", tied  # 1.15.0 carries the tied fix: nobody is told they have this bug
    assert all(r["patched"] == "ok" and r["loss_match"] and r["fixed"] for r in rows.values()), rows


@needs_framework
def test_check_shows_mixed_ranks_abort_unpatched_and_the_dp_average_patched(python):
    """rank 0 an image, rank 1 text only, through each wrapping framework (``tooling.mixed``)."""
    from fsdp2_compat.tooling import check, mixed

    report = _check_json(python, check.MIXED_FAMILY)
    rows = [r for r in report["rows"] if r["kind"] == check.MIXED_KIND]
    assert {r["framework"] for r in rows} == set(FRAMEWORKS), report["rows"]
    for row in rows:
        assert row["unpatched"].startswith("gloo: ") and mixed.GLOO_MISMATCH in row["unpatched"], row
        assert row["patched"] == "ok" and row["fixed"] and row["patch"] == "qwen2vl", row
