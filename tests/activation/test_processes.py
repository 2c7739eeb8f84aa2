"""Process-wide activation, proven with real processes and the installed wheel.

What is under test is what users install: a wheel is built from this working
tree (``pip wheel``) and installed, not editable, into a fresh venv.  That venv
holds only the wheel; torch, verl, ray, wrapt, packaging... and the harness (a
distribution of its own, as ``pip install ./harness`` installs it beside the
wheel) are reached through path lines (``zzz_fsdp2_compat_test_host.pth``,
processed after ours) pointing at this interpreter's site-packages and the
harness's folder, so the fsdp2-compat code, its ``.pth`` and
its entry point are provably the installed ones (each child checks
``fsdp2_compat.__file__`` and the entry point's distribution path).  Children
run with a scratch cwd and without PYTHONPATH, so the repository cannot leak in.

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
- Ray: a real local cluster; plugin discovery in an actor, the runtime_env
  helper's setup hook for SkyRL (bootstrap off, user hook chained), and nothing
  patched when the variable is unset.
- torchrun with 2 ranks: every rank reports the patch applied.
- verl's training engine (GLM-4.1V, 2 ranks, against the DP-average reference):
  trained with only FSDP2_COMPAT_PATCHES set (bootstrap and plugin), and with
  ``import fsdp2_compat.auto`` in the ranks (bootstrap and plugins off).
- TRL: the .pth applies the TRL target at ``import trl.trainer.utils``; ``import
  fsdp2_compat.auto`` at the top of a script does it with the bootstrap off; under
  ``accelerate launch`` (2 CPU processes) every rank has it.

Slow tests (several seconds each: every child imports torch and verl) carry
``pytest.mark.slow``; ``-m "not slow"`` keeps the fast ones.  Ray tests share one
cluster per module (and carry ``xdist_group`` for ``--dist loadgroup``).
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time
import zipfile

import pytest

from fsdp2_compat.activation import bootstrap as _bootstrap
from fsdp2_compat.core import config
from fsdp2_compat.core import engine, guards

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python", "torch")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VERL = guards.installed_version("verl")
SKYRL = guards.installed_version("skyrl")
HAS_RAY = importlib.util.find_spec("ray") is not None
HAS_TORCH = importlib.util.find_spec("torch") is not None
TF4_PYTHON = os.path.join(REPO, ".venv", "tf4", "bin", "python")

slow = pytest.mark.slow
needs_verl = pytest.mark.skipif(VERL is None, reason="verl is not installed in this environment")


def _verl_at_least(version):
    return VERL is not None and guards.in_range(VERL, ">=" + version)


needs_verl_plugins = pytest.mark.skipif(
    not _verl_at_least("0.9.0"), reason="verl %s loads no verl.plugins entry points (0.9.0+ does)" % VERL
)

# A child's last line "RESULT <json>" is its report.
REPORT = r'''
import json as _json, os as _os, sys as _sys

def report():
    import fsdp2_compat
    from fsdp2_compat import registry
    from fsdp2_compat.activation import bootstrap as _bootstrap
    from fsdp2_compat.core import engine, hooks as _hooks
    from fsdp2_compat.core.status import status
    plugin = _sys.modules.get("fsdp2_compat.activation.verl_plugin")
    swapped = {}
    for t in registry.targets():
        mod = _sys.modules.get(t.module)
        if mod is not None and t.attr in mod.__dict__:
            swapped[t.key] = engine.is_ours(mod.__dict__[t.attr])
    return {
        "file": fsdp2_compat.__file__,
        "pid": _os.getpid(),
        "requested": list(engine.requested()),
        "decisions": _bootstrap.decisions(),
        "plugin_loaded": plugin is not None,
        "plugin": getattr(plugin, "DECISION", None),
        "waiting": _hooks.waiting(),
        "swapped": swapped,
        "rows": status(registry.names()),
        "env": {k: v for k, v in _os.environ.items() if k.startswith(("F2C_", "FSDP2_COMPAT_"))},
    }

def emit(obj):
    print("RESULT " + _json.dumps(obj, default=str), flush=True)
'''


def _result(proc):
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError("no RESULT line (exit %s)\nstdout:\n%s\nstderr:\n%s" % (proc.returncode, proc.stdout, proc.stderr[-6000:]))


def _clean_env(**extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FSDP2_COMPAT_", "VERL_USE_EXTERNAL_", "F2C_")) and k not in ("PYTHONPATH", "RAY_ADDRESS")
    }
    env.update({k: v for k, v in extra.items() if v is not None})
    return env


def _run(python, code, env=None, cwd=None, timeout=600, args=()):
    return subprocess.run(
        [python, "-c", textwrap.dedent(code), *args],
        env=_clean_env(**(env or {})),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _applied(result, module):
    return [r for r in result["rows"] if r["module"] == module and r["outcome"] == engine.APPLIED]


def _site_packages(venv):
    return os.path.join(venv, "lib", "python%d.%d" % sys.version_info[:2], "site-packages")


def _make_venv(path, host_paths=()):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True, capture_output=True)
    site = _site_packages(path)
    assert os.path.isdir(site), site
    if host_paths:
        # "zzz" sorts after fsdp2_compat_bootstrap.pth: our line runs before these paths exist.
        with open(os.path.join(site, "zzz_fsdp2_compat_test_host.pth"), "w") as f:
            f.write("\n".join(host_paths) + "\n")
    return os.path.join(path, "bin", "python"), site


def _host_paths():
    paths = sysconfig.get_paths()
    out = []
    for key in ("purelib", "platlib"):
        if paths[key] not in out:
            out.append(paths[key])
    # The harness's folder (the children run its engines): an editable install's own .pth in site-packages is
    # not processed through a path line.  Only fsdp2_compat_harness sits there, never the runtime's source.
    spec = importlib.util.find_spec("fsdp2_compat_harness")
    if spec is not None:
        out.append(os.path.dirname(list(spec.submodule_search_locations)[0]))
    return out


# -- the wheel and the venv it is installed in -------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """``pip wheel`` of a copy of this working tree (the shared build/ folder stays untouched)."""
    if importlib.util.find_spec("pip") is None or importlib.util.find_spec("setuptools") is None:
        pytest.skip("pip and setuptools are needed to build the wheel")
    if importlib.util.find_spec("wheel") is None and not guards.in_range(guards.installed_version("setuptools"), ">=70.1"):
        pytest.skip("building a wheel needs setuptools >= 70.1 or the wheel package (not in this venv)")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        if os.path.exists(os.path.join(REPO, name)):
            shutil.copy2(os.path.join(REPO, name), src / name)
    shutil.copytree(
        os.path.join(REPO, "fsdp2_compat"), src / "fsdp2_compat", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", str(src), "-w", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [whl] = [p for p in os.listdir(out) if p.endswith(".whl")]
    return os.path.join(out, whl)


class Venv:
    def __init__(self, python, site):
        self.python = python
        self.site = site
        self.cwd = os.path.dirname(os.path.dirname(site))  # lib/: nothing importable there

    def run(self, code, env=None, **kw):
        return _run(self.python, REPORT + textwrap.dedent(code), env=env, cwd=kw.pop("cwd", self.cwd), **kw)


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    """A fresh venv with the wheel installed (not editable) and the host packages reachable."""
    root = str(tmp_path_factory.mktemp("venv") / "v")
    python, site = _make_venv(root, _host_paths())
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert os.path.exists(os.path.join(site, _bootstrap.PTH_NAME)), os.listdir(site)
    return Venv(python, site)


def _assert_installed_copy(venv, result):
    assert result["file"].startswith(venv.site), "fsdp2_compat came from %s, not the installed wheel" % result["file"]


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


# -- slow: a real local Ray cluster -------------------------------------------------------

RAY_HEAD = r"""
import os, sys, ray
ctx = ray.init(num_cpus=2, include_dashboard=False, object_store_memory=150 * 1024 * 1024,
               _temp_dir=sys.argv[1], configure_logging=False)
