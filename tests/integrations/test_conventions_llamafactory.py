"""LLaMA-Factory's selection seam holds however ``FSDP2Engine.prepare_model`` is called (issue #22).

``FSDP2Engine.prepare_model`` is a method seam (``fixes.inline_selection``: the
wrapper publishes the model, the module's ``fully_shard`` consults it).  The
real engine of the installed release gets a subclass whose override reaches
``prepare_model`` one way (``tooling.conventions``: the instance, the class
with an explicit self, ``super()``, ``MethodType`` re-binding, the class
attribute itself, every argument by keyword; and a keyword ``model`` on the
instance), on one CPU gloo rank: the claim is the corrected units (GLM4V's
vision ``position_embedding`` no longer gets its own unit, the vision blocks
still do), the same under every convention, and upstream's units unpatched.
The crash and gradient proofs of those units are in test_wrap_selection.py.

``get_transformer_layer_cls`` is a function seam: called with its argument by
keyword it gives what the positional call gives.
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")
FSDP2 = pytest.importorskip("llamafactory.v1.plugins.trainer_plugins.distributed.fsdp2",
                            reason="needs LLaMA-Factory >= 0.9.5 (its v1 FSDP2 engine)")

import fsdp2_compat  # noqa: E402
from fsdp2_compat_harness import tiny as tiny_models  # noqa: E402
from fsdp2_compat_harness.conventions import CONVENTIONS  # noqa: E402
from fsdp2_compat_harness.ranks import run_ranks  # noqa: E402
from support.rank_jobs import lf_call_forms  # noqa: E402

DEPENDS_ON = ("torch", "transformers", "llamafactory")

AUX = "model.visual.embeddings.position_embedding"  # GLM4V's raw-read table


def test_prepare_model_selects_the_corrected_units_under_every_calling_convention():
    [units] = run_ranks(lf_call_forms, 1, "glm4v")
    assert set(units) == set(CONVENTIONS) | {"instance, keywords"}
    for form, got in units.items():
        assert AUX in got["unpatched"], (form, got["unpatched"])  # upstream: its own unit, read raw while sharded
        assert AUX not in got["patched"], (form, got["patched"])
        assert "model.visual.blocks.0" in got["patched"], (form, got["patched"])
        assert got["patched"] == units["instance"]["patched"], form


def test_layer_class_lookup_reads_its_model_passed_by_keyword():
    model = tiny_models.build("glm4v")
    if not isinstance(model._no_split_modules, set):
        pytest.skip("transformers 4.x: _no_split_modules is a list (the lookup fix has nothing to do)")
    assert FSDP2.get_transformer_layer_cls(model=model) is None  # the release on a set
    fsdp2_compat.apply("glm4v")
    found = FSDP2.get_transformer_layer_cls(model=model)
    assert found is not None and found is FSDP2.get_transformer_layer_cls(model)


def test_prepare_model_without_a_module_raises_under_strict_instead_of_running_upstreams_selection(monkeypatch):
    import re

    from fsdp2_compat.core import calls

    fsdp2_compat.apply("glm4v")
    seam = vars(FSDP2.FSDP2Engine)["prepare_model"]
    assert hasattr(seam, "__wrapped__"), "the seam is not installed"
    engine = FSDP2.FSDP2Engine.__new__(FSDP2.FSDP2Engine)
    monkeypatch.setenv("FSDP2_COMPAT_STRICT", "1")
    where = FSDP2.__name__ + ".FSDP2Engine.prepare_model"
    for call in (lambda: seam(engine, "not a model"), lambda: engine.prepare_model(model=None)):
        with pytest.raises(calls.SeamInputError, match=re.escape(where) + " was called without an nn.Module"):
            call()
