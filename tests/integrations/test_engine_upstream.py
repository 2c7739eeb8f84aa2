"""The patch engine against the real installed verl (whatever the pinned set has).

These tests are about the engine's contract on a real upstream release (when
a patch applies, what is recorded, what revert restores); the same contract
on a toy distribution, without torch, is tests/core/test_engine_core.py, and
that the fix itself is right is proven on real FSDP2 in test_wrap_selection.py.
"""

import json
import sys

import pytest

import fsdp2_compat
from fsdp2_compat import registry
from fsdp2_compat.core import engine, guards

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python", "verl")

VERL = guards.installed_version("verl")
pytestmark = pytest.mark.skipif(VERL is None, reason="verl is not installed in this pinned set")


def verl_selection_target():
    """The verl seam that covers the installed release."""
    [target] = [t for t in registry.WRAP_SELECTION if t.dist == "verl" and guards.in_range(VERL, t.versions)]
    return target


def test_hook_waits_for_the_import(warm_python):
    target = verl_selection_target()
    proc = warm_python(
        """
        import sys, json
        import fsdp2_compat.auto
        from fsdp2_compat.core import engine
        before = [o.kind for n, o in engine.outcomes(["glm4v"]) if o.target.key == %r]
        assert "verl.utils.fsdp_utils" not in sys.modules
        import verl.utils.fsdp_utils as fu
        after = [o.kind for n, o in engine.outcomes(["glm4v"]) if o.target.key == %r]
        print(json.dumps([before, after, type(getattr(fu, %r)).__name__]))
        """
        % (target.key, target.key, target.attr),
        env={"FSDP2_COMPAT_PATCHES": "glm4v"},
    )
    before, after, kind = json.loads(proc.stdout.strip().splitlines()[-1])
    assert before == [engine.WAITING]
    assert after == [engine.APPLIED]
    assert kind == "FunctionWrapper"


def test_applies_at_once_when_the_module_is_already_imported():
    import verl.utils.fsdp_utils as fu

    target = verl_selection_target()
    original = fu.__dict__[target.attr]
    fsdp2_compat.apply("glm4v")
    assert fu.__dict__[target.attr] is not original
    assert fu.__dict__[target.attr].__wrapped__ is original
    [outcome] = [o for n, o in engine.outcomes(["glm4v"]) if o.target is target]
    assert outcome.kind == engine.APPLIED and outcome.found == VERL


def test_second_apply_wraps_nothing_twice():
    import verl.utils.fsdp_utils as fu

    target = verl_selection_target()
    original = fu.__dict__[target.attr]
    fsdp2_compat.apply("glm4v")
    first = fu.__dict__[target.attr]
    fsdp2_compat.apply("glm4v")
    fsdp2_compat.apply("lfm2vl")  # shares the target
    assert fu.__dict__[target.attr] is first
    assert first.__wrapped__ is original


def test_shared_target_stays_until_its_last_patch_is_reverted():
    import verl.utils.fsdp_utils as fu

    target = verl_selection_target()
    original = fu.__dict__[target.attr]
    fsdp2_compat.apply(["glm4v", "lfm2vl"])
    fsdp2_compat.revert(["glm4v"])
    assert fu.__dict__[target.attr] is not original
    fsdp2_compat.revert(["lfm2vl"])
    assert fu.__dict__[target.attr] is original


def test_revert_restores_originals_and_aliases_by_identity():
    import types

    import verl.utils.fsdp_utils as fu

    target = verl_selection_target()
    original = fu.__dict__[target.attr]
    # A caller that imported the function by name before the patch, as verl's
    # workers do with ``from verl.utils.fsdp_utils import apply_fsdp2``.
    caller = types.ModuleType("fsdp2_compat_test_caller")
    caller.selected = original
    sys.modules[caller.__name__] = caller
    try:
        fsdp2_compat.apply("glm4v")
        assert caller.selected is fu.__dict__[target.attr] is not original
        [outcome] = [o for n, o in engine.outcomes(["glm4v"]) if o.target is target]
        assert "fsdp2_compat_test_caller" in outcome.detail
        [outcome] = [o for o in fsdp2_compat.revert() if o.target is target]
        assert outcome.kind == engine.REVERTED and outcome.detail == ""  # nothing left behind
        assert caller.selected is original
        assert fu.__dict__[target.attr] is original
    finally:
        del sys.modules[caller.__name__]


def test_revert_also_restores_copies_made_while_patched():
    import types

    import verl.utils.fsdp_utils as fu

    target = verl_selection_target()
    original = fu.__dict__[target.attr]
    fsdp2_compat.apply("glm4v")
    late = types.ModuleType("fsdp2_compat_test_late_caller")
    late.selected = fu.__dict__[target.attr]  # imported by name after the patch
    sys.modules[late.__name__] = late
    try:
        fsdp2_compat.revert()
        assert late.selected is original
    finally:
        del sys.modules[late.__name__]


