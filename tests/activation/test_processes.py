"""Process-wide activation, proven with real processes and the installed wheel: the ``.pth``, verl's plugin and
``VERL_USE_EXTERNAL_MODULES`` (Ray, torchrun, verl's engine, TRL and accelerate launches: test_launchers.py).

What is under test is what users install: a wheel is built from this working
tree (``pip wheel``) and installed, not editable, into a fresh venv.  That venv
holds only the wheel; torch, verl, ray, wrapt, packaging... and the harness (a
distribution of its own, as ``pip install ./harness`` installs it beside the
wheel) are reached through path lines (``zzz_fsdp2_compat_test_host.pth``,
processed after ours) pointing at this interpreter's site-packages and the
harness's folder, so the fsdp2-compat code, its ``.pth`` and
its entry point are provably the installed ones (each child checks
``fsdp2_compat.__file__`` and the entry point's distribution path).  Children
run with a scratch cwd and without PYTHONPATH, so the repository cannot leak in
(``support/installed_wheel.py``; the fixtures: ``conftest.py``).

Mechanisms, and which test proves each genuinely (each fails if it is broken):
- ``.pth`` bootstrap: applies with the variable set while verl's plugin loading
  is off (VERL_USE_EXTERNAL_PLUGINS=none); imports nothing when unset; one
  stderr line and exit 0 on a typo or a half-uninstalled package.
- verl plugin (verl 0.9.0+): applies with the bootstrap off
  (FSDP2_COMPAT_DISABLE_BOOTSTRAP=1); inactive when unset; a typo is a WARNING,
  never an error out of ``import verl``.
- VERL_USE_EXTERNAL_MODULES=fsdp2_compat.auto (verl 0.6.0+): ``import verl``
  imports it before any target module (this interpreter's verl and, when
  present, the tf4 pinned set's verl 0.7.0).

Slow tests (several seconds each: every child imports torch and verl) carry
``pytest.mark.slow``; ``-m "not slow"`` keeps the fast ones.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

from fsdp2_compat.activation import bootstrap as _bootstrap
from fsdp2_compat.core import config, guards
from support.installed_wheel import (  # the shared pieces of both activation modules
    REPO, VERL, TF4_PYTHON, slow, needs_verl, _verl_at_least, needs_verl_plugins, REPORT, _result, _clean_env,
    _run, _applied, _make_venv, _host_paths, _assert_installed_copy,
)

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python", "torch")


# -- fast: the wheel itself, the .pth line, the entry point ------------------------------


def test_wheel_ships_pth_at_root_and_entry_point(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert _bootstrap.PTH_NAME in names, "the .pth must sit at the wheel root (purelib = site-packages)"
        assert z.read(_bootstrap.PTH_NAME).decode("ascii") == config.PTH_LINE + "\n"
        [ep_file] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = z.read(ep_file).decode()
    assert "[verl.plugins]\nfsdp2_compat = fsdp2_compat.activation.verl_plugin" in entry_points


def test_entry_point_discoverable_from_installed_wheel(venv):
    proc = venv.run(
        """
        from importlib.metadata import entry_points
        eps = [ep for ep in entry_points(group="verl.plugins") if ep.name == "fsdp2_compat"]
        assert len(eps) == 1, eps
        ep = eps[0]
        module = ep.load()   # what verl does
        r = report()
        r["ep"] = {"value": ep.value, "dist_path": str(ep.dist._path), "module": module.__name__}
        from fsdp2_compat.activation import bootstrap
        r["summary"] = bootstrap.activation_summary()
        emit(r)
        """
    )
    r = _result(proc)
    _assert_installed_copy(venv, r)
    assert r["ep"]["value"] == "fsdp2_compat.activation.verl_plugin"
    assert r["ep"]["dist_path"].startswith(venv.site)
    # Variable unset: loaded, inactive, nothing requested.
    assert r["plugin"]["active"] is False and r["plugin"]["reason"] == "FSDP2_COMPAT_PATCHES unset"
    assert r["requested"] == [] and r["waiting"] == []
    assert _bootstrap.describe(r["plugin"]) == "verl plugin loaded, inactive: FSDP2_COMPAT_PATCHES unset"
    # What `fsdp2-compat status` can print about the implicit mechanisms.
    summary = r["summary"]
    assert summary["plugin_registered"] is True and summary["pth"] == [os.path.join(venv.site, _bootstrap.PTH_NAME)]
    assert summary["lines"] == [
        "bootstrap: start-up bootstrap (.pth) installed, inactive: FSDP2_COMPAT_PATCHES unset",
        "plugin: verl plugin loaded, inactive: FSDP2_COMPAT_PATCHES unset",
    ]


def test_pth_unset_imports_nothing(venv, tmp_path):
    """Unset: the interpreter loads exactly the modules a venv without our .pth loads."""
    bare_python, _ = _make_venv(str(tmp_path / "bare"), _host_paths())
    code = "import sys; m = sorted(sys.modules); import json; print(json.dumps(m))"
    mods = {}
    for name, python in (("bare", bare_python), ("installed", venv.python)):
        proc = _run(python, code, cwd=str(tmp_path))
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        mods[name] = set(json.loads(proc.stdout))
    assert not any(m.startswith("fsdp2_compat") for m in mods["installed"])
    assert mods["installed"] == mods["bare"], mods["installed"] ^ mods["bare"]


def test_pth_set_requests_at_startup_without_heavy_imports(venv):
    proc = venv.run(
        """
        import sys
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "verl", "skyrl", "wrapt", "packaging", "logging") or m == "importlib.metadata")
        r = report(); r["heavy"] = heavy
        from fsdp2_compat.activation import bootstrap
        r["lines"] = bootstrap.activation_summary()["lines"]
        emit(r)
        """,
        env={"FSDP2_COMPAT_PATCHES": "glm4v"},
    )
    r = _result(proc)
    assert proc.stderr == ""
    _assert_installed_copy(venv, r)
    assert r["heavy"] == []
    assert r["decisions"]["bootstrap"]["active"] is True and r["requested"] == ["glm4v"]
    assert any(name.endswith("fsdp_utils") for name in r["waiting"]), r["waiting"]
    assert r["lines"][0] == "bootstrap: start-up bootstrap (.pth) loaded, active: requested glm4v (FSDP2_COMPAT_PATCHES=glm4v)"


def test_pth_bad_selection_is_one_stderr_line(venv):
    proc = _run(venv.python, "print('still running')", env={"FSDP2_COMPAT_PATCHES": "glm4x"}, cwd=venv.cwd)
    assert proc.returncode == 0 and proc.stdout == "still running\n"
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "unknown patch 'glm4x'" in lines[0] and lines[0].startswith("fsdp2-compat:"), proc.stderr


def test_pth_survives_half_uninstalled_package(venv, tmp_path):
    """The .pth left behind without the package: never a crash, at most one line."""
    python, site = _make_venv(str(tmp_path / "orphan"))
    shutil.copy2(os.path.join(venv.site, _bootstrap.PTH_NAME), site)
    unset = _run(python, "print('ok')", cwd=str(tmp_path))
    assert (unset.returncode, unset.stdout, unset.stderr) == (0, "ok\n", "")
    set_ = _run(python, "print('ok')", env={"FSDP2_COMPAT_PATCHES": "all"}, cwd=str(tmp_path))
    assert set_.returncode == 0 and set_.stdout == "ok\n"
    lines = set_.stderr.splitlines()
    assert len(lines) == 1 and "ModuleNotFoundError" in lines[0], set_.stderr


def test_pth_disable_switch(venv):
    proc = venv.run("emit(report())", env={"FSDP2_COMPAT_PATCHES": "glm4v", "FSDP2_COMPAT_DISABLE_BOOTSTRAP": "1"})
    r = _result(proc)
    assert r["requested"] == [] and r["decisions"]["bootstrap"]["active"] is False
    assert "FSDP2_COMPAT_DISABLE_BOOTSTRAP" in r["decisions"]["bootstrap"]["reason"]


# -- slow: real verl imports in the installed venv --------------------------------------


@pytest.mark.depends_on("python", "torch", "verl")
@slow
@needs_verl
def test_pth_applies_when_verl_module_is_imported(venv):
    """Bootstrap alone (verl's plugin loading off): the patch applies at the target's import."""
    proc = venv.run(
        """
        import verl.utils.fsdp_utils
        emit(report())
        """,
        env={"FSDP2_COMPAT_PATCHES": "glm4v", "VERL_USE_EXTERNAL_PLUGINS": "none"},
    )
    r = _result(proc)
    _assert_installed_copy(venv, r)
    assert r["plugin_loaded"] is False
    assert r["decisions"]["bootstrap"]["active"] is True
    assert _applied(r, "verl.utils.fsdp_utils"), r["rows"]


@pytest.mark.depends_on("python", "torch", "verl")
@slow
@needs_verl
def test_nothing_applies_when_unset(venv):
    proc = venv.run(
        """
        import verl.utils.fsdp_utils
        emit(report())
        """
    )
    r = _result(proc)
    assert r["requested"] == [] and not any(r["swapped"].values()), r["swapped"]
    assert "verl:verl.utils.fsdp_utils.apply_fsdp2" in r["swapped"]
    assert "bootstrap" not in r["decisions"]
    if _verl_at_least("0.9.0"):
        assert r["plugin"]["active"] is False and r["plugin"]["reason"] == "FSDP2_COMPAT_PATCHES unset"


@pytest.mark.depends_on("python", "torch", "verl")
@slow
@needs_verl_plugins
def test_plugin_applies_with_bootstrap_disabled(venv):
    proc = venv.run(
        """
        import verl.utils.fsdp_utils
        emit(report())
        """,
        env={"FSDP2_COMPAT_PATCHES": "glm4v", "FSDP2_COMPAT_DISABLE_BOOTSTRAP": "1"},
    )
    r = _result(proc)
    assert r["decisions"]["bootstrap"]["active"] is False
    assert r["plugin"]["active"] is True and r["plugin"]["requested"] == ["glm4v"]
    assert _applied(r, "verl.utils.fsdp_utils"), r["rows"]


@pytest.mark.depends_on("python", "torch", "verl")
@slow
@needs_verl_plugins
def test_plugin_reports_a_bad_selection_at_warning_and_never_raises(venv):
    proc = venv.run(
        """
        import verl
        emit(report())
        """,
        env={"FSDP2_COMPAT_PATCHES": "glm4x", "FSDP2_COMPAT_DISABLE_BOOTSTRAP": "1"},
    )
    r = _result(proc)
    assert proc.returncode == 0
    assert r["plugin"]["active"] is False and r["plugin"]["error"].startswith("ConfigError")
    warnings = [l for l in proc.stderr.splitlines() if "fsdp2-compat verl plugin applied nothing" in l]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING"), proc.stderr[-3000:]


# -- slow: VERL_USE_EXTERNAL_MODULES (verl 0.6.0+) ---------------------------------------


def _verl_pythons():
    out = []
    if _verl_at_least("0.6.0"):
        out.append(pytest.param(sys.executable, id="this-verl-%s" % VERL))
    tf4 = os.path.dirname(os.path.dirname(TF4_PYTHON))
    # Under .ci/test the tf4 set proves its own verl as "this-verl": another set borrowing its venv would
    # only repeat that proof (a minute each time); a developer's plain pytest still gets it.
    if (os.path.exists(TF4_PYTHON) and os.path.realpath(tf4) != os.path.realpath(sys.prefix)
            and not os.environ.get("FSDP2_CI_SET")):
        out.append(pytest.param(TF4_PYTHON, id="tf4-venv"))
    return out or [pytest.param(None, marks=pytest.mark.skip(reason="no verl >= 0.6.0 here and no .venv/tf4"))]


@pytest.mark.depends_on("python", "torch", "verl")
@slow
@pytest.mark.parametrize("python", _verl_pythons())
def test_verl_use_external_modules_imports_auto_before_targets(python):
    """verl 0.6.0+ ``import verl`` runs ``importlib.import_module`` on each name.

    Runs the repository's code (PYTHONPATH=repo; the tf4 venv has it editable).
    verl's plugin loading and any .pth bootstrap are off, so
    only VERL_USE_EXTERNAL_MODULES can import ``fsdp2_compat.auto``.
    """
    code = REPORT + textwrap.dedent(
        """
        import sys, verl
        from importlib.metadata import version
        seen = {"auto": "fsdp2_compat.auto" in sys.modules, "target_before": "verl.utils.fsdp_utils" in sys.modules}
        import verl.utils.fsdp_utils
        r = report(); r.update(seen); r["verl"] = version("verl")
        emit(r)
        """
    )
    env = {"PYTHONPATH": REPO, "VERL_USE_EXTERNAL_PLUGINS": "none", "FSDP2_COMPAT_PATCHES": "glm4v", "FSDP2_COMPAT_DISABLE_BOOTSTRAP": "1"}
    env["VERL_USE_EXTERNAL_MODULES"] = "fsdp2_compat.auto"
    on = _result(subprocess.run([python, "-c", code], env=_clean_env(**env), capture_output=True, text=True, timeout=600))
    assert guards.in_range(on["verl"], ">=0.6.0")
    assert on["auto"] is True and on["target_before"] is False
    assert on["requested"] == ["glm4v"] and _applied(on, "verl.utils.fsdp_utils"), on["rows"]




# -- the start-up benchmark ---------------------------------------------------------------


@slow
def test_startup_benchmark_runs_and_imports_nothing_heavy(wheel, tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "startup.py"), "--wheel", wheel, "--reps", "5", "--workdir", str(tmp_path)],
        env=_clean_env(),
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "eager imports: none" in out
    for label in ("bare", "installed, unset", "installed, set"):
        assert label in out
    assert out.count("x bare") >= 2  # the two ratios
