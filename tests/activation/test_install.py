"""The README's install line, as a newcomer runs it: the wheel built from a clone, in a clean venv.

``tests/activation/test_processes.py`` proves the bootstrap and the entry
points with the wheel installed ``--no-deps`` into a venv that reaches the
host's torch and frameworks.  This proves the install itself: the wheel is
built the way the README says (``python -m pip wheel --no-deps . -w dist``,
an isolated build), installed into a venv that holds nothing else, with the
dependencies it declares resolved from the registry (wrapt, packaging; never
torch); then that venv's ``fsdp2-compat status`` runs with
``FSDP2_COMPAT_PATCHES`` set, and reports the patches requested by the
``.pth`` bootstrap at interpreter start-up.  Skipped, with the reason, when
the registry cannot be reached.

The wheel holds the runtime alone: none of the harness that proves it (tiny
model configs, CPU stand-ins for the frameworks' CUDA code, ``check`` /
``audit``), and it stays under ``RUNTIME_LINES`` lines of Python; there
``check`` says how to install the harness.
"""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python",)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNTIME_LINES = 9000  # the runtime wheel's Python, every line counted (issue #41: it was 16.3k with the harness)
# What reaches the registry, so a failure there is a skip, not a bug of the package.
OFFLINE = ("Could not find a version", "No matching distribution", "Failed to establish", "Temporary failure",
           "Network is unreachable", "connection", "timed out")


def _env():
    """No checkout on the path, no patch selection inherited: only what the clean venv itself holds."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("FSDP2_COMPAT_")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _pip(*args, cwd):
    proc = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0 and any(s.lower() in proc.stderr.lower() for s in OFFLINE):
        pytest.skip("the registry is not reachable from here: %s" % proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, "pip %s failed:\n%s\n%s" % (" ".join(args), proc.stdout[-2000:], proc.stderr[-2000:])
    return proc


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory):
    """A venv holding the README-built wheel and its declared dependencies, nothing else."""
    if importlib.util.find_spec("pip") is None:
        pytest.skip("pip is needed to build and install the wheel (not in this venv)")
    # A copy of the clone's packaged files: pip builds in the source tree (build/, *.egg-info), never in the checkout.
    src = tmp_path_factory.mktemp("clone")
    for name in ("pyproject.toml", "setup.py", "setup.cfg", "README.md", "LICENSE", "MANIFEST.in"):
        if os.path.exists(os.path.join(REPO, name)):
            shutil.copy2(os.path.join(REPO, name), src / name)
    for name in ("fsdp2_compat", "harness"):  # the harness too: the runtime's build must leave it out by itself
        shutil.copytree(os.path.join(REPO, name), src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _pip("wheel", "--no-deps", "-q", ".", "-w", "dist", cwd=str(src))
    [wheel] = [p for p in os.listdir(src / "dist") if p.endswith(".whl")]
    root = tmp_path_factory.mktemp("venv") / "clean"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, capture_output=True)
    python = str(root / "bin" / "python")
    _pip("--python", python, "install", "-q", str(src / "dist" / wheel), cwd=str(src))
    return root, str(src / "dist" / wheel)


def _in_venv(root, *cmd, **env):
    proc = subprocess.run([str(root / "bin" / c) if i == 0 else c for i, c in enumerate(cmd)], cwd=str(root),
                          env=dict(_env(), **env), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_the_readme_built_wheel_is_pure_python_and_installs_only_its_declared_dependencies(clean_venv):
    root, wheel = clean_venv
    assert wheel.endswith("-py3-none-any.whl"), wheel
    listed = _in_venv(root, "python", "-c", "import importlib.metadata as m; "
                      "print(sorted(d.metadata['Name'].lower().replace('_', '-') for d in m.distributions()))")
    assert eval(listed) == ["fsdp2-compat", "packaging", "wrapt"], listed
    where = _in_venv(root, "python", "-c", "import fsdp2_compat; print(fsdp2_compat.__file__)")
    assert where.startswith(str(root)), "fsdp2_compat came from %s, not the installed wheel" % where


def test_the_wheel_holds_the_runtime_alone_under_its_line_budget(clean_venv):
    import zipfile

    root, wheel = clean_venv
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if not n.startswith("fsdp2_compat-")]  # (the .dist-info)
        sources = {n: zf.read(n).decode("utf-8") for n in names if n.endswith(".py")}
    assert all(n.startswith("fsdp2_compat/") or n.endswith(".pth") for n in names), names
    harness = [n for n in names if n.split("/")[0] == "fsdp2_compat_harness" or "/tiny/" in n or "/engines/" in n
               or n.endswith(("/cpu.py", "/configs.py", "/check.py", "/scenarios.py", "/_preload.py"))]
    assert harness == [], "harness code in the runtime wheel: %s" % harness
    stand_ins = [n for n, text in sources.items() if "flash_attn" in text or "PlatformRegistry" in text
                 or "tiny_config" in text]
    assert stand_ins == [], "CPU stand-ins or tiny models in the runtime wheel: %s" % stand_ins
    lines = sum(text.count("\n") for text in sources.values())
    assert lines < RUNTIME_LINES, "the runtime wheel holds %d lines of Python (budget %d)" % (lines, RUNTIME_LINES)


def test_check_from_the_wheel_alone_says_how_to_install_the_harness(clean_venv):
    root, _ = clean_venv
    proc = subprocess.run([str(root / "bin" / "fsdp2-compat"), "check"], cwd=str(root), env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "pip install ./harness" in proc.stderr, proc.stdout + proc.stderr


def test_status_from_the_installed_wheel_shows_the_bootstrap_requesting_the_patches(clean_venv):
    root, _ = clean_venv
    out = _in_venv(root, "fsdp2-compat", "status", FSDP2_COMPAT_PATCHES="glm4v")
    assert "requested: glm4v" in out, out
    assert "start-up bootstrap (.pth) loaded, active: requested glm4v" in out, out


def test_the_installed_wheel_with_nothing_set_leaves_the_bootstrap_inactive(clean_venv):
    root, _ = clean_venv
    out = _in_venv(root, "fsdp2-compat", "status")
    assert "start-up bootstrap (.pth) installed, inactive: FSDP2_COMPAT_PATCHES unset" in out, out
