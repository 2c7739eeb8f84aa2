"""A patch requested after objects were built reaches the ones that saved the method bound to themselves.

ms-swift 4.6.0's loader saves ``model.origin_forward = model.forward`` and
installs a ``forward`` of its own that calls it: a class seam applied later
never ran for that model.  On the toy upstream (``conftest.toy``; no torch).
"""

import fsdp2_compat

from fsdp2_compat.core import engine

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python",)


def _outcome(target):
    [outcome] = [o for n, o in engine.outcomes(["toy"]) if o.target is target]
    return outcome


def test_a_late_patch_reaches_an_object_that_saved_the_method_bound_to_itself(toy, monkeypatch):
    toy.register(monkeypatch, toy.patch(toy.prepare))
    utils = toy.import_utils()

    class Subclass(utils.Engine):
        pass

    saved, sub, plain = utils.Engine(), Subclass(), utils.Engine()
    saved.origin_prepare = saved.prepare  # what ms-swift's loader does with forward
    sub.origin_prepare = sub.prepare
    foreign = utils.Engine()
    foreign.borrowed = saved.prepare  # bound to another object: not its own method, left alone
    assert saved.origin_prepare(1) == ("upstream", 1)

    fsdp2_compat.apply("toy")
    assert saved.origin_prepare(1) == ("patched", 1) and sub.origin_prepare(2) == ("patched", 2)
    assert plain.prepare(3) == ("patched", 3)  # the class seam itself
    assert foreign.borrowed(4) == ("upstream", 4)
    detail = _outcome(toy.prepare).detail
    assert "rebound objects that held the original: " in detail
    assert "Engine.origin_prepare (id %#x)" % id(saved) in detail and "Subclass.origin_prepare" in detail
    assert "borrowed" not in detail
    assert any("Engine.origin_prepare" in (row.get("detail") or "") for row in fsdp2_compat.status(["toy"]))

    fsdp2_compat.revert()
    assert saved.origin_prepare(1) == ("upstream", 1) and sub.origin_prepare(2) == ("upstream", 2)
    assert "origin_prepare" not in vars(plain)


def test_an_object_whose_attribute_was_replaced_since_keeps_it_and_revert_says_so(toy, monkeypatch):
    toy.register(monkeypatch, toy.patch(toy.prepare))
    utils = toy.import_utils()
    saved = utils.Engine()
    saved.origin_prepare = saved.prepare
    fsdp2_compat.apply("toy")
    mine = lambda x: ("mine", x)  # noqa: E731
    saved.origin_prepare = mine
    [reverted] = fsdp2_compat.revert()
    assert saved.origin_prepare is mine
    assert "Engine.origin_prepare" in reverted.detail


def test_a_patch_requested_before_the_import_looks_for_no_objects(toy, monkeypatch):
    toy.register(monkeypatch, toy.patch(toy.prepare))
    fsdp2_compat.apply("toy")  # the module is imported after the request: no object can exist yet
    utils = toy.import_utils()
    assert utils.Engine().prepare(1) == ("patched", 1)
    assert "rebound objects" not in _outcome(toy.prepare).detail


def test_a_late_patch_of_a_function_reaches_the_class_a_trainer_assigned_it_to(toy, monkeypatch):
    """lmms-engine's monkey patch does ``Qwen3VLModel.forward = qwen3_vl_ops.model_forward``; a patch of
    ``model_forward`` requested after that must reach the class too (``Target.assigned_to``), and revert
    must give the class upstream's function back."""
    import sys
    import types

    from fsdp2_compat.core.records import Target

    holders = types.ModuleType("f2c_toy_holders")
    monkeypatch.setitem(sys.modules, "f2c_toy_holders", holders)
    target = Target(dist="f2c-toy", module="f2c_toy.utils", attr="select", versions=">=1.0,<2",
                    fingerprints={"1.0-1.2": toy.fp_select}, seam="toy_seams:seam", what="toy selection",
                    assigned_to=("f2c_toy_holders:Model.select", "f2c_toy_holders:Other.select",
                                 "no_such_module:Model.select"))
    toy.register(monkeypatch, toy.patch(target))
    utils = toy.import_utils()
    original = utils.select

    class Model:
        select = staticmethod(original)  # (a staticmethod holds it: not the function itself, left alone)

    class Other:
        pass

    Other.select = original  # what the trainer's monkey patch does
    holders.Model, holders.Other = Model, Other

    fsdp2_compat.apply("toy")
    assert Other.__dict__["select"] is utils.select is not original
    assert Other.select(None, ["a", "b"])[0] == "patched"
    assert isinstance(Model.__dict__["select"], staticmethod)
    detail = _outcome(target).detail
    assert "rebound objects that held the original: Other.select" in detail, detail

    fsdp2_compat.revert()
    assert Other.__dict__["select"] is original and utils.select is original


def test_a_patch_requested_before_the_assignment_needs_no_rebinding(toy, monkeypatch):
    import sys
    import types

    from fsdp2_compat.core.records import Target

    holders = types.ModuleType("f2c_toy_holders")
    monkeypatch.setitem(sys.modules, "f2c_toy_holders", holders)
    target = Target(dist="f2c-toy", module="f2c_toy.utils", attr="select", versions=">=1.0,<2",
                    fingerprints={"1.0-1.2": toy.fp_select}, seam="toy_seams:seam", what="toy selection",
                    assigned_to=("f2c_toy_holders:Model.select",))
    toy.register(monkeypatch, toy.patch(target))
    fsdp2_compat.apply("toy")
    utils = toy.import_utils()  # imported after the request: the trainer assigns the patched function itself

    class Model:
        pass

    Model.select = utils.select
    holders.Model = Model
    assert Model.select(None, ["a"])[0] == "patched"
    assert "rebound objects" not in _outcome(target).detail