print("ADDRESS " + ctx.address_info["gcs_address"], flush=True)
sys.stdin.read()
ray.shutdown()
"""

USER_HOOK = """
import os
def mark():
    os.environ["F2C_USER_HOOK_RAN"] = "1"
"""

RAY_DRIVER = r"""
import os, sys, ray
address, mode = sys.argv[1], sys.argv[2]

def callable_hook():
    os.environ["F2C_CALLABLE_HOOK_RAN"] = "1"

opts, frameworks = {}, []
if mode == "plugin":
    ray.init(address=address)
    opts = {"runtime_env": {"env_vars": {"FSDP2_COMPAT_PATCHES": "glm4v", "FSDP2_COMPAT_DISABLE_BOOTSTRAP": "1"}}}
    frameworks = ["verl"]
elif mode == "external-modules":
    ray.init(address=address)
    opts = {"runtime_env": {"env_vars": {"FSDP2_COMPAT_PATCHES": "glm4v", "FSDP2_COMPAT_DISABLE_BOOTSTRAP": "1",
                                         "VERL_USE_EXTERNAL_MODULES": "fsdp2_compat.auto", "VERL_USE_EXTERNAL_PLUGINS": "none"}}}
    frameworks = ["verl"]
elif mode == "helper-skyrl":
    from fsdp2_compat.activation.ray_env import runtime_env
    ray.init(address=address, runtime_env=runtime_env("glm4v", base={
        "env_vars": {"FSDP2_COMPAT_DISABLE_BOOTSTRAP": "1", "F2C_USER_VAR": "kept"},
        "worker_process_setup_hook": "f2c_user_hook.mark"}))
    frameworks = ["skyrl"]
