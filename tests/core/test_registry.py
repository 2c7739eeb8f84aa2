"""``fsdp2_compat.registry``: the catalogue and the one model-type map everything derives from."""

import re

from fsdp2_compat import integrations, registry
from fsdp2_compat.core.records import Patch, Target

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python",)


def test_every_model_type_is_listed_by_exactly_one_patch():
    seen = {}
    for p in registry.PATCHES:
        assert p.model_types, p.name
        for mt in p.model_types:
            assert re.fullmatch(r"[a-z0-9_]+", mt), (p.name, mt)  # transformers' model_type spelling
            assert mt not in seen, "%s listed by %s and %s" % (mt, seen[mt], p.name)
            seen[mt] = p.name
    for mt, name in seen.items():
        assert registry.for_model_type(mt).name == name
    assert registry.for_model_type("no_such_model") is None
    assert registry.for_model_type("lfm2-vl").name == "lfm2vl"  # transformers 4.57's spelling


def test_names_are_unique_and_lowercase():
    names = registry.names()
    assert len(names) == len(set(names)) and all(n == n.lower() and "," not in n for n in names)
    assert all(registry.patch(n).name == n for n in names)


def test_selection_model_types_are_exactly_the_patches_carrying_the_selection_fix():
    mts = registry.selection_model_types()
    assert mts["glm4v"] == "glm4v" and mts["voxtral"] == "voxtral"
    assert "qwen3_vl" not in mts  # qwen3vl fixes verl's fused lm_head read only
    for mt, name in mts.items():
        assert set(registry.WRAP_SELECTION) <= set(registry.patch(name).targets)


def test_every_target_is_well_formed_and_belongs_to_an_integration():
    for t in registry.targets():
        assert isinstance(t, Target)
        assert re.fullmatch(r"[\w.]+:\w+", t.seam), t.seam
        assert t.fingerprints and all(re.fullmatch(r"[0-9a-f]{16}", fp) for fp in t.fingerprints.values()), t
        assert t.dist in integrations.dists(), t
    assert len({t.key for t in registry.targets()}) == len(registry.targets())


def test_siblings_are_the_other_layouts_of_the_same_module():
    inline, current = registry.WRAP_SELECTION[0], registry.WRAP_SELECTION[1]
    assert registry.siblings(inline, ["glm4v"]) == [current]
    assert registry.siblings(current, ["glm4v", "voxtral"]) == [inline]
    assert registry.siblings(inline, ["qwen3vl"]) == []  # qwen3vl has no selection target in that module


def test_targets_of_one_module_that_fix_different_things_are_not_siblings():
    """LLaMA-Factory's selection and its layer-class lookup both need their own code to fit."""
    from fsdp2_compat.integrations import llamafactory

    selection, lookup = llamafactory.WRAP_SELECTION, llamafactory.LAYER_CLASS_LOOKUP
    assert selection.module == lookup.module
    assert selection in registry.patch("glm4v").targets and lookup in registry.patch("glm4v").targets
    assert registry.siblings(selection, ["glm4v"]) == [] and registry.siblings(lookup, ["glm4v"]) == []


def test_two_backends_a_release_needs_both_are_not_alternatives():
    """verl's torch and triton fused forwards share a module and a kind, and each must fit on its own:
    if one changed while the other still matched, the changed one must be refused, not 'other seam'."""
    from fsdp2_compat.integrations import verl

    torch_backend, triton_backend = verl.QWEN3_VL_FUSED
    assert torch_backend.module == triton_backend.module
    assert registry.siblings(torch_backend, ["qwen3vl"]) == [] and registry.siblings(triton_backend, ["qwen3vl"]) == []


def test_patch_families_are_derived_from_model_types():
    p = Patch("x", "s", {"glm4v": "GLM-4.1V", "glm4v_moe": "GLM-4.5V"}, (), (), "never")
    assert p.families == ("GLM-4.1V (glm4v)", "GLM-4.5V (glm4v_moe)")


def test_a_transient_patch_can_be_registered_and_removed():
    p = Patch("f2c-transient", "s", {}, registry.WRAP_SELECTION[:1], (), "never")
    try:
        assert registry.register(p) is p and registry.patch("f2c-transient") is p
        assert "f2c-transient" in registry.names() and p in registry.PATCHES
        import pytest

        with pytest.raises(ValueError, match="already in the catalogue"):
            registry.register(p)
    finally:
        registry.unregister("f2c-transient")
    assert "f2c-transient" not in registry.names()
    registry.unregister("f2c-transient")  # twice is fine


def test_each_symptom_is_owned_once_and_reaches_every_patch_carrying_its_target():
    owned = [registry.symptom(t) for t in registry.targets() if registry.symptom(t)]
    for p in registry.PATCHES:
        symptoms = registry.symptoms(p)
        assert len(symptoms) == len(set(symptoms))
        for t in p.targets:
            if registry.symptom(t):
                assert registry.symptom(t) in symptoms
                assert registry.symptom(t) not in p.summary, "%s repeats a symptom its target owns" % p.name
    assert owned  # TRL's reads, LLaMA-Factory's lookup, torch's accumulation
