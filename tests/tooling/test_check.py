"""``fsdp2-compat check``: the README's first command, on the installed stack.

The command runs once per pinned set, exactly as the README gives it
(``fsdp2-compat check --json``: every family, every installed framework, no
downloads), in a fresh interpreter; the tests below read its rows.  One run
instead of one per test: each run pays a fresh interpreter and rank server
(~10 s of CPU), and the full command is what users run.  The tests share
one xdist group so that one worker holds the report.
"""

import json

import pytest

from fsdp2_compat import integrations
from fsdp2_compat.core import guards

pytest.importorskip("fsdp2_compat_harness", reason="needs the harness (check itself)")

from fsdp2_compat_harness.check import divergence as divergence_check  # noqa: E402

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("torch", "transformers", "verl", "skyrl", "skyrl-train", "areal", "llamafactory", "trl", "accelerate",
              "axolotl", "ms-swift", "liger-kernel")

pytestmark = pytest.mark.xdist_group("check")  # one worker runs the command; every test reads its report

# Frameworks with a wrap selection of their own (TRL leaves wrapping to accelerate: its rows are below).
FRAMEWORKS = [i.dist for i in integrations.wrapping() if guards.installed_version(i.dist)]
needs_framework = pytest.mark.skipif(not FRAMEWORKS, reason="no verl / SkyRL installed in this pinned set")


@pytest.fixture(scope="module")
def report(warm_python):
    """The parsed ``fsdp2-compat check --json`` of this set (only the JSON reaches stdout, or this fails)."""
    pytest.importorskip("torch", reason="check needs torch")
    proc = warm_python("import sys; from fsdp2_compat.cli import main; sys.exit(main(['check', '--json']))",
                  check=False, timeout=900)
    try:
        parsed = json.loads(proc.stdout)
    except ValueError:
        raise AssertionError("check's stdout is not one JSON document (exit %d):\n%s\n%s"
                             % (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:]))
    parsed["returncode"] = proc.returncode
    return parsed


def _rows(report, **match):
    return [r for r in report["rows"] if all(r[k] == v for k, v in match.items())]


def test_check_passes_on_this_stack_and_says_what_it_checked(report):
    """The README's first command: exit 0, no case its patch leaves broken, a row for every installed framework."""
    assert report["returncode"] == 0 and report["failed"] == 0, [r for r in report["rows"] if r["fixed"] is False]
    assert not any(r["fixed"] is False for r in report["rows"])
    selection = {r["framework"] for r in report["rows"] if r["kind"] == "selection"}
    assert selection == set(FRAMEWORKS), (selection, FRAMEWORKS)
    if (not FRAMEWORKS and not (TRL and guards.in_range(TRL, ">=1.16.0")) and not _accelerate_rows_expected()
            and not _axolotl_rows_expected() and not _ms_swift_rows_expected()):
        # only the audit's divergence rows, which need transformers alone (divergence_check)
        assert {r["kind"] for r in report["rows"]} <= {divergence_check.KIND}, report["rows"]
    else:
        assert report["rows"], "check found nothing to run on this stack"
    for row in report["rows"]:
        assert set(row["output"]) == {"unpatched", "patched"}, row  # what upstream printed, kept per case


@needs_framework
def test_check_shows_the_crash_unpatched_and_the_fix_patched(report):
    glm = _rows(report, family="glm4v", kind="selection")
    importable = {r["framework"] for r in report["rows"] if r["kind"] == "selection" and r["fixed"] is not None}
    assert importable, report["rows"]
    assert {r["framework"] for r in glm} == importable
    for row in glm:
        assert "aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor" in row["unpatched"], row
        assert row["patched"] == "ok" and row["loss_match"] and row["patch"] == "glm4v"


def _runnable_engines():
    from fsdp2_compat_harness.check import engines
    from fsdp2_compat_harness.engines import skyrl_strategy, verl_engine

    harness = {"verl_engine": verl_engine, "skyrl_strategy": skyrl_strategy}
    return {kind: harness[name].unrunnable() for kind, (_, name, _) in engines.ENGINES.items()}