elif mode == "helper-callable":
    from fsdp2_compat.activation.ray_env import runtime_env
    ray.init(address=address, runtime_env=runtime_env("glm4v", base={
        "env_vars": {"FSDP2_COMPAT_DISABLE_BOOTSTRAP": "1"}, "worker_process_setup_hook": callable_hook}))
elif mode == "unset":
    ray.init(address=address)
    frameworks = [f for f in ("verl", "skyrl") if f in sys.argv[3:]]

@ray.remote(num_cpus=0)
class Probe:
    def run(self, frameworks):
        from fsdp2_compat_harness.scenarios import import_fsdp_utils
        before = report()
        errors = {}
        for fw in frameworks:
            try:
                import_fsdp_utils(fw)
            except ModuleNotFoundError as exc:  # a dependency this environment lacks
                errors[fw] = {"name": exc.name, "error": str(exc)}
        after = report()
        after["before"] = {"decisions": before["decisions"], "requested": before["requested"]}
        after["import_errors"] = errors
        return after

probe = Probe.options(**opts).remote()
emit(ray.get(probe.run.remote(frameworks), timeout=540))
ray.shutdown()
"""


@pytest.fixture(scope="module")
def ray_cluster(venv, tmp_path_factory):
    """One local Ray cluster per module, run by a holder process of the installed venv."""
    if not HAS_RAY or not HAS_TORCH:
        pytest.skip("ray and torch are needed for the Ray tests")
    hookdir = tmp_path_factory.mktemp("hooks")
    (hookdir / "f2c_user_hook.py").write_text(USER_HOOK)
    temp_dir = "/tmp/f2c-ray-%d" % os.getpid()  # short: Ray's socket paths must stay < 108 chars
    # A private, throw-away cluster: no usage stats, no token (drivers would need ~/.ray/auth_token).
    env = _clean_env(PYTHONPATH=str(hookdir), RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    holder = subprocess.Popen(
        [venv.python, "-c", RAY_HEAD, temp_dir],
        env=env,
        cwd=venv.cwd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    address = None
    deadline = time.time() + 180
    while time.time() < deadline:
        line = holder.stdout.readline()
        if not line:
            break
        if line.startswith("ADDRESS "):
            address = line.split()[1]
            break
    if address is None:
        holder.kill()
        raise AssertionError("Ray head did not start: %s" % holder.stderr.read()[-4000:])
    yield {"address": address, "env": env}
    holder.stdin.close()
    try:
        holder.wait(timeout=60)
    except subprocess.TimeoutExpired:
        holder.kill()
        holder.wait()
    shutil.rmtree(temp_dir, ignore_errors=True)


def _ray_driver(venv, cluster, mode, *args):
    proc = subprocess.run(
        [venv.python, "-c", REPORT + RAY_DRIVER, cluster["address"], mode, *args],
        env=cluster["env"],
        cwd=venv.cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return _result(proc)


def _skip_missing_dependency(result, framework):
    error = result["import_errors"].get(framework)
    if error is not None:
        assert not (error["name"] or "").startswith("fsdp2_compat"), error
        pytest.skip("%s's fsdp_utils cannot be imported here: %s" % (framework, error["error"]))


@pytest.mark.depends_on("python", "torch", "verl", "ray")
@slow
@pytest.mark.xdist_group("fsdp2_compat_ray")
@needs_verl_plugins
def test_ray_actor_gets_patch_through_verl_plugin(venv, ray_cluster):
    r = _ray_driver(venv, ray_cluster, "plugin")
    _skip_missing_dependency(r, "verl")
    _assert_installed_copy(venv, r)
    assert r["pid"] != os.getpid()
    assert r["before"]["requested"] == [], "nothing may be requested before verl is imported"
    assert r["decisions"]["bootstrap"]["active"] is False  # disabled: the plugin did it
    assert r["plugin"]["active"] is True and r["requested"] == ["glm4v"]
    assert _applied(r, "verl.utils.fsdp_utils"), r["rows"]


@pytest.mark.depends_on("python", "torch", "verl", "ray")
@slow
@pytest.mark.xdist_group("fsdp2_compat_ray")
@pytest.mark.skipif(not _verl_at_least("0.6.0"), reason="VERL_USE_EXTERNAL_MODULES needs verl 0.6.0+ (found %s)" % VERL)
def test_ray_actor_gets_patch_through_verl_external_modules(venv, ray_cluster):
    """The verl 0.6-0.8 recipe: VERL_USE_EXTERNAL_MODULES in the actor's env_vars (plugins and bootstrap off)."""
    r = _ray_driver(venv, ray_cluster, "external-modules")
    _skip_missing_dependency(r, "verl")
    assert r["before"]["requested"] == []
    assert r["plugin_loaded"] is False and r["decisions"]["bootstrap"]["active"] is False
    assert r["requested"] == ["glm4v"] and _applied(r, "verl.utils.fsdp_utils"), r["rows"]


