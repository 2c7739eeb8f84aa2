"""``aliases.BELOW`` holds on the real stacks: no module of a package below the frameworks holds a framework's
function or class.

The engine's alias scan skips those packages (``fsdp2_compat/core/aliases.py``: torch, numpy, sympy, ... are
two thirds of a training process's globals).  That is safe only while none of them holds an object of a
package fsdp2-compat patches.  In a fresh interpreter forked from the warm server, every installed target
module is imported and every module of a ``BELOW`` package is read: any global whose value was defined in
verl, SkyRL, TRL, accelerate, AReaL, LLaMA-Factory, transformers or peft fails the test, named.
"""

import json

import pytest

pytest.importorskip("torch", reason="needs torch (the packages below the frameworks)")

DEPENDS_ON = ("torch", "transformers", "accelerate", "peft", "verl", "skyrl", "skyrl-train", "trl", "areal",
              "llamafactory")

CODE = r'''
import json, sys, types
from fsdp2_compat import registry
from fsdp2_compat.core import aliases

imported, _ = registry.import_installed_targets()
ABOVE = ("verl", "skyrl", "skyrl_train", "trl", "accelerate", "areal", "llamafactory", "transformers", "peft")
found = []
for name, module in list(sys.modules.items()):
    if name.partition(".")[0] not in aliases.BELOW or not isinstance(module, types.ModuleType):
        continue
    for key, value in list(module.__dict__.items()):
        owner = getattr(value, "__module__", None) if isinstance(value, (types.FunctionType, type)) else None
        if isinstance(owner, str) and owner.partition(".")[0] in ABOVE:
            found.append("%s.%s = %s.%s" % (name, key, owner, getattr(value, "__qualname__", "?")))
print(json.dumps({"imported": imported, "found": found}))
'''


def test_no_package_below_the_frameworks_holds_a_framework_object(warm_python):
    proc = warm_python(CODE, timeout=600)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["imported"], "no target module of any framework imports here"
    assert report["found"] == [], report["found"]
