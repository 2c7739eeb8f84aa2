"""The engine's contract on a toy upstream (``conftest.toy``): no torch, no framework.

When a target applies, what each outcome says, all-or-nothing swaps, revert
by identity (aliases and copies included), methods of classes as targets,
strict mode.  The same contract against the real verl is in
tests/integrations/test_engine_upstream.py.
"""

import sys
import types

import pytest

import fsdp2_compat
from fsdp2_compat.core import aliases, engine, hooks

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python",)


def outcome_of(target, patch="toy"):
    [outcome] = [o for n, o in engine.outcomes([patch]) if o.target is target]
    return outcome


def test_hook_waits_for_the_import(toy, monkeypatch):
    toy.register(monkeypatch, toy.patch())
    fsdp2_compat.apply("toy")
    assert "f2c_toy.utils" not in sys.modules
    assert outcome_of(toy.select).kind == engine.WAITING
    assert "f2c_toy.utils" in hooks.waiting()
    utils = toy.import_utils()
    assert outcome_of(toy.select).kind == engine.APPLIED
    assert utils.select("m", "l") == ["patched", "m", "l"]
    assert "f2c_toy.utils" not in hooks.waiting()


def test_applies_at_once_when_the_module_is_already_imported(toy, monkeypatch):
    toy.register(monkeypatch, toy.patch())
    utils = toy.import_utils()
    original = utils.select
    fsdp2_compat.apply("toy")
    outcome = outcome_of(toy.select)
    assert outcome.kind == engine.APPLIED and outcome.found == "1.2.0"
    assert utils.select is not original and engine.is_ours(utils.select)
    assert engine.active_targets() == [toy.select.key]


def test_revert_restores_originals_and_aliases_by_identity(toy, monkeypatch):
    toy.register(monkeypatch, toy.patch())
    utils = toy.import_utils()
    caller = sys.modules.get("f2c_toy.caller") or __import__("f2c_toy.caller", fromlist=["x"])
    original = utils.select
    assert caller.select is original
    fsdp2_compat.apply("toy")
    assert caller.select is utils.select is not original  # the alias follows the patch
    assert "f2c_toy.caller" in outcome_of(toy.select).detail
    [reverted] = fsdp2_compat.revert()
    assert reverted.kind == engine.REVERTED and reverted.detail == ""
    assert utils.select is original and caller.select is original
    assert not engine.is_ours(utils.select) and engine.active_targets() == []


def test_revert_also_restores_copies_made_while_patched(toy, monkeypatch):
    toy.register(monkeypatch, toy.patch())
    utils = toy.import_utils()
    original = utils.select
    fsdp2_compat.apply("toy")
    late = types.ModuleType("f2c_toy_late_caller")
    late.select = utils.select  # imported by name after the patch
    sys.modules[late.__name__] = late
    try:
        fsdp2_compat.revert()
        assert late.select is original
    finally:
        del sys.modules[late.__name__]


def test_a_name_someone_else_rebound_is_left_alone_and_reported(toy, monkeypatch):
    toy.register(monkeypatch, toy.patch())
    utils = toy.import_utils()
    fsdp2_compat.apply("toy")

    def theirs(model, layers):
        return "theirs"

    utils.select = theirs
    [reverted] = fsdp2_compat.revert()
    assert utils.select is theirs
    assert "left alone" in reverted.detail and "f2c_toy.utils.select" in reverted.detail


def test_drifted_upstream_code_is_skipped_and_left_untouched(toy, monkeypatch):
    toy.register(monkeypatch, toy.patch())
    monkeypatch.setattr(toy.select, "fingerprints", {"imaginary": "0000000000000000"})
    utils = toy.import_utils()
    original = utils.select
    fsdp2_compat.apply("toy")
    outcome = outcome_of(toy.select)
    assert outcome.kind == engine.DRIFTED and utils.select is original
    assert toy.fp_select in outcome.detail and "0000000000000000" in outcome.detail


def test_known_code_outside_the_proven_range_is_applied_and_says_so(toy, monkeypatch):
    """A release after the pins with byte-identical code is covered the day it ships."""
    toy.register(monkeypatch, toy.patch())
    monkeypatch.setattr(toy.select, "versions", ">=1.0,<=1.1")  # proven up to 1.1; 1.2.0 is installed
    utils = toy.import_utils()
    fsdp2_compat.apply("toy")
    outcome = outcome_of(toy.select)
    assert outcome.kind == engine.APPLIED and outcome.proven is False
    assert "code identical to the 1.0-1.2 release" in outcome.detail
    assert "f2c-toy 1.2.0 not in the proven range >=1.0,<=1.1" in outcome.detail
    assert engine.is_ours(utils.select)
    assert outcome.as_dict()["proven"] is False