@pytest.mark.depends_on("python", "torch", "skyrl", "ray")
@slow
@pytest.mark.xdist_group("fsdp2_compat_ray")
@pytest.mark.skipif(SKYRL is None, reason="skyrl is not installed in this environment")
def test_ray_runtime_env_helper_patches_skyrl(venv, ray_cluster):
    r = _ray_driver(venv, ray_cluster, "helper-skyrl")
    _skip_missing_dependency(r, "skyrl")
    assert r["before"]["decisions"]["ray"]["active"] is True, "the setup hook runs before the actor"
    assert r["before"]["requested"] == ["glm4v"]
    assert r["decisions"]["bootstrap"]["active"] is False and r["plugin_loaded"] is False
    assert _applied(r, "skyrl.backends.skyrl_train.distributed.fsdp_utils"), r["rows"]
    assert r["env"]["F2C_USER_VAR"] == "kept" and r["env"]["F2C_USER_HOOK_RAN"] == "1"


@pytest.mark.depends_on("python", "ray")
@slow
@pytest.mark.xdist_group("fsdp2_compat_ray")
def test_ray_runtime_env_helper_chains_a_callable_hook(venv, ray_cluster):
    r = _ray_driver(venv, ray_cluster, "helper-callable")
    assert r["decisions"]["ray"]["active"] is True and r["requested"] == ["glm4v"]
    assert r["env"]["F2C_CALLABLE_HOOK_RAN"] == "1"


@pytest.mark.depends_on("python", "ray")
@slow
@pytest.mark.xdist_group("fsdp2_compat_ray")
def test_ray_nothing_patched_when_unset(venv, ray_cluster):
    frameworks = [f for f, v in (("verl", VERL), ("skyrl", SKYRL)) if v is not None]
    if not frameworks:
        pytest.skip("neither verl nor skyrl is installed")
    r = _ray_driver(venv, ray_cluster, "unset", *frameworks)
    if len(r["import_errors"]) == len(frameworks):
        pytest.skip("no framework's fsdp_utils can be imported here: %s" % r["import_errors"])
    assert r["requested"] == [] and r["swapped"] and not any(r["swapped"].values()), r["swapped"]
    assert "ray" not in r["decisions"] and "bootstrap" not in r["decisions"]
    if _verl_at_least("0.9.0"):
        assert r["plugin"]["active"] is False and r["plugin"]["reason"] == "FSDP2_COMPAT_PATCHES unset"


# -- slow: torchrun -----------------------------------------------------------------------

