"""How the tooling imports SkyRL's ``skyrl.backends``: as released on Python 3.12+, worked around only below.

skyrl 0.2.0+'s ``skyrl/backends/__init__.py`` imports a pydantic model that
needs Python 3.12's ``typing.TypedDict``; ``scenarios.ensure_skyrl_backends_package``
skips that ``__init__`` on older interpreters only.  skyrl 0.4.0 requires
Python >= 3.12, so its pinned set runs the real package.
"""

import json
import sys

import pytest

from fsdp2_compat.core import guards

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python", "skyrl")

SKYRL = guards.installed_version("skyrl")
pytestmark = pytest.mark.skipif(
    SKYRL is None or not guards.in_range(SKYRL, ">=0.2.0"),
    reason="needs skyrl >= 0.2.0 (skyrl.backends), found %s" % SKYRL,
)

SCRIPT = """
import json, sys
from fsdp2_compat_harness.scenarios import import_fsdp_utils
fsdp_utils = import_fsdp_utils("skyrl")
pkg = sys.modules["skyrl.backends"]
print(json.dumps({
    "file": pkg.__file__,
    "origin": getattr(pkg.__spec__, "origin", None),
    "doc": pkg.__doc__,
    "exports_backend": hasattr(pkg, "AbstractBackend"),
    "fsdp_utils": fsdp_utils.__file__,
}))
"""


@pytest.mark.skipif(sys.version_info < (3, 12), reason="Python %d.%d: the workaround's interpreter" % sys.version_info[:2])
def test_on_python_312_skyrl_backends_runs_its_released_init(warm_python):
    report = json.loads(warm_python(SCRIPT).stdout.strip().splitlines()[-1])
    assert report["file"].endswith("skyrl/backends/__init__.py")
    assert report["origin"] == report["file"], "skyrl.backends is not the released package module"
    assert "__init__ skipped" not in (report["doc"] or "")
    assert report["exports_backend"], "the released __init__ (which imports AbstractBackend) did not run"
    assert report["fsdp_utils"].endswith("skyrl/backends/skyrl_train/distributed/fsdp_utils.py")


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python 3.12+ imports skyrl.backends as released")
def test_below_python_312_only_the_package_init_is_skipped(warm_python):
    report = json.loads(warm_python(SCRIPT).stdout.strip().splitlines()[-1])
    assert "__init__ skipped (Python < 3.12)" in report["doc"]
    assert not report["exports_backend"]
    # The module under test is still the released file.
    assert report["fsdp_utils"].endswith("skyrl/backends/skyrl_train/distributed/fsdp_utils.py")
