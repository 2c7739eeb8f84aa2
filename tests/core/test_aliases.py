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


def test_one_scan_rebinds_several_objects_or_none(modules):
    from fsdp2_compat.core import aliases

    def other_original():
        pass

    def other_replacement():
        pass

    a = modules("f2c_alias_d", fn=Fn.original, other=other_original)
    changed = aliases.rebind_all([(Fn.original, Fn.replacement, ()), (other_original, other_replacement, ())])
    assert a.fn is Fn.replacement and a.other is other_replacement
    assert [sorted(k for _, n, k in c if n == "f2c_alias_d") for c in changed] == [["fn"], ["other"]]
    aliases.restore(changed[0], Fn.original, Fn.replacement)
    aliases.restore(changed[1], other_original, other_replacement)
    assert a.fn is Fn.original and a.other is other_original
    # two requests for one object: as two rebinds in order, the second gets only the names the first skipped
    seam = modules("f2c_alias_e", fn=other_original)
    changed = aliases.rebind_all([(other_original, Fn.replacement, {("f2c_alias_e", "fn")}),
                                  (other_original, other_replacement, ())])
    assert a.other is Fn.replacement and seam.fn is other_replacement
    assert [sorted((n, k) for _, n, k in c if n.startswith("f2c_alias")) for c in changed] == [
        [("f2c_alias_d", "other")], [("f2c_alias_e", "fn")]]
    aliases.restore(changed[0], other_original, Fn.replacement)
    aliases.restore(changed[1], other_original, other_replacement)


def test_packages_below_the_frameworks_are_not_read_unless_the_original_is_theirs(modules):
    """A ``BELOW`` package (pygments here: no framework is imported by it) cannot hold an alias of a framework
    function, so a scan skips it; a function of that package itself is rebound there too."""
    from fsdp2_compat.core import aliases

    assert "pygments" in aliases.BELOW and "transformers" not in aliases.BELOW
    below = modules("pygments.f2c_alias_below", fn=Fn.original)
    above = modules("f2c_alias_above", fn=Fn.original)
    changed = aliases.rebind(Fn.original, Fn.replacement)
    assert below.fn is Fn.original and above.fn is Fn.replacement
    aliases.restore(changed, Fn.original, Fn.replacement)

    def theirs():
        pass

    theirs.__module__ = "pygments.lexer"
    below.fn = above.fn = theirs
    changed = aliases.rebind(theirs, Fn.replacement)
    assert below.fn is Fn.replacement and above.fn is Fn.replacement
    aliases.restore(changed, theirs, Fn.replacement)
    assert below.fn is theirs
