"""AReaL 1.0.4: ``parallelize_model`` (what ``FSDPEngine`` calls) imported ``apply_fsdp2`` by name.

``areal/engine/fsdp_utils/parallel.py`` does ``from areal.engine.fsdp_utils import
apply_fsdp2`` at module top.  Whether it was imported before or after the patch,
its name must end up bound to the patched function, and revert must give it
back the original object.  (That the patched ``parallelize_model`` fixes the
crash and matches the data-parallel reference is proven per family in
test_wrap_selection.py, which shards every AReaL model through it.)
"""

import json

import pytest

from fsdp2_compat.core import guards
from fsdp2_compat.integrations import areal

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python", "areal")

pytestmark = pytest.mark.skipif(guards.installed_version("areal") is None, reason="areal not in this pinned set")

SCRIPT = """
import importlib, json, sys
import fsdp2_compat
keep = {}  # in a dict: a module-level name bound to the original would itself be rebound
if %(before)r:
    caller = importlib.import_module(%(caller)r)
    keep["original"] = caller.apply_fsdp2
    fsdp2_compat.apply("glm4v")
else:
    fsdp2_compat.apply("glm4v")
    caller = importlib.import_module(%(caller)r)
    keep["original"] = caller.apply_fsdp2.__wrapped__
utils = sys.modules[%(utils)r]
report = {
    "patched_is_shared": caller.apply_fsdp2 is utils.apply_fsdp2,
    "patched_is_new": caller.apply_fsdp2 is not keep["original"],
    "wraps_original": getattr(caller.apply_fsdp2, "__wrapped__", None) is keep["original"],
    "status": [r["outcome"] for r in fsdp2_compat.status() if r["dist"] == "areal"],
}
fsdp2_compat.revert()
report["reverted"] = caller.apply_fsdp2 is keep["original"] and utils.apply_fsdp2 is keep["original"]
print(json.dumps(report))
"""


@pytest.mark.parametrize("before", [True, False], ids=["imported-before-patch", "imported-after-patch"])
def test_parallelize_model_alias_follows_the_patch_and_the_revert(warm_python, before):
    [caller] = areal.INTEGRATION.callers
    proc = warm_python(SCRIPT % {"caller": caller, "utils": areal.INTEGRATION.wrap_module, "before": before})
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"patched_is_shared": True, "patched_is_new": True, "wraps_original": True,
                      "status": ["applied"], "reverted": True}
