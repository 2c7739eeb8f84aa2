"""Released upstream sources, without importing them: installed packages and PyPI wheels.

``package_root`` finds an installed package, ``download_wheel`` fetches a
release (``pip download --no-deps``, cached), ``extract_wheel`` unpacks its
sources and ``copy_installed_package`` copies an installed one to patch.
Package names come from ``fsdp2_compat.integrations``.
"""

import os
import shutil
import subprocess
import sys
import zipfile

from fsdp2_compat import integrations


def _package(dist):
    return integrations.get(dist).package


def package_root(dist):
    """The directory holding the installed top-level package of ``dist`` (no import), or None."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(_package(dist))
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.dirname(list(spec.submodule_search_locations)[0])


def download_wheel(dist, version, cache_dir, timeout=180):
    """``pip download --no-deps dist==version`` into ``cache_dir`` (reused); the wheel path.

    Raises ``RuntimeError`` with pip's output when the download fails.
    """
    os.makedirs(cache_dir, exist_ok=True)
    # A build with a local label (``torch-2.13.0+cpu-...``, what this machine's find-links serves for
    # ``torch==2.13.0``) is the same release's code: accept it, or pip's "already downloaded" finds nothing here.
    stems = ("%s-%s-" % (_package(dist), version), "%s-%s+" % (_package(dist), version))
    found = [n for n in os.listdir(cache_dir) if n.startswith(stems) and n.endswith(".whl")]
    if found:
        return os.path.join(cache_dir, sorted(found)[0])
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--ignore-requires-python",
           "-q", "-d", cache_dir, "%s==%s" % (dist, version)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError("%s failed: %s" % (" ".join(cmd), exc)) from None
    found = [n for n in os.listdir(cache_dir) if n.startswith(stems) and n.endswith(".whl")]
    if proc.returncode != 0 or not found:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd[2:]), proc.returncode, " | ".join(tail)))
    return os.path.join(cache_dir, sorted(found)[0])


def extract_wheel(wheel, dest):
    """Unzip the package sources of ``wheel`` into ``dest`` (once); returns ``dest``."""
    marker = os.path.join(dest, ".extracted")
    if not os.path.exists(marker):
        with zipfile.ZipFile(wheel) as zf:
            # Python sources only: the diffs and fingerprints read nothing else (torch's libraries are ~700 MB)
            zf.extractall(dest, [n for n in zf.namelist() if ".dist-info/" not in n and n.endswith(".py")])
        open(marker, "w").close()
    return dest


def copy_installed_package(dist, dest):
    """Copy the installed package of ``dist`` to ``dest/<package>``; returns ``dest``."""
    root = package_root(dist)
    if root is None:
        raise RuntimeError("%s is not installed" % dist)
    pkg = _package(dist)
    shutil.copytree(
        os.path.join(root, pkg), os.path.join(dest, pkg), ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    return dest