def test_check_trains_glm4v_through_each_training_engine_installed(report):
    """The README's first command shows the whole path: verl's FSDP engine and SkyRL's strategy, where they run."""
    from fsdp2_compat_harness.check import engines

    unrunnable = _runnable_engines()
    if not any(v is None for v in unrunnable.values()):
        pytest.skip("no training engine runs here: %s" % unrunnable)
    rows = {r["kind"]: r for r in report["rows"] if r["kind"] in engines.ENGINES}
    assert set(rows) == {kind for kind, why in unrunnable.items() if why is None}, (rows, unrunnable)
    for kind, row in rows.items():
        assert row["family"] == "glm4v" and row["patch"] == "glm4v", row
        assert row["unpatched"].startswith("step 0: RuntimeError: aten.grid_sampler_2d.default got mixed"), row
        # fp32's 1e-5, except verl 0.7.0's engine, which autocasts its forward to bf16 whatever the policy.
        bf16 = kind == "verl engine" and not guards.in_range(guards.installed_version("verl"), ">=0.8.0")
        assert row["tol"] == (1e-2 if bf16 else 1e-5), row
        assert row["patched"] == "ok" and row["fixed"] and row["loss_err"] < row["tol"], row


# Where it runs: check's exit status does not depend on the stack, only on a framework that can run
# GLM-4.1V's selection case being installed: once per verl release (sets tf4, tf5, tf5rc) is enough.
@pytest.mark.depends_on("torch", "verl")
@needs_framework
def test_check_fails_when_a_patch_does_not_fix_its_case(warm_python):
    # Pair GLM4V with a patch that does not touch the wrap selection: the
    # patched run still crashes, and check must say so with exit status 1.
    proc = warm_python(
        """
        import sys
        from fsdp2_compat_harness.check import engines, fused, selection
        selection.selection_cases = lambda families=None: [("glm4v", "qwen3vl")]
        fused.fused_cases = lambda families=None: []
        engines.engine_cases = lambda families=None: []
        from fsdp2_compat.cli import main
        sys.exit(main(["check", "--json", "--families", "glm4v"]))
        """,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    failing = json.loads(proc.stdout)
    assert failing["failed"] >= 1
    assert all("grid_sampler_2d" in r["patched"] for r in failing["rows"] if r["fixed"] is False)
    # What upstream printed while the failing cases ran is kept, per case.
    assert all(set(r["output"]) == {"unpatched", "patched"} for r in failing["rows"])


@pytest.mark.skipif(guards.installed_version("llamafactory") is None, reason="llamafactory not in this pinned set")
def test_check_rows_for_llamafactory_keep_its_log_and_show_the_layer_class_lookup_fixed(report):
    """LLaMA-Factory logs to a stdout handler of its own: captured per case, never in the JSON stream."""
    [row] = _rows(report, framework="llamafactory", family="glm4v", kind="selection")
    assert "aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor" in row["unpatched"], row
    assert row["patched"] == "ok" and row["loss_match"] and row["fixed"], row
    if guards.in_range(guards.installed_version("transformers"), "<5.0.0rc0"):
        # 4.x gives _no_split_modules as a list: LLaMA-Factory's own lookup finds the layer class unpatched
        assert "Applying per-layer FSDP to Glm4vVisionBlock" in row["output"]["unpatched"], row["output"]
    else:
        assert "Could not identify Transformer Layer class" in row["output"]["unpatched"], row["output"]
    assert "Applying per-layer FSDP to Glm4vVisionBlock" in row["output"]["patched"], row["output"]


VERL = guards.installed_version("verl")


@pytest.mark.skipif(VERL is None or not guards.in_range(VERL, ">=0.9.0"),
                    reason="plain full_tensor() (runs, unaveraged lm_head gradient) is verl >= 0.9 only")
def test_check_shows_the_unaveraged_gradient_on_two_ranks(report):
    [one_rank] = _rows(report, family="qwen3_vl", kind="fused forward")
    [two_ranks] = _rows(report, family="qwen3_vl", kind="fused, 2 ranks")
    assert one_rank["unpatched"] == "ok"  # one rank cannot see it ...
    assert "Monkey patch" in one_rank["output"]["unpatched"]  # verl's prints: captured, not on stdout
    assert two_ranks["unpatched"].startswith("runs, but the lm_head.weight gradient misses the data-parallel average")
    assert two_ranks["patched"] == "ok" and two_ranks["fixed"] and two_ranks["patch"] == "qwen3vl"  # ... two can


TRL = guards.installed_version("trl")


@pytest.mark.skipif(TRL is None or not guards.in_range(TRL, ">=1.16.0"),
                    reason="TRL's check rows need trl >= 1.16.0 (its fused head runs on CPU from 1.16.0)")
def test_check_shows_trls_unaveraged_lm_head_gradient_and_the_fix(report):
    from fsdp2_compat_harness.check.trl import KIND as TRL_KIND

    [row] = _rows(report, framework="trl", family="qwen3_vl")  # TRL's and the ranks' prints stay off stdout
    assert row["kind"] == TRL_KIND and row["version"] == TRL and row["patch"] == "qwen3vl"
    assert row["unpatched"].startswith("runs, but the lm_head.weight gradient misses the data-parallel average by")
    assert float(row["unpatched"].rsplit(" ", 1)[1]) > 1e-3
    assert row["patched"] == "ok" and row["loss_match"] and row["fixed"]


ACCELERATE = guards.installed_version("accelerate")


def _accelerate_rows_expected():
    return guards.in_range(ACCELERATE or "0", ">=1.14.0,<=1.15.0")


@pytest.mark.skipif(not _accelerate_rows_expected(), reason="accelerate's check rows need its tail unit (1.14.0-1.15.0)")
def test_check_shows_accelerates_tail_unit_bugs_and_the_fix(report):
    from fsdp2_compat_harness.check.accelerate import CASES as ACC_CASES

    rows = {r["family"]: r for r in _rows(report, framework="accelerate") if r["kind"] in {k for _, _, k in ACC_CASES}}
    assert set(rows) == {"qwen2_5_vl", "qwen2"}, report["rows"]
    assert "aten.mm.default got mixed torch.Tensor and DTensor" in rows["qwen2_5_vl"]["unpatched"]
    tied = rows["qwen2"]["unpatched"]
    if guards.in_range(ACCELERATE, "==1.14.0"):
        assert "already managed by another FSDP group" in tied, tied
    else:
        assert tied == "ok", tied  # 1.15.0 carries the tied fix: nobody is told they have this bug
    assert all(r["patched"] == "ok" and r["loss_match"] and r["fixed"] for r in rows.values()), rows


@needs_framework
def test_check_shows_mixed_ranks_abort_unpatched_and_the_dp_average_patched(report):
    """rank 0 an image, rank 1 text only, through each wrapping framework (``tooling.mixed``)."""
    from fsdp2_compat_harness import mixed
    from fsdp2_compat_harness.check import mixed_ranks

    rows = _rows(report, kind=mixed_ranks.KIND)
    assert {r["framework"] for r in rows} == set(FRAMEWORKS), report["rows"]
    for row in rows:
        assert row["family"] == mixed_ranks.FAMILY, row
        assert row["unpatched"].startswith("gloo: ") and mixed.GLOO_MISMATCH in row["unpatched"], row
        assert row["patched"] == "ok" and row["fixed"] and row["patch"] == "qwen2vl", row


def _axolotl_rows_expected():
    from fsdp2_compat_harness.check import axolotl

    return {kind for kind, _, _ in axolotl.cases()}


@pytest.mark.skipif(not _axolotl_rows_expected(), reason="no axolotl release its targets cover (set tf516)")
def test_check_shows_axolotls_unaveraged_dora_magnitudes_and_kd_head_crash_and_the_fixes(report):
    """DoRA through axolotl's LoRA kernels runs but trains a magnitude on each rank's own gradient; the KD
    trainer crashes on the head the forward resharded; the model's patch makes both data-parallel exact."""
    from fsdp2_compat import registry
    from fsdp2_compat_harness.check import axolotl

    rows = {r["kind"]: r for r in _rows(report, framework="axolotl")}
    assert set(rows) == _axolotl_rows_expected(), report["rows"]
    if axolotl.DORA_KIND in rows:
        dora = rows[axolotl.DORA_KIND]["unpatched"]
        assert dora.startswith("runs, but the ") and "lora_magnitude_vector" in dora, dora
        assert float(dora.rsplit(" ", 1)[1]) > 1e-3, dora
    if axolotl.KD_KIND in rows:  # needs the KD trainer's trl, liger-kernel, datasets and numba too
        kd = rows[axolotl.KD_KIND]["unpatched"]
        assert kd.startswith("step 0: ") and "aten.mm.default got mixed torch.Tensor and DTensor" in kd, kd
    for row in rows.values():
        assert row["family"] == "qwen2" and row["patch"] == registry.for_model_type("qwen2").name, row
        assert row["patched"] == "ok" and row["loss_match"] and row["fixed"], row


def _ms_swift_rows_expected():
    from fsdp2_compat_harness.check import ms_swift

    return {kind for kind, _, _ in ms_swift.cases()}


@pytest.mark.skipif(not _ms_swift_rows_expected(), reason="no ms-swift with the code its paths were proven on "
                                                          "(set tf516swift)")
def test_check_shows_ms_swifts_text_only_rank_abort_and_grpo_head_crash_and_the_fixes(report):
    """Through ms-swift's own code: its loader's Qwen3-VL forward lets a text-only rank skip the tower's
    collectives (gloo aborts); GRPO's Liger loss reads a VLM's head still sharded; the model's patch makes both
    data-parallel exact."""
    from fsdp2_compat import registry
    from fsdp2_compat_harness import mixed
    from fsdp2_compat_harness.check import ms_swift

    rows = {r["kind"]: r for r in _rows(report, framework="ms-swift")}
    assert set(rows) == _ms_swift_rows_expected(), report["rows"]
    if ms_swift.FORWARD_KIND in rows:
        forward = rows[ms_swift.FORWARD_KIND]
        assert forward["family"] == "qwen3_vl", forward
        assert forward["unpatched"].startswith("gloo: ") and mixed.GLOO_MISMATCH in forward["unpatched"], forward
    if ms_swift.GRPO_KIND in rows:  # needs trl, liger-kernel and accelerate's lm_head tail unit (1.14.0-1.15.0)
        grpo = rows[ms_swift.GRPO_KIND]
        assert grpo["family"] == "qwen2_5_vl", grpo
        assert grpo["unpatched"].startswith("step 0: ") and "aten.mm.default got mixed torch.Tensor and DTensor" \
            in grpo["unpatched"], grpo
    for row in rows.values():
        assert row["version"] == guards.installed_version("ms-swift"), row
        assert row["patch"] == registry.for_model_type(row["family"]).name, row
        assert row["patched"] == "ok" and row["loss_match"] and row["loss_err"] < 1e-5 and row["fixed"], row


@pytest.mark.skipif(not guards.in_range(guards.installed_version("transformers") or "0", ">=5.15.0"),
                    reason="transformers < 5.15.0 has no native FSDP2: check makes no native rows")
def test_check_shows_native_fsdp2_bugs_and_the_fixes(report):
    """transformers' own FSDP2: a lone head's reader crashes, a text-only rank aborts gloo; both fixed."""
    from fsdp2_compat_harness import mixed
    from fsdp2_compat_harness.check import native_fsdp

    rows = {r["kind"]: r for r in _rows(report, framework="transformers") if r["kind"] in native_fsdp.CASES}
    assert set(rows) == set(native_fsdp.CASES), report["rows"]
    assert "aten.mm.default got mixed torch.Tensor and DTensor" in rows[native_fsdp.READER]["unpatched"]
    assert mixed.GLOO_MISMATCH in rows[native_fsdp.MIXED]["unpatched"], rows[native_fsdp.MIXED]
    assert all(r["patched"] == "ok" and r["loss_match"] and r["fixed"] for r in rows.values()), rows


def test_check_shows_fp32_routers_only_where_transformers_keeps_them(report):
    """transformers >= 5.24.0 keeps MoE routers fp32 in a bf16 GLM-4.5: torch's assertion unpatched, exact patched;
    no row on an older transformers (every unit uniform)."""
    from fsdp2_compat_harness.check import mixed_dtypes

    rows = [r for r in report["rows"] if r["kind"] == mixed_dtypes.KIND]
    if not guards.in_range(guards.installed_version("transformers") or "0", mixed_dtypes.KEEPS_FP32):
        assert rows == [], rows
        return
    assert [(r["framework"], r["family"], r["patch"]) for r in rows] == [("torch", "glm4_moe", "moe")], rows
    assert "FSDP expects uniform original parameter dtype" in rows[0]["unpatched"], rows[0]
    assert rows[0]["patched"] == "ok" and rows[0]["loss_match"] and rows[0]["fixed"], rows[0]
