"""``fsdp2_compat.core.aliases``: names other modules imported are rebound and restored by identity."""

import sys
import types

import pytest

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python",)


@pytest.fixture
def modules():
    made = []

    def make(name, **attrs):
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module
        made.append(name)
        return module

    yield make
    for name in made:
        sys.modules.pop(name, None)


class Fn:
    """Held in a class, not as module globals: this test module is a loaded module too,
    and rebind would rebind its own names."""

    @staticmethod
    def original():
        return "original"

    @staticmethod
    def replacement():
        return "replacement"




def test_rebind_finds_every_copy_by_identity_and_skips_the_seam(modules):
    from fsdp2_compat.core import aliases

    original, replacement = Fn.original, Fn.replacement

    seam = modules("f2c_alias_seam", fn=original)
    a = modules("f2c_alias_a", fn=original, other=original)
    b = modules("f2c_alias_b", fn=lambda: "not the same object")
    changed = aliases.rebind(original, replacement, skip={("f2c_alias_seam", "fn")})
    assert seam.fn is original
    assert a.fn is replacement and a.other is replacement
    assert b.fn() == "not the same object"
    assert sorted((name, key) for _, name, key in changed if name.startswith("f2c_alias")) == [
        ("f2c_alias_a", "fn"), ("f2c_alias_a", "other")]
    kept = aliases.restore(changed, original, replacement)
    assert kept == [] and a.fn is original and a.other is original


def test_restore_leaves_a_name_someone_else_rebound(modules):
    from fsdp2_compat.core import aliases

    original, replacement = Fn.original, Fn.replacement

    a = modules("f2c_alias_c", fn=original)
    changed = [c for c in aliases.rebind(original, replacement) if c[1] == "f2c_alias_c"]

    def theirs():
        pass

    a.fn = theirs
    assert aliases.restore(changed, original, replacement) == ["f2c_alias_c.fn"]
    assert a.fn is theirs
