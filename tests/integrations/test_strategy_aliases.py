"""Callers that imported ``apply_fsdp2`` by name see the patch: SkyRL's real ``fsdp_strategy``.

``fsdp_strategy`` does ``from ...fsdp_utils import apply_fsdp2`` at module top,
in skyrl and skyrl-train alike.  Whether it was imported before or after the
patch, its name must end up bound to the patched function, and revert must
give it back the original object.
"""

import json
import os

import pytest

from fsdp2_compat import integrations
from fsdp2_compat.core import guards

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python", "skyrl", "skyrl-train")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DISTS = [
    pytest.param(d, marks=pytest.mark.skipif(guards.installed_version(d) is None, reason="%s not in this pinned set" % d))
    for d in ("skyrl", "skyrl-train")
]

SCRIPT = """
import json, sys
sys.path.insert(0, %(tests)r)
import fsdp2_compat
from support.skyrl_import import import_skyrl_module
strategy_name = %(strategy)r
utils_name = %(utils)r
report = {}
# Held in a dict: a module-level name bound to the original would itself be
# rebound by the patch (this script is a loaded module too, __main__).
keep = {}
if %(before)r:
    strategy = import_skyrl_module(strategy_name)
    keep["original"] = strategy.apply_fsdp2
    fsdp2_compat.apply("glm4v")
else:
    fsdp2_compat.apply("glm4v")
    strategy = import_skyrl_module(strategy_name)
    keep["original"] = strategy.apply_fsdp2.__wrapped__
utils = sys.modules[utils_name]
report["patched_is_shared"] = strategy.apply_fsdp2 is utils.apply_fsdp2
report["patched_is_new"] = strategy.apply_fsdp2 is not keep["original"]
report["wraps_original"] = getattr(strategy.apply_fsdp2, "__wrapped__", None) is keep["original"]
fsdp2_compat.revert()
report["reverted"] = strategy.apply_fsdp2 is keep["original"] and utils.apply_fsdp2 is keep["original"]
print(json.dumps(report))
"""


@pytest.mark.parametrize("before", [True, False], ids=["imported-before-patch", "imported-after-patch"])
@pytest.mark.parametrize("dist", DISTS)
def test_fsdp_strategy_alias_follows_the_patch_and_the_revert(warm_python, dist, before):
    integration = integrations.get(dist)
    [strategy] = integration.callers
    proc = warm_python(SCRIPT % {"tests": TESTS, "strategy": strategy, "utils": integration.wrap_module, "before": before})
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"patched_is_shared": True, "patched_is_new": True, "wraps_original": True, "reverted": True}
