"""LLaMA-Factory 0.9.5: the two targets of ``fsdp2_compat.integrations.llamafactory`` on the released code.

- The layer-class lookup fix gives a transformers 5.x *set* ``_no_split_modules``
  exactly what the released ``get_transformer_layer_cls`` gives the same names as
  a list (its transformers 4.x behaviour), and leaves every other input to it.
- The selection seam is a class attribute, proven under every calling
  convention in test_conventions_llamafactory.py.
- The LoRA branch of ``prepare_model`` (every trainable leaf first): GLM4V /
  Qwen2-Audio crash unpatched and match the data-parallel reference patched on
  2 ranks with different data; a LoRA text model gets its decoder layers back.

The per-family proofs (crash unpatched, DP reference patched, units) are in
test_wrap_selection.py, which runs every framework in ``INTEGRATIONS``.
"""

import re

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")
FSDP2 = pytest.importorskip("llamafactory.v1.plugins.trainer_plugins.distributed.fsdp2",
                            reason="needs LLaMA-Factory >= 0.9.5 (its v1 FSDP2 engine)")

import fsdp2_compat  # noqa: E402
from fsdp2_compat.core import engine  # noqa: E402
from fsdp2_compat.integrations import llamafactory  # noqa: E402
from fsdp2_compat_harness import tiny as tiny_models  # noqa: E402
from fsdp2_compat_harness.ranks import run_ranks  # noqa: E402
from fsdp2_compat_harness.scenarios import train, with_lora  # noqa: E402

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("torch", "transformers", "llamafactory", "peft")

TOL = 1e-5
FAMILIES = [f for f in tiny_models.FAMILIES if tiny_models.unavailable(f) is None]


def released_lookup(model):
    """The unpatched ``get_transformer_layer_cls`` of the installed release (under any wrapper)."""
    fn = FSDP2.get_transformer_layer_cls
    return getattr(fn, "__wrapped__", fn)(model)


def as_list(model):
    """The same model with its ``_no_split_modules`` as a (sorted) list: what transformers 4.x gives."""
    model._no_split_modules = sorted(model._no_split_modules)
    return model


def test_the_lookup_target_applies_to_the_installed_release():
    fsdp2_compat.apply("glm4v")
    rows = {o.target: o for _, o in engine.outcomes(["glm4v"])}
    assert rows[llamafactory.LAYER_CLASS_LOOKUP].kind == engine.APPLIED
    assert rows[llamafactory.WRAP_SELECTION].kind == engine.APPLIED
    assert hasattr(FSDP2.get_transformer_layer_cls, "__wrapped__")
    assert hasattr(FSDP2.FSDP2Engine.__dict__["prepare_model"], "__wrapped__")
    fsdp2_compat.revert()
    assert not hasattr(FSDP2.get_transformer_layer_cls, "__wrapped__")


@pytest.mark.parametrize("family", FAMILIES)
def test_lookup_fix_picks_what_the_release_picks_from_the_same_names_as_a_list(family):
    model = tiny_models.build(family)
    if not isinstance(model._no_split_modules, set) or not model._no_split_modules:
        pytest.skip("this transformers gives %r, not a non-empty set" % (model._no_split_modules,))
    from_list = released_lookup(as_list(tiny_models.build(family)))
    assert from_list is not None, family
    fsdp2_compat.apply("glm4v")
    assert FSDP2.get_transformer_layer_cls(model) is from_list


def test_without_the_fix_a_set_finds_no_layer_class_for_vlms():
    """The bug: on transformers 5.x upstream falls back to model.model.layers, which VLMs do not have."""
    model = tiny_models.build("glm4v")
    if not isinstance(model._no_split_modules, set):
        pytest.skip("transformers 4.x: _no_split_modules is a list")
    assert released_lookup(model) is None
    assert released_lookup(tiny_models.build("qwen2")).__name__ == "Qwen2DecoderLayer"  # model.model.layers


def test_lookup_fix_gives_a_lora_text_model_its_decoder_layer():
    pytest.importorskip("peft", reason="needs peft")
    model = with_lora(tiny_models.build("qwen2"))
    if not isinstance(model._no_split_modules, set):
        pytest.skip("transformers 4.x: _no_split_modules is a list")
    assert released_lookup(model) is None  # PeftModel.model is the LoraModel: no .layers
    fsdp2_compat.apply("glm4v")
    assert FSDP2.get_transformer_layer_cls(model).__name__ == "Qwen2DecoderLayer"


def test_lookup_fix_leaves_lists_and_unmatched_names_to_the_release():
    fsdp2_compat.apply("glm4v")
    listed = as_list(tiny_models.build("glm4v"))
    assert FSDP2.get_transformer_layer_cls(listed) is released_lookup(listed)
    unmatched = tiny_models.build("qwen2")
    unmatched._no_split_modules = {"NoSuchLayer"}
    assert FSDP2.get_transformer_layer_cls(unmatched) is released_lookup(unmatched)  # the fallback


@pytest.mark.parametrize("family", ["glm4v", "qwen2_audio"])
def test_lora_branch_crashes_unpatched_and_matches_the_reference_patched(family):
    pytest.importorskip("peft", reason="needs peft")
    unpatched = run_ranks(train, 2, "llamafactory", family, None, kwargs={"lora": True})
    assert all(re.search(r"^step 0: RuntimeError: .* got mixed torch.Tensor and DTensor", r["error"] or "")
               for r in unpatched), [r["error"] for r in unpatched]
    results = run_ranks(train, 2, "llamafactory", family, "glm4v", kwargs={"lora": True})
    for rank, r in enumerate(results):
        assert r["error"] is None, (rank, r["error"])
        assert sum("lora_" in n for n in r["wrapped"]) >= 4, r["wrapped"]  # the LoRA leaves got their units
        assert r["grads_checked"] > 0 and r["loss_err"] < TOL and r["param_err"] < TOL, r
        assert r["grad_err"] < TOL, (rank, r["worst_grad"], r["grad_err"])
    assert results[0]["losses"] != results[1]["losses"]


def test_lora_text_model_gets_its_decoder_layers_patched():
    pytest.importorskip("peft", reason="needs peft")
    from fsdp2_compat.core import guards

    if guards.in_range(guards.installed_version("transformers"), "<5.0.0rc0"):
        pytest.skip("transformers 4.x gives _no_split_modules as a list: LLaMA-Factory's own lookup finds the "
                    "decoder layers unpatched (the lookup bug needs 5.x's set)")
    unpatched = run_ranks(train, 2, "llamafactory", "qwen2", None, kwargs={"lora": True})
    patched = run_ranks(train, 2, "llamafactory", "qwen2", "glm4v", kwargs={"lora": True})
    layers = {n for n in patched[0]["wrapped"] if re.fullmatch(r".*\.layers\.\d+", n)}
    assert len(layers) == 2 and not layers & set(unpatched[0]["wrapped"]), (unpatched[0]["wrapped"], layers)
    for r in unpatched + patched:
        assert r["error"] is None and r["loss_err"] < TOL and r["grad_err"] < TOL, (r["error"], r["worst_grad"])
