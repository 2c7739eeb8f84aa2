"""A toy upstream distribution for the core's unit tests (stdlib only: no torch, no framework).

``toy`` installs ``f2c-toy 1.2.0`` (package ``f2c_toy``, with a real
``.dist-info`` so ``importlib.metadata`` finds its version) in a temporary
folder on ``sys.path``, and registers a ``toy`` patch in the catalogue whose
targets point at it.  The engine under test is the real one, unchanged; only
the catalogue gains an entry for the duration of a test.
"""

import importlib
import os
import sys
import textwrap

import pytest

from fsdp2_compat import registry
from fsdp2_compat.core import guards
from fsdp2_compat.core.records import Patch, Target

UTILS = textwrap.dedent('''
    def select(model, layers):
        """Upstream's selection."""
        return ["upstream", model, layers]


    def helper():
        return "upstream helper"


    class Engine:
        def prepare(self, x):
            return ("upstream", x)
''')

CALLER = "from f2c_toy.utils import select\n"


class Toy:
    """Handles on the toy distribution: its files, targets and patch."""

    def __init__(self, root):
        self.root = root
        self.registered = []
        self.utils_path = os.path.join(root, "f2c_toy", "utils.py")
        source = open(self.utils_path).read()
        self.fp_select = guards.fingerprint_source(source, "select")
        self.fp_prepare = guards.fingerprint_source(source, "Engine.prepare")
        self.select = Target(
            dist="f2c-toy", module="f2c_toy.utils", attr="select", versions=">=1.0,<2",
            fingerprints={"1.0-1.2": self.fp_select}, seam="toy_seams:seam", what="toy selection",
        )
        self.prepare = Target(
            dist="f2c-toy", module="f2c_toy.utils", attr="Engine.prepare", versions=">=1.0,<2",
            fingerprints={"1.0-1.2": self.fp_prepare}, seam="toy_seams:method_seam", what="toy method",
        )

    def patch(self, *targets, name="toy"):
        return Patch(name, "toy patch", {"toy_model": "Toy"}, targets or (self.select,), ("toy #1",), "never")

    def register(self, monkeypatch, *patches):
        """Add ``patches`` to the catalogue for this test (``registry.register``, undone at teardown)."""
        for p in patches:
            registry.register(p)
            self.registered.append(p.name)

    def import_utils(self):
        return importlib.import_module("f2c_toy.utils")


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


@pytest.fixture
def toy(tmp_path, monkeypatch):
    root = str(tmp_path / "site")
    _write(os.path.join(root, "f2c_toy", "__init__.py"), "")
    _write(os.path.join(root, "f2c_toy", "utils.py"), UTILS)
    _write(os.path.join(root, "f2c_toy", "caller.py"), CALLER)
    _write(os.path.join(root, "f2c_toy-1.2.0.dist-info", "METADATA"),
           "Metadata-Version: 2.1\nName: f2c-toy\nVersion: 1.2.0\n")
    monkeypatch.syspath_prepend(root)
    importlib.invalidate_caches()
    toy = Toy(root)
    yield toy
    import fsdp2_compat

    fsdp2_compat.revert()
    for name in toy.registered:
        registry.unregister(name)
    for name in [m for m in sys.modules if m == "f2c_toy" or m.startswith("f2c_toy.")]:
        del sys.modules[name]
