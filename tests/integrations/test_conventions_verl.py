"""verl's fused-forward seams hold however the model's ``forward`` is called (issue #22, calling conventions).

verl installs its fused forward on the model's class (``model.__class__.forward =
forward_with_torch_backend``, a target of ``fixes.gather``), so it runs as a
method.  Here the sharded model gets a subclass whose ``forward`` reaches
verl's one way (``tooling.conventions``: the instance, the class with an
explicit self, ``super()``, ``MethodType`` re-binding, the class attribute
itself, every argument by keyword), through verl's own ``apply_monkey_patch``
and ``apply_fsdp2``, two CPU gloo ranks with different data, against an
unsharded reference trained on the data-parallel average
(``scenarios.train_fused``).  Family: a tiny untied Qwen2 (verl's
``dense_common`` forward, shared by every text model): unpatched it reads the
sharded ``lm_head.weight`` raw (``aten.mm`` mixed Tensor/DTensor); patched,
every gradient is the DP average.
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")

from fsdp2_compat.core import guards  # noqa: E402

if guards.installed_version("verl") is None:  # (not importorskip: ``import verl`` costs seconds per worker)
    pytest.skip("needs verl (the code under test)", allow_module_level=True)

from fsdp2_compat_harness.conventions import CONVENTIONS  # noqa: E402
from fsdp2_compat_harness.ranks import run_ranks  # noqa: E402
from fsdp2_compat_harness.scenarios import train_fused  # noqa: E402

DEPENDS_ON = ("torch", "transformers", "verl")

VERL = guards.installed_version("verl")
pytestmark = pytest.mark.skipif(not guards.in_range(VERL, ">=0.7.1"),
                                reason="verl %s keeps lm_head in the root unit: nothing reads it sharded" % VERL)

TOL = 1e-5


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_fused_forward_gathers_lm_head_however_forward_is_called(convention):
    unpatched = run_ranks(train_fused, 2, "qwen2", None, kwargs={"convention": convention, "steps": 1})
    patched = run_ranks(train_fused, 2, "qwen2", "textlm", kwargs={"convention": convention, "steps": 1})
    for rank, (u, p) in enumerate(zip(unpatched, patched)):
        assert u["forward"] == p["forward"] == "verl.models.transformers.dense_common", u["forward"]
        assert u["error"] is not None and "aten.mm" in u["error"] and "got mixed torch.Tensor and DTensor" in u["error"], \
            (rank, u["error"])
        assert p["error"] is None, (rank, p["error"])
        assert p["kernel_weights"] and all(kind != "DTensor" for kind, _, _ in p["kernel_weights"])
        assert p["lm_head_grad_err"] < TOL and p["grad_err"] < TOL, (rank, p["worst_grad"], p["grad_err"])
    assert patched[0]["losses"] != patched[1]["losses"]


def test_selection_seam_reads_its_arguments_by_keyword_too():
    import fsdp2_compat
    from verl.utils import fsdp_utils

    from fsdp2_compat_harness import tiny as tiny_models

    model = tiny_models.build("glm4v", tie=False)
    layers = sorted(model._no_split_modules)
    names = {id(m): n for n, m in model.named_modules()}

    def selected(**kwargs):
        return [names[id(m)] for m in fsdp_utils._select_fsdp2_wrap_targets(**kwargs)]

    upstream = selected(model=model, fsdp_transformer_layer_cls_to_wrap=layers)
    assert "model.visual.embeddings.position_embedding" in upstream  # its own unit, read raw while sharded
    fsdp2_compat.apply("glm4v")
    by_keyword = selected(model=model, fsdp_transformer_layer_cls_to_wrap=layers)
    assert "model.visual.embeddings.position_embedding" not in by_keyword
    assert by_keyword == [names[id(m)] for m in fsdp_utils._select_fsdp2_wrap_targets(model, layers)]
    assert set(by_keyword) == set(upstream) - {"model.visual.embeddings.position_embedding"}