# A torchrun rank: joins the gloo group, imports the modules named on its command line, and
# rank 0 emits every rank's report.
RANK = r"""
import datetime, importlib, sys, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
for name in sys.argv[1:]:
    importlib.import_module(name)
r = report()
r["rank"], r["world"] = dist.get_rank(), dist.get_world_size()
gathered = [None] * r["world"]
dist.all_gather_object(gathered, r)
if r["rank"] == 0:
    emit(gathered)
dist.destroy_process_group()
# Every report is out; skip interpreter teardown, where a framework's C++ thread still joinable (LLaMA-Factory's
# imports on tf4, seen once under load) aborts the process ("terminate called without an active exception").
sys.stdout.flush(); sys.stderr.flush()
import os; os._exit(0)
"""


def _torchrun(venv, tmp_path, modules, patches):
    """Two torchrun ranks of ``RANK`` importing ``modules``, with only ``FSDP2_COMPAT_PATCHES=patches`` set;
    every rank's report (the command must succeed)."""
    script = tmp_path / "rank.py"
    script.write_text(REPORT + RANK)
    proc = subprocess.run(
        [venv.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)] + modules,
        env=_clean_env(FSDP2_COMPAT_PATCHES=patches, OMP_NUM_THREADS="1"),
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    ranks = _result(proc)
    assert sorted(r["rank"] for r in ranks) == [0, 1] and len({r["pid"] for r in ranks}) == 2
    return ranks


@slow
@needs_verl
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_torchrun_every_rank_applies(venv, tmp_path):
    for r in _torchrun(venv, tmp_path, ["verl.utils.fsdp_utils"], "glm4v"):
        _assert_installed_copy(venv, r)
        assert r["decisions"]["bootstrap"]["active"] is True, r["decisions"]
        assert _applied(r, "verl.utils.fsdp_utils"), (r["rank"], r["rows"])


# -- slow: verl's training engine, turned on the way users turn it on ---------------------

ENGINE_CHILD = r"""
import sys
from fsdp2_compat_harness.engines import common, verl_engine
from fsdp2_compat_harness.ranks import run_ranks
path = common.model_dir("glm4v", sys.argv[1])
results = run_ranks(verl_engine.train_verl_engine, 2, "glm4v", path, sys.argv[2], timeout=540)
emit({"results": results, "driver": report()})
"""
GLM4V_FORWARD = "verl:verl.models.transformers.glm4v."


def _engine_run(venv, tmp_path, mode, env):
    from fsdp2_compat.fixes import glm4v_forward
    from fsdp2_compat_harness.engines import common, verl_engine

    unrunnable = verl_engine.unrunnable()
    if unrunnable is not None:
        pytest.skip(unrunnable)
    needed = glm4v_forward.adapted_for(guards.installed_version("transformers"))
    # The wrap-selection target of this release: its own function from 0.7.1, inline in apply_fsdp2 before.
    from fsdp2_compat.integrations import verl as verl_targets

    selection = (verl_targets.WRAP_SELECTION if _verl_at_least("0.7.1") else verl_targets.WRAP_SELECTION_INLINE).key
    proc = venv.run(ENGINE_CHILD, env=dict(env, OMP_NUM_THREADS="1"), args=(str(tmp_path), mode), timeout=600)
    result = _result(proc)
    for rank, r in enumerate(result["results"]):
        where = "rank %d" % rank
        assert r["error"] is None, "%s: %s\n%s" % (where, r["error"], proc.stderr[-3000:])
        assert r["activation"]["file"].startswith(venv.site), r["activation"]["file"]
        assert r["activation"]["requested"] == ["glm4v"], r["activation"]
        assert r["activation"]["outcomes"][selection] == engine.APPLIED, r["activation"]["outcomes"]
        # verl's GLM4V forward ran with the forward targets this transformers needs (none on 5.0.0rc0-rc3).
        for attr in ("_get_input_embeds", "process_position_ids"):
            kind = r["activation"]["outcomes"][GLM4V_FORWARD + attr]
            assert kind == (engine.APPLIED if attr in needed else engine.NOT_NEEDED), (attr, kind)
        assert "model.visual.embeddings.position_embedding" not in r["units"]
        tol = common.tolerance(r)  # 1e-5; bf16's bound where verl's engine autocasts to bf16 regardless (0.7.0)
        for key in ("loss_err", "step0_grad_err", "step1_grad_err", "param_err_after_step1", "grad_norm_err"):
            assert r[key] < tol, (where, key, r[key], tol)
    assert result["results"][0]["reference_losses"] != result["results"][1]["reference_losses"]
    return result


