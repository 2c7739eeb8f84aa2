"""``fsdp2_compat.fixes``: a fix is the unit of the catalogue, and a patch's targets are a join, not a list.

Each mechanism declares its seams, symptom, references, delete condition and
proofs once; each integration target names the fix it installs; each patch
lists fixes, and the registry derives its targets, references and delete
conditions from them.
"""

import importlib
import os

from fsdp2_compat import fixes, integrations, registry
from fsdp2_compat.core.records import Fix

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python",)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_fix_is_declared_once_with_what_the_catalogue_derives_from_it():
    assert len({f.name for f in fixes.FIXES}) == len(fixes.FIXES)
    declared = [v for v in vars(fixes).values() if isinstance(v, Fix)]
    assert set(declared) == set(fixes.FIXES)
    for fix in fixes.FIXES:
        assert fix.what and fix.delete_when.startswith("when "), fix
        assert "; and" not in fix.delete_when, "%s: one condition per fix" % fix.name
        assert fix.seams and fix.tests, fix


def test_every_seam_a_fix_declares_is_a_callable_of_its_fixes_module():
    """Read without torch: a fix's module imports its heavy dependencies when a seam runs."""
    for fix in fixes.FIXES:
        for dotted in fix.seams.values():
            module_name, _, name = dotted.partition(":")
            assert module_name.startswith("fsdp2_compat.fixes."), dotted
            assert callable(getattr(importlib.import_module(module_name), name)), dotted


def test_every_proof_a_fix_names_is_in_the_repository():
    for fix in fixes.FIXES:
        for path in fix.tests:
            assert os.path.isfile(os.path.join(REPO, path)), (fix.name, path)


def test_every_target_installs_one_seam_of_its_fix_and_every_fix_has_targets():
    targets = integrations.targets()
    assert len({t.key for t in targets}) == len(targets)
    for t in targets:
        assert t.fix in fixes.FIXES, t
        assert t.seam in t.fix.seams.values(), t
        assert t.families is None or all(mt == mt.lower() for mt in t.families), t
    for fix in fixes.FIXES:
        assert any(t.fix is fix for t in targets), "%s goes nowhere" % fix.name


def test_a_patchs_targets_are_the_join_of_its_fixes_and_its_model_types():
    reached = set()
    for p in registry.PATCHES:
        assert p.fixes, p.name
        expected = [t for fix in p.fixes for t in integrations.targets()
                    if t.fix is fix and (t.families is None or set(t.families) & set(p.model_types))]
        assert list(p.targets) == expected, p.name
        reached.update(t.key for t in p.targets)
        # A fix a patch lists reaches at least one of its targets (no fix listed for nothing).
        assert all(any(t.fix is fix for t in p.targets) for fix in p.fixes), p.name
    assert reached == {t.key for t in integrations.targets()}, "targets no patch reaches"


def test_references_and_delete_conditions_are_derived_from_the_fixes_never_glued():
    for p in registry.PATCHES:
        assert p.references == tuple(dict.fromkeys(r for f in p.fixes for r in f.references)), p.name
        assert p.delete_when == tuple(dict.fromkeys(f.delete_when for f in p.fixes)), p.name
        assert not any("; and" in d for d in p.delete_when), p.name


def test_a_target_names_its_fix_or_its_seam_never_both():
    import pytest

    from fsdp2_compat.core.records import Target

    with pytest.raises(ValueError):
        Target("d", "m", "f", ">=1", {"1": "0" * 16})
    with pytest.raises(ValueError):
        Target("d", "m", "f", ">=1", {"1": "0" * 16}, seam="m:s", fix=fixes.MOE_EXPERTS)
    with pytest.raises(ValueError, match="name one"):
        Target("d", "m", "f", ">=1", {"1": "0" * 16}, fix=fixes.GRAD_ACCUMULATION)
    t = Target("d", "m", "f", ">=1", {"1": "0" * 16}, fix=fixes.GRAD_ACCUMULATION, via="guard")
    assert t.seam == fixes.GRAD_ACCUMULATION.seams["guard"]