def test_inside_the_proven_range_the_outcome_is_proven(toy, monkeypatch):
    toy.register(monkeypatch, toy.patch())
    toy.import_utils()
    fsdp2_compat.apply("toy")
    outcome = outcome_of(toy.select)
    assert outcome.kind == engine.APPLIED and outcome.proven is True and "proven range" not in outcome.detail


def test_strict_proven_refuses_code_outside_the_proven_range(toy, monkeypatch):
    toy.register(monkeypatch, toy.patch())
    monkeypatch.setattr(toy.select, "versions", ">=1.0,<=1.1")
    utils = toy.import_utils()
    original = utils.select
    with pytest.raises(fsdp2_compat.Fsdp2CompatError, match="outside the proven range"):
        fsdp2_compat.apply("toy", strict="proven")
    assert utils.select is original
    # FSDP2_COMPAT_STRICT=1 alone does not: known code applies.
    fsdp2_compat.revert()
    fsdp2_compat.apply("toy", strict=True)
    assert engine.is_ours(utils.select)


def test_unknown_code_of_a_requested_patch_is_refused_loudly_once(toy, monkeypatch, capsys, caplog):
    toy.register(monkeypatch, toy.patch())
    monkeypatch.setattr(toy.select, "fingerprints", {"1.0-1.1": "0000000000000000"})
    fsdp2_compat.apply("toy")
    with caplog.at_level("WARNING", logger="fsdp2_compat"):
        utils = toy.import_utils()
    assert not engine.is_ours(utils.select)
    [record] = [r for r in caplog.records if r.name == "fsdp2_compat" and r.levelname == "WARNING"]
    message = record.getMessage()
    for part in ("patch toy NOT applied to f2c-toy 1.2.0", toy.fp_select, "0000000000000000",
                 "Pin a release", "upgrade fsdp2-compat", "FSDP2_COMPAT_STRICT=1"):
        assert part in message, part
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [message]  # exactly one line on stderr


def test_patches_not_requested_stay_quiet(toy, monkeypatch, capsys, caplog):
    toy.register(monkeypatch, toy.patch())
    monkeypatch.setattr(toy.select, "fingerprints", {"1.0-1.1": "0000000000000000"})
    with caplog.at_level("WARNING", logger="fsdp2_compat"):
        toy.import_utils()
    assert caplog.records == [] and capsys.readouterr().err == ""


def test_a_sibling_target_that_fits_the_code_makes_the_other_one_a_seam_not_a_refusal(toy, monkeypatch, capsys):
    """Two targets in one module, one per code layout: whichever fits applies, the other stays quiet."""
    layout_b = type(toy.select)(
        dist="f2c-toy", module="f2c_toy.utils", attr="helper", versions=">=2.0",
        fingerprints={"2.x": "0000000000000000"}, seam="toy_seams:seam", what="toy selection (other layout)",
        layout="toy selection")
    monkeypatch.setattr(toy.select, "layout", "toy selection")
    toy.register(monkeypatch, toy.patch(layout_b, toy.select))
    toy.import_utils()
    fsdp2_compat.apply("toy")
    assert outcome_of(toy.select).kind == engine.APPLIED
    other = outcome_of(layout_b)
    assert other.kind == engine.OTHER_SEAM and "uses the select seam (code of the 1.0-1.2 release)" in other.detail
    assert capsys.readouterr().err == ""
    assert engine.is_applied("toy")


def test_the_other_layout_is_a_seam_whichever_hook_runs_first(toy, monkeypatch, capsys):
    """The layout that fits may already be patched when its sibling is judged (hook order): still 'other seam'."""
    layout_b = type(toy.select)(
        dist="f2c-toy", module="f2c_toy.utils", attr="helper", versions=">=2.0",
        fingerprints={"2.x": "0000000000000000"}, seam="toy_seams:seam", what="toy selection (other layout)",
        layout="toy selection", declared={">=1.0,<2": "the selection is select() here"})
    monkeypatch.setattr(toy.select, "layout", "toy selection")
    toy.register(monkeypatch, toy.patch(toy.select, layout_b))  # select is judged (and applied) first
    toy.import_utils()
    fsdp2_compat.apply("toy")
    assert outcome_of(toy.select).kind == engine.APPLIED
    other = outcome_of(layout_b)
    assert other.kind == engine.OTHER_SEAM and "uses the select seam" in other.detail, other
    assert capsys.readouterr().err == ""