# Where they run: the way the patch reaches each rank (the bootstrap, verl's plugin, ``import
# fsdp2_compat.auto``) depends on the interpreter and the verl release, not on transformers: the
# engine's training on each transformers is tests/integrations/test_verl_engine.py's.
@pytest.mark.depends_on("python", "torch", "verl")
@slow
@needs_verl
def test_verl_engine_trains_glm4v_with_only_the_variable_set(venv, tmp_path):
    """FSDP2_COMPAT_PATCHES=glm4v and nothing else: every rank gets the patch from the installed wheel
    (the .pth bootstrap at start-up; on verl >= 0.9 also verl's plugin entry point when verl is imported)."""
    result = _engine_run(venv, tmp_path, "env", {"FSDP2_COMPAT_PATCHES": "glm4v"})
    for r in result["results"]:
        assert r["activation"]["decisions"]["bootstrap"]["active"] is True, r["activation"]
        if _verl_at_least("0.9.0"):
            assert r["activation"]["decisions"]["plugin"]["active"] is True, r["activation"]


@pytest.mark.depends_on("python", "torch", "verl")
@slow
@needs_verl
def test_verl_engine_trains_glm4v_with_fsdp2_compat_auto(venv, tmp_path):
    """``import fsdp2_compat.auto`` in the rank, the bootstrap and verl's plugins off: the explicit way in."""
    env = {"FSDP2_COMPAT_PATCHES": "glm4v", "FSDP2_COMPAT_DISABLE_BOOTSTRAP": "1", "VERL_USE_EXTERNAL_PLUGINS": "none"}
    result = _engine_run(venv, tmp_path, "auto", env)
    assert result["driver"]["requested"] == [], "only the ranks' import of fsdp2_compat.auto may request"
    for r in result["results"]:
        assert r["activation"]["decisions"]["bootstrap"]["active"] is False
        assert "plugin" not in r["activation"]["decisions"], r["activation"]


# -- slow: TRL (accelerate launch starts one process per rank) ----------------------------

TRL = guards.installed_version("trl")
needs_trl = pytest.mark.skipif(TRL is None or not guards.in_range(TRL, ">=1.15.0"),
                               reason="needs trl >= 1.15.0 (add_fused_lm_head); found %s" % TRL)
TRL_UTILS = "trl.trainer.utils"


def _trl_patched(r, module=TRL_UTILS):
    rows = [row for row in r["rows"] if row["module"] == module and row["patch"] == "qwen3vl"]
    return bool(rows) and all(row["outcome"] == engine.APPLIED for row in rows)


@pytest.mark.depends_on("python", "torch", "trl")
@slow
@needs_trl
def test_pth_applies_the_trl_target_when_trl_utils_is_imported(venv):
    """Only FSDP2_COMPAT_PATCHES set: the installed .pth requests it, the import of trl.trainer.utils applies it."""
    proc = venv.run(
        """
        import trl.trainer.utils
        import trl.trainer.sft_trainer as sft
        from fsdp2_compat.core import engine
        r = report(); r["alias_is_ours"] = engine.is_ours(sft.add_fused_lm_head)
        emit(r)
        """,
        env={"FSDP2_COMPAT_PATCHES": "qwen3vl"},
    )
    r = _result(proc)
    _assert_installed_copy(venv, r)
    assert r["decisions"]["bootstrap"]["active"] is True and r["requested"] == ["qwen3vl"]
    assert _trl_patched(r) and r["alias_is_ours"], r["rows"]


TRL_SCRIPT = r"""
import fsdp2_compat.auto  # first line of the training script
from trl import SFTTrainer  # noqa: F401  (imports trl.trainer.sft_trainer -> trl.trainer.utils)
import trl.trainer.sft_trainer as sft
from fsdp2_compat.core import engine
r = report(); r["alias_is_ours"] = engine.is_ours(sft.add_fused_lm_head)
emit(r)
"""