def test_patched_context_manager_reverts_on_exit():
    import verl.utils.fsdp_utils as fu

    target = verl_selection_target()
    original = fu.__dict__[target.attr]
    with fsdp2_compat.patched("glm4v"):
        assert fu.__dict__[target.attr] is not original
    assert fu.__dict__[target.attr] is original
    assert engine.requested() == ()


def test_drifted_upstream_code_is_skipped_and_left_untouched(monkeypatch):
    import verl.utils.fsdp_utils as fu

    target = verl_selection_target()
    original = fu.__dict__[target.attr]
    monkeypatch.setattr(target, "fingerprints", {"imaginary": "0000000000000000"})
    fsdp2_compat.apply("glm4v")
    assert fu.__dict__[target.attr] is original
    [outcome] = [o for n, o in engine.outcomes(["glm4v"]) if o.target is target]
    assert outcome.kind == engine.DRIFTED
    assert guards.fingerprint(original) in outcome.detail and "0000000000000000" in outcome.detail


def test_a_release_outside_the_proven_range_with_known_code_is_applied_with_a_note(monkeypatch):
    """The day a new release ships with the same code, it is patched, and status says it is unproven."""
    import verl.utils.fsdp_utils as fu

    target = verl_selection_target()
    original = fu.__dict__[target.attr]
    monkeypatch.setattr(target, "versions", "<0.0.1")
    fsdp2_compat.apply("glm4v")
    assert fu.__dict__[target.attr] is not original
    [outcome] = [o for n, o in engine.outcomes(["glm4v"]) if o.target is target]
    assert outcome.kind == engine.APPLIED and outcome.proven is False
    assert "verl %s not in the proven range <0.0.1" % VERL in outcome.detail and "code identical to the" in outcome.detail


def test_drifted_code_of_a_requested_patch_warns_on_stderr_at_import(warm_python):
    proc = warm_python(
        """
        import fsdp2_compat.auto
        from fsdp2_compat import registry
        for t in registry.WRAP_SELECTION:
            t.fingerprints = {"0.0.0": "0000000000000000"}
        import verl.utils.fsdp_utils
        print("imported")
        """,
        env={"FSDP2_COMPAT_PATCHES": "glm4v"},
    )
    assert proc.stdout.strip().splitlines()[-1] == "imported"  # never a broken import
    lines = [l for l in proc.stderr.splitlines() if "NOT applied" in l]
    # One line per refused target of the selection (both verl layouts are unknown now).
    assert lines and all("verl %s" % VERL in l and "0000000000000000" in l and "FSDP2_COMPAT_STRICT=1" in l
                         for l in lines), proc.stderr


def test_fixed_upstream_release_is_not_needed_before_and_after_the_import(monkeypatch):
    """A release inside ``fixed_in`` is "not needed" in status whether or not its module was imported
    yet (status decides from the installed release), and the engine records the same at the import.
    The test imports the module itself: it never relies on an earlier test having done so."""
    from fsdp2_compat.core.status import status

    target = verl_selection_target()
    monkeypatch.setattr(target, "fixed_in", ">=%s" % VERL)
    # Forget an earlier import (restored afterwards, in sys.modules and on the parent package).
    parent, _, leaf = target.module.rpartition(".")
    if target.module in sys.modules:
        __import__(parent)
        monkeypatch.setattr(sys.modules[parent], leaf, sys.modules[target.module])
        monkeypatch.delitem(sys.modules, target.module)
    fsdp2_compat.apply("glm4v")
    [before] = [r for r in status(["glm4v"]) if r["target"] == target.key]
    assert before["outcome"] == engine.NOT_NEEDED and "not imported yet" in before["detail"]
    __import__(target.module)
    [outcome] = [o for n, o in engine.outcomes(["glm4v"]) if o.target is target]
    assert outcome.kind == engine.NOT_NEEDED and "fixed upstream" in outcome.detail
    [after] = [r for r in status(["glm4v"]) if r["target"] == target.key]
    assert after["outcome"] == engine.NOT_NEEDED


def test_failure_midway_leaves_nothing_half_applied(monkeypatch):
    """The seam swaps its attributes, then alias rebinding fails: all is undone."""
    import verl.utils.fsdp_utils as fu

    from fsdp2_compat.core import aliases

    target = verl_selection_target()
    before = dict(fu.__dict__)

    def broken_rebind(*args, **kwargs):
        raise RuntimeError("simulated failure while rebinding")

    monkeypatch.setattr(aliases, "rebind_all", broken_rebind)  # the one scan every apply() ends with
    fsdp2_compat.apply("glm4v")  # must not raise: a broken patch never breaks imports
    [outcome] = [o for n, o in engine.outcomes(["glm4v"]) if o.target is target]
    assert outcome.kind == engine.FAILED and "simulated failure" in outcome.detail
    changed = [k for k in before if fu.__dict__.get(k) is not before[k]]
    assert changed == []


