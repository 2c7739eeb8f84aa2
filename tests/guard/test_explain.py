"""The guard's error text from every rank's description (no torch): the cause in words and the patch, read
from the catalogue when the error is built."""

from fsdp2_compat.guard import explain

DEPENDS_ON = ()


def _d(kind, unit, params, nth=1, model_type="qwen2_5_vl", unit_params=None, phase="forward"):
    return {"kind": kind, "phase": phase, "unit": unit, "params": list(params),
            "unit_params": list(unit_params or params), "nth": nth, "model_type": model_type}


def test_a_skipped_tower_names_the_unit_the_ranks_and_the_family_patch():
    text = explain.message([_d("all-gather", "model.visual.blocks.0", ["a", "b"]),
                            _d("all-gather", "model.language_model.layers.0", ["c"])], rank=1)
    assert "unit 'model.visual.blocks.0'" in text
    assert "rank 0: all-gather of model.visual.blocks.0 (forward, 2 of its 2 parameters" in text
    assert "rank 1: all-gather of model.language_model.layers.0" in text
    assert "rank 1 skipped the media tower that rank 0 runs" in text
    assert "fix: set FSDP2_COMPAT_PATCHES=qwen2vl" in text
    assert text.endswith("this is rank 1)")


def test_experts_without_gradient_on_one_rank_are_listed():
    every = ["model.layers.0.mlp.experts.%d.up_proj.weight" % i for i in range(3)]
    text = explain.message([_d("reduce-scatter", "model.layers.0", every, model_type="some_new_moe"),
                            _d("reduce-scatter", "model.layers.0", every[:1], model_type="some_new_moe",
                               unit_params=every)])
    assert explain.cause([_d("reduce-scatter", "u", every), _d("reduce-scatter", "u", every[:1])])[0] == "experts"
    assert "rank 1 has none for model.layers.0.mlp.experts.1.up_proj.weight" in text
    assert "no patch covers this for model type 'some_new_moe'" in text
    assert "set_reduce_scatter_unused_params(True)" in text


def test_other_unused_parameters_and_other_paths_say_no_patch():
    assert explain.cause([_d("reduce-scatter", "u", ["u.a", "u.b"]),
                          _d("reduce-scatter", "u", ["u.a"])])[0] == "unused"
    kind, unit, _ = explain.cause([_d("all-gather", "model.layers.1", ["x"]), _d("all-gather", "model.layers.2", ["y"])])
    assert (kind, unit) == ("paths", "model.layers.1")
    assert "no patch covers this" in explain.message([_d("all-gather", "model.layers.1", ["x"]),
                                                      _d("all-gather", "model.layers.2", ["y"])])


def test_the_tower_run_again_is_told_apart_from_a_skip():
    kind, _, words = explain.cause([_d("all-gather", "model.visual.blocks.0", ["a"], nth=2),
                                    _d("all-gather", "model.language_model.layers.0", ["c"])])
    assert kind == "tower-again" and "a 2nd time" in words