def test_a_second_target_in_the_module_that_is_not_an_alternative_layout_is_refused(toy, monkeypatch, capsys):
    """Two targets a release needs both: one fitting does not excuse the other's unknown code."""
    other = type(toy.select)(
        dist="f2c-toy", module="f2c_toy.utils", attr="helper", versions=">=1.0,<2",
        fingerprints={"1.x": "0000000000000000"}, seam="toy_seams:seam", what="toy selection (helper)")
    toy.register(monkeypatch, toy.patch(other, toy.select))
    toy.import_utils()
    fsdp2_compat.apply("toy")
    assert outcome_of(toy.select).kind == engine.APPLIED
    assert outcome_of(other).kind == engine.DRIFTED
    assert "NOT applied" in capsys.readouterr().err


def test_targets_fixing_different_things_in_one_module_are_refused_separately(toy, monkeypatch, capsys):
    """Not layouts of each other (LLaMA-Factory's selection and its layer-class lookup): unknown code of
    one is refused with the warning line even though the other fits and applies."""
    toy.register(monkeypatch, toy.patch(toy.select, toy.prepare))
    monkeypatch.setattr(toy.prepare, "fingerprints", {"1.0-1.1": "0000000000000000"})
    utils = toy.import_utils()
    fsdp2_compat.apply("toy")
    assert outcome_of(toy.select).kind == engine.APPLIED
    assert outcome_of(toy.prepare).kind == engine.DRIFTED and utils.Engine().prepare(3) == ("upstream", 3)
    assert "patch toy NOT applied to f2c-toy 1.2.0 (toy method)" in capsys.readouterr().err


def test_a_release_declared_not_to_need_the_target_is_not_a_refusal(toy, monkeypatch, capsys):
    toy.register(monkeypatch, toy.patch())
    monkeypatch.setattr(toy.select, "fingerprints", {"1.0-1.1": "0000000000000000"})
    monkeypatch.setattr(toy.select, "declared", {">=1.2": "the selection here is already right"})
    toy.import_utils()
    fsdp2_compat.apply("toy")
    outcome = outcome_of(toy.select)
    assert outcome.kind == engine.NOT_NEEDED and "already right" in outcome.detail
    assert capsys.readouterr().err == ""


def test_fixed_upstream_release_is_not_needed(toy, monkeypatch):
    toy.register(monkeypatch, toy.patch())
    monkeypatch.setattr(toy.select, "fixed_in", ">=1.2")
    utils = toy.import_utils()
    original = utils.select
    fsdp2_compat.apply("toy")
    assert outcome_of(toy.select).kind == engine.NOT_NEEDED and utils.select is original


def test_a_seam_that_throws_is_a_failure_not_a_broken_import(toy, monkeypatch):
    toy.register(monkeypatch, toy.patch())
    monkeypatch.setattr(toy.select, "seam", "toy_seams:broken_seam")
    fsdp2_compat.apply("toy")
    utils = toy.import_utils()  # must not raise
    outcome = outcome_of(toy.select)
    assert outcome.kind == engine.FAILED and "RuntimeError: a seam with a bug" in outcome.detail
    assert not engine.is_ours(utils.select)


def test_a_seam_can_say_its_fix_is_not_needed_here(toy, monkeypatch, capsys):
    toy.register(monkeypatch, toy.patch())
    monkeypatch.setattr(toy.select, "seam", "toy_seams:seam_not_needed_here")
    utils = toy.import_utils()
    fsdp2_compat.apply("toy", strict=True)  # not a problem, even strict
    outcome = outcome_of(toy.select)
    assert outcome.kind == engine.NOT_NEEDED and "already does" in outcome.detail
    assert not engine.is_ours(utils.select) and capsys.readouterr().err == ""


def test_a_release_known_to_have_the_bug_in_other_code_is_refused_loudly(toy, monkeypatch, capsys):
    toy.register(monkeypatch, toy.patch())
    monkeypatch.setattr(toy.select, "fingerprints", {"1.0-1.1": "0000000000000000"})
    monkeypatch.setattr(toy.select, "unsupported", {">=1.2": "reads the table through another function"})
    utils = toy.import_utils()
    fsdp2_compat.apply("toy")
    outcome = outcome_of(toy.select)
    assert outcome.kind == engine.UNSUPPORTED and "another function" in outcome.detail
    assert not engine.is_ours(utils.select)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "patch toy NOT applied to f2c-toy 1.2.0" in line and "another function" in line
    with pytest.raises(fsdp2_compat.Fsdp2CompatError, match="release not covered"):
        fsdp2_compat.revert()
        fsdp2_compat.apply("toy", strict=True)


