"""The installed wheel the activation tests run real processes against (tests/activation/test_processes.py,
test_launchers.py): a wheel built from this working tree, installed (not editable) into a fresh venv whose other
packages come from this interpreter through path lines, and the child processes' report.

Test-only harness; never in the wheel.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from fsdp2_compat.activation import bootstrap as _bootstrap
from fsdp2_compat.core import engine, guards

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


def build_wheel(tmp_path_factory):
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


def install(wheel, tmp_path_factory):
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