def test_strict_mode_turns_a_skip_into_an_error(monkeypatch):
    import verl.utils.fsdp_utils as fu

    target = verl_selection_target()
    original = fu.__dict__[target.attr]
    monkeypatch.setattr(target, "fingerprints", {"imaginary": "0000000000000000"})
    with pytest.raises(fsdp2_compat.Fsdp2CompatError, match="unknown upstream code"):
        fsdp2_compat.apply("glm4v", strict=True)
    assert fu.__dict__[target.attr] is original


def test_strict_mode_accepts_the_sibling_seam_being_out_of_range():
    fsdp2_compat.apply("glm4v", strict=True)  # no error: one verl seam applies, the other is for other releases
    import verl.utils.fsdp_utils  # noqa: F401

    kinds = {o.target.key: o.kind for n, o in engine.outcomes(["glm4v"]) if o.target.dist == "verl"}
    assert engine.APPLIED in kinds.values()


def test_strict_from_the_environment_fails_the_import(warm_python):
    proc = warm_python(
        """
        import fsdp2_compat.auto
        from fsdp2_compat import registry
        for t in registry.WRAP_SELECTION:
            t.fingerprints = {"imaginary": "0000000000000000"}
        import verl.utils.fsdp_utils
        """,
        env={"FSDP2_COMPAT_PATCHES": "glm4v", "FSDP2_COMPAT_STRICT": "1"},
        check=False,
    )
    assert proc.returncode != 0
    assert "Fsdp2CompatError" in proc.stderr and "unknown upstream code" in proc.stderr


def test_status_cli_reports_the_applied_patch_as_json(warm_python):
    proc = warm_python(
        "import sys; from fsdp2_compat.cli import main; sys.exit(main(['status', '--json', '--patches', 'glm4v']))"
    )
    report = json.loads(proc.stdout)
    verl_rows = {r["target"]: r for r in report["rows"] if r["dist"] == "verl"}
    target = verl_selection_target()
    assert verl_rows[target.key]["outcome"] == engine.APPLIED
    assert verl_rows[target.key]["found"] == VERL
    others = [r for k, r in verl_rows.items() if k != target.key and r["module"] == target.module]
    assert others
    # The sibling layout: the other seam, named (the catalogue checks layouts before declarations).
    for r in others:
        assert r["outcome"] == "other seam" and target.attr in r["detail"], r


@pytest.mark.depends_on("python", "{framework}")
def test_status_shows_glm4v_applied_for_every_installed_framework(warm_python):
    proc = warm_python(
        """
        import json
        import fsdp2_compat
        from fsdp2_compat import integrations
        from fsdp2_compat.core import guards
        from fsdp2_compat_harness.scenarios import import_fsdp_utils
        fsdp2_compat.apply("glm4v")
        installed = [i.dist for i in integrations.wrapping() if guards.installed_version(i.dist)]
        for fw in installed:
            import_fsdp_utils(fw)
        print(json.dumps([installed, fsdp2_compat.status()]))
        """
    )
    installed, rows = json.loads(proc.stdout.strip().splitlines()[-1])
    for dist in installed:
        selection = [r for r in rows if r["dist"] == dist and "wrap selection" in r["what"]]
        assert [r["outcome"] for r in selection].count(engine.APPLIED) == 1, selection
        applied = [r for r in selection if r["outcome"] == engine.APPLIED][0]
        assert applied["diff"] is None or applied["diff"].startswith("patches/%s/" % dist)


@pytest.mark.skipif(VERL is None or not guards.in_range(VERL, ">=0.6.0"), reason="verl < 0.6.0 has no Qwen3-VL forward")
def test_status_shows_qwen3vl_applied_on_the_installed_verl(warm_python):
    proc = warm_python(
        """
        import json
        import fsdp2_compat
        fsdp2_compat.apply("qwen3vl")
        import verl.models.transformers.qwen3_vl
        print(json.dumps(fsdp2_compat.status()))
        """
    )
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    from fsdp2_compat.core.status import NOT_FOR_THIS_RELEASE

    # verl 0.6.0-0.7.1's Ulysses SP callers (the labels): their modules are not imported here
    callers = engine.WAITING if guards.in_range(VERL, ">=0.6.0,<0.8.0.dev0") else NOT_FOR_THIS_RELEASE
    assert {r["attr"]: r["outcome"] for r in rows if r["dist"] == "verl"} == {
        "forward_with_torch_backend": engine.APPLIED,
        "forward_with_triton_backend": engine.APPLIED,
        "_get_input_embeds": engine.APPLIED,  # images and videos in one micro-batch: one tower call
        "DataParallelPPOActor._forward_micro_batch": callers,
        "FSDPEngineWithLMHead.forward_step": callers,
    }
    # and torch FSDP2's gradient-accumulation and frozen-unit fixes, which every multimodal patch carries
    assert {r["attr"]: r["outcome"] for r in rows if r["dist"] == "torch"} == {
        "FSDPParam.to_accumulated_grad_if_needed": engine.APPLIED,
        "FSDPParamGroup.post_backward": engine.APPLIED,
        "FSDPParamGroup._init_mp_dtypes": engine.APPLIED,
    }