def test_failure_midway_leaves_nothing_half_applied(toy, monkeypatch):
    """The seam swaps two globals, then alias rebinding fails: both are restored."""
    toy.register(monkeypatch, toy.patch())
    monkeypatch.setattr(toy.select, "seam", "toy_seams:seam_and_helper")
    utils = toy.import_utils()
    before = dict(utils.__dict__)

    def broken_rebind(*args, **kwargs):
        raise RuntimeError("simulated failure while rebinding")

    monkeypatch.setattr(aliases, "rebind_all", broken_rebind)
    fsdp2_compat.apply("toy")
    outcome = outcome_of(toy.select)
    assert outcome.kind == engine.FAILED and "simulated failure" in outcome.detail
    assert [k for k in before if utils.__dict__.get(k) is not before[k]] == []
    assert engine.active_targets() == []


def test_a_seam_naming_a_global_upstream_lacks_changes_nothing(toy, monkeypatch):
    toy.register(monkeypatch, toy.patch())
    monkeypatch.setattr(toy.select, "seam", "toy_seams:seam_that_names_a_missing_global")
    utils = toy.import_utils()
    original = utils.select
    fsdp2_compat.apply("toy")
    outcome = outcome_of(toy.select)
    assert outcome.kind == engine.FAILED and "no_such_global" in outcome.detail
    assert utils.select is original and "no_such_global" not in utils.__dict__


def test_a_method_of_a_class_is_a_target_too(toy, monkeypatch):
    toy.register(monkeypatch, toy.patch(toy.prepare))
    utils = toy.import_utils()
    original = utils.Engine.__dict__["prepare"]
    fsdp2_compat.apply("toy")
    assert outcome_of(toy.prepare).kind == engine.APPLIED
    assert utils.Engine().prepare(3) == ("patched", 3)
    fsdp2_compat.revert()
    assert utils.Engine.__dict__["prepare"] is original and utils.Engine().prepare(3) == ("upstream", 3)


def test_a_method_target_on_a_missing_class_is_drift(toy, monkeypatch):
    toy.register(monkeypatch, toy.patch(toy.prepare))
    monkeypatch.setattr(toy.prepare, "attr", "Gone.prepare")
    toy.import_utils()
    fsdp2_compat.apply("toy")
    outcome = outcome_of(toy.prepare)
    assert outcome.kind == engine.DRIFTED and "no class 'Gone'" in outcome.detail


def test_second_apply_wraps_nothing_twice_and_shared_targets_stay(toy, monkeypatch):
    toy.register(monkeypatch, toy.patch(name="toy"), toy.patch(name="toy2"))
    utils = toy.import_utils()
    original = utils.select
    fsdp2_compat.apply("toy")
    first = utils.select
    fsdp2_compat.apply(["toy", "toy2"])
    assert utils.select is first
    fsdp2_compat.revert(["toy"])
    assert utils.select is first  # toy2 still needs it
    fsdp2_compat.revert(["toy2"])
    assert utils.select is original


def test_patched_context_manager_reverts_on_exit(toy, monkeypatch):
    toy.register(monkeypatch, toy.patch())
    utils = toy.import_utils()
    original = utils.select
    with fsdp2_compat.patched("toy"):
        assert utils.select is not original
    assert utils.select is original and "toy" not in engine.requested()


def test_strict_mode_turns_a_skip_into_an_error(toy, monkeypatch):
    toy.register(monkeypatch, toy.patch())
    monkeypatch.setattr(toy.select, "fingerprints", {"imaginary": "0000000000000000"})
    utils = toy.import_utils()
    original = utils.select
    with pytest.raises(fsdp2_compat.Fsdp2CompatError, match="unknown upstream code"):
        fsdp2_compat.apply("toy", strict=True)
    assert utils.select is original


def test_revert_before_the_import_cancels_the_hook(toy, monkeypatch):
    toy.register(monkeypatch, toy.patch())
    fsdp2_compat.apply("toy")
    fsdp2_compat.revert()
    utils = toy.import_utils()
    assert not engine.is_ours(utils.select) and "f2c_toy.utils" not in hooks.waiting()
