"""The framework-independent selector, on real transformers models (and PEFT)."""

import pytest

nn = pytest.importorskip("torch.nn", reason="needs torch")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")

from fsdp2_compat_harness import tiny as tiny_models  # noqa: E402
from fsdp2_compat.fixes.selection import (  # noqa: E402
    auxiliary_embeddings,
    embeddings_tied,
    layer_class_names,
    select_wrap_targets,
)

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("torch", "transformers", "peft")


def names(model, modules):
    lookup = {id(m): n for n, m in model.named_modules()}
    return [lookup[id(m)] for m in modules]


@pytest.mark.parametrize("spec", ["Qwen2DecoderLayer", ["Qwen2DecoderLayer"], {"Qwen2DecoderLayer"}, ("Qwen2DecoderLayer",)])
def test_layer_classes_may_be_a_string_list_tuple_or_set(spec):
    model = tiny_models.build("qwen2")
    assert names(model, select_wrap_targets(model, spec)) == [
        "model.embed_tokens", "model.layers.0", "model.layers.1"
    ]


def test_tied_embeddings_by_identity_get_no_unit_whatever_the_config_says():
    model = tiny_models.build("qwen2", tie=True)
    model.config.tie_word_embeddings = False  # a lying flag must not matter
    assert embeddings_tied(model)
    assert names(model, select_wrap_targets(model, model._no_split_modules)) == ["model.layers.0", "model.layers.1"]


def test_untied_embeddings_whatever_the_config_says():
    model = tiny_models.build("qwen2", tie=False)
    model.config.tie_word_embeddings = True
    assert not embeddings_tied(model)
    assert "model.embed_tokens" in names(model, select_wrap_targets(model, model._no_split_modules))


def test_glm4v_auxiliary_embedding_stays_out():
    model = tiny_models.build("glm4v")
    chosen = names(model, select_wrap_targets(model, model._no_split_modules))
    assert "model.visual.embeddings.position_embedding" not in chosen
    assert "model.language_model.embed_tokens" in chosen
    assert names(model, auxiliary_embeddings(model)) == ["model.visual.embeddings.position_embedding"]


def test_nested_layer_class_is_left_to_its_selected_ancestor():
    if tiny_models.unavailable("qwen2_audio") is not None:
        pytest.skip(str(tiny_models.unavailable("qwen2_audio")))
    model = tiny_models.build("qwen2_audio")
    chosen = names(model, select_wrap_targets(model, ["Qwen2AudioEncoderLayer", "Qwen2AudioAttention", "Qwen2DecoderLayer"]))
    # audio_tower.layers.0, or model.audio_tower.layers.0 from transformers 5.10
    [layer] = [n for n, m in model.named_modules() if type(m).__name__ == "Qwen2AudioEncoderLayer"]
    assert layer.endswith("audio_tower.layers.0") and layer in chosen
    assert not any(n.startswith(layer + ".") for n in chosen)


class Bare(nn.Module):
    """A model with no config, no get_input_embeddings: the selector must cope."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(4, 2)
        self.block = nn.Linear(2, 2)


def test_model_without_config_or_embedding_getters():
    model = Bare()
    assert not embeddings_tied(model)
    assert names(model, select_wrap_targets(model, "Linear")) == ["block"]
    assert names(model, select_wrap_targets(model, None)) == []
    assert layer_class_names([nn.Linear, "X", None]) == frozenset({"Linear", "X"})


class RaisingGetters(Bare):
    def get_input_embeddings(self):
        raise NotImplementedError

    def get_output_embeddings(self):
        raise NotImplementedError


def test_getters_that_raise_not_implemented_mean_no_embedding():
    model = RaisingGetters()
    assert not embeddings_tied(model)
    assert names(model, select_wrap_targets(model, "Linear")) == ["block"]


def test_peft_wrapper_around_the_input_embedding_is_the_unit():
    peft = pytest.importorskip("peft")
    model = tiny_models.build("qwen2")
    config = peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["embed_tokens"])
    peft_model = peft.get_peft_model(model, config)
    chosen = select_wrap_targets(peft_model, ["Qwen2DecoderLayer"])
    embedding = peft_model.get_input_embeddings()
    assert type(embedding).__name__ == "ModulesToSaveWrapper"
    assert any(m is embedding for m in chosen)
    # The copies PEFT keeps inside the wrapper are not auxiliary embeddings.
    assert auxiliary_embeddings(peft_model) == []
