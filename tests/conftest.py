import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A developer's exported selection must not leak into the tests (the verl
# plugin and the start-up bootstrap read it in this process and its children).
for _name in [n for n in os.environ if n.startswith("FSDP2_COMPAT_")]:
    del os.environ[_name]


def run_python(code, env=None, check=True, timeout=300):
    """Run ``code`` in a fresh interpreter (clean import state); return CompletedProcess."""
    full_env = dict(os.environ)
    full_env.pop("FSDP2_COMPAT_PATCHES", None)
    full_env.pop("FSDP2_COMPAT_STRICT", None)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, full_env.get("PYTHONPATH")) if p)
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError("subprocess failed (%d):\n%s\n%s" % (proc.returncode, proc.stdout, proc.stderr))
    return proc


@pytest.fixture
def python():
    return run_python


@pytest.fixture(autouse=True)
def _no_leftover_patches():
    """Every test starts and ends with nothing requested in this process."""
    import fsdp2_compat

    fsdp2_compat.revert()
    yield
    fsdp2_compat.revert()