@pytest.mark.depends_on("python", "torch", "trl")
@slow
@needs_trl
def test_import_auto_at_the_top_of_a_trl_script_applies_the_trl_target(venv, tmp_path):
    """The bootstrap is off: only the script's own ``import fsdp2_compat.auto`` can request the patch."""
    script = tmp_path / "train.py"
    script.write_text(REPORT + TRL_SCRIPT)
    proc = subprocess.run([venv.python, str(script)], env=_clean_env(FSDP2_COMPAT_PATCHES="qwen3vl",
                          FSDP2_COMPAT_DISABLE_BOOTSTRAP="1"), cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=600)
    r = _result(proc)
    _assert_installed_copy(venv, r)
    assert r["decisions"]["bootstrap"]["active"] is False and r["requested"] == ["qwen3vl"]
    assert _trl_patched(r) and r["alias_is_ours"], r["rows"]


# qwen3vl carries accelerate's VLM tail-unit target, applied where accelerate's code is the fingerprinted 1.14.0-1.15.0.
ACC_NORM_PATCHED = guards.in_range(guards.installed_version("accelerate") or "0", ">=1.14.0,<=1.15.0")

ACCELERATE_RANK = r"""
import torch.distributed as dist
from accelerate import PartialState
state = PartialState(cpu=True)  # the gloo group accelerate launch set up the environment for
import trl.trainer.sft_trainer as sft
from fsdp2_compat.core import engine
r = report(); r["alias_is_ours"] = engine.is_ours(sft.add_fused_lm_head)
r["rank"], r["world"] = state.process_index, state.num_processes
gathered = [None] * r["world"]
dist.all_gather_object(gathered, r)
if r["rank"] == 0:
    emit(gathered)
# Leave the group before the interpreter exits: a gloo group torn down at exit can abort a rank
# ("terminate called without an active exception", SIGABRT), at random.
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.depends_on("python", "torch", "trl", "accelerate")
@slow
@needs_trl
def test_accelerate_launch_every_rank_applies_the_trl_target(venv, tmp_path):
    """``accelerate launch`` (its torchrun launcher, 2 CPU processes) with only FSDP2_COMPAT_PATCHES set."""
    script = tmp_path / "rank.py"
    script.write_text(REPORT + ACCELERATE_RANK)
    cmd = [venv.python, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
           "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0", str(script)]
    proc = subprocess.run(cmd, env=_clean_env(FSDP2_COMPAT_PATCHES="qwen3vl", OMP_NUM_THREADS="1"),
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    ranks = _result(proc)
    assert sorted(r["rank"] for r in ranks) == [0, 1] and len({r["pid"] for r in ranks}) == 2
    for r in ranks:
        _assert_installed_copy(venv, r)
        assert r["decisions"]["bootstrap"]["active"] is True, r["decisions"]
        assert _trl_patched(r) and r["alias_is_ours"], (r["rank"], r["rows"])
        # accelerate's own FSDP2 preparation is patched in every rank too (its tail unit: the VLM's final norm)
        assert r["swapped"].get("accelerate:accelerate.utils.fsdp_utils._find_final_norm") is ACC_NORM_PATCHED, (
            r["rank"], r["swapped"])


NEW_FRAMEWORKS = [d for d in ("areal", "llamafactory") if guards.installed_version(d)]

@pytest.mark.depends_on("python", "torch", "areal", "llamafactory")
@slow
@pytest.mark.skipif(not HAS_TORCH or not NEW_FRAMEWORKS, reason="neither areal nor llamafactory is installed")
def test_torchrun_every_rank_applies_to_areal_and_llamafactory(venv, tmp_path):
    """AReaL's local launcher and LLaMA-Factory's v1 launcher start the trainer ranks with torchrun and
    the launcher's own environment: the variable alone reaches each rank, the bootstrap applies there."""
    from fsdp2_compat import integrations

    modules = [integrations.get(d).wrap_module for d in NEW_FRAMEWORKS]
    for r in _torchrun(venv, tmp_path, modules, "glm4v"):
        _assert_installed_copy(venv, r)
        assert r["decisions"]["bootstrap"]["active"] is True, r["decisions"]
        for module in modules:
            expected = 2 if module.startswith("llamafactory") else 1  # selection and layer-class lookup
            assert len(_applied(r, module)) == expected, (r["rank"], module, r["rows"])


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
