"""``fsdp2-compat audit --batches``: rank divergence found on one CPU, per batch kind, under a plan's real
``fully_shard`` (a fake 2-rank process group), unpatched and with the family's catalogue patch.

What is found must be what two real ranks do: the vision unit of Qwen2.5-VL entered 0 / 2 / 4 times for
text / image / image+video (the ranks' gloo mismatch of ``tests/guard/test_guard.py`` and
``tests/integrations/test_mixed_media_kinds.py``), gone with its patch; Qwen3-MoE's experts left without a
gradient by some tokens on transformers 4.x (ModuleList experts; the 2-rank gloo mismatch of
``test_guard``), and nothing on 5.x (3-D experts); a family outside the catalogue from its config.json alone.
"""

import json
import os

import pytest

pytest.importorskip("torch", reason="needs torch")
pytest.importorskip("transformers", reason="needs transformers")

from fsdp2_compat_harness.audit import cli  # noqa: E402

DEPENDS_ON = ("torch", "transformers")

HERE = os.path.dirname(os.path.abspath(__file__))


def _audit(capsys, *argv):
    code = cli.main(list(argv) + ["--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def _transformers_major():
    import transformers

    return int(transformers.__version__.split(".")[0])


def test_a_text_only_micro_batch_skips_the_vision_unit_and_the_patch_removes_it(capsys):
    code, rep = _audit(capsys, "--model", "qwen2_5_vl", "--plan", "skyrl", "--batches")
    div = rep["divergence"]
    assert div["kinds"] == ["text", "image", "video", "image+video"]
    by_unit = {f["unit"]: f for f in div["findings"]}
    tower = by_unit["model.visual.blocks.0"]
    assert tower["gathers"] == {"text": 0, "image": 2, "video": 2, "image+video": 4}  # forward + backward each
    assert tower["reduced"]["text"] == 0 and tower["reduced"]["image"] == tower["reduced"]["image+video"] > 0
    assert tower["nccl"].startswith("hang")
    assert tower["patch"] == "qwen2vl"
    assert "" in by_unit and by_unit[""]["missing"]["text"]  # the root's patch embed / merger: no gradient on text
    assert not any(f["unit"].startswith("model.language_model") for f in div["findings"])
    assert code == 1


def test_a_subset_of_kinds_and_a_kind_the_family_cannot_take(capsys):
    _, rep = _audit(capsys, "--model", "qwen2_5_vl", "--plan", "fixed", "--batches", "image,video")
    assert rep["divergence"]["kinds"] == ["image", "video"] and rep["divergence"]["findings"] == []
    code = cli.main(["--model", "glm4v", "--plan", "fixed", "--batches", "video"])
    assert code == 2 and "cannot take video" in capsys.readouterr().err


def _write(tmp_path, name, config):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
             "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48, "num_experts": 128,
             "num_experts_per_tok": 8, "decoder_sparse_step": 1, "norm_topk_prob": True, "vocab_size": 151936,
             "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645}


def test_experts_some_tokens_do_not_reach_are_found_on_4x_only(capsys, tmp_path):
    from fsdp2_compat import registry

    _, rep = _audit(capsys, "--config-json", _write(tmp_path, "config.json", QWEN3_MOE), "--plan", "skyrl",
                    "--batches")
    findings = rep["divergence"]["findings"]
    if _transformers_major() >= 5:
        assert findings == [], findings  # 3-D experts: every token's rank has every gradient
        return
    assert findings and all(f["experts"] for f in findings), findings
    assert all(f["unit"].startswith("model.layers.") for f in findings)
    listed = registry.for_model_type("qwen3_moe")
    covers = listed is not None and any(str(t.seam).startswith("fsdp2_compat.fixes.experts") for t in listed.targets)
    assert all(f["patch"] == (listed.name if covers else None) for f in findings), findings
    assert all(f["advice"] == ("apply patch '%s'" % listed.name if covers else "no patch covers this")
               for f in findings)


ERNIE_MOE = {"architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe", "hidden_size": 2560,
             "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_attention_heads": 20,
             "num_key_value_heads": 4, "num_hidden_layers": 28, "moe_num_experts": 64, "moe_k": 6,
             "moe_layer_start_index": 1, "moe_num_shared_experts": 2, "vocab_size": 103424,
             "tie_word_embeddings": True, "use_bias": False}


def test_a_family_outside_the_catalogue_from_its_config_json_alone(capsys, tmp_path):
    """ERNIE-4.5-MoE (no tiny family, no patch): on 4.57 its expert loop skips unreached experts."""
    if _transformers_major() >= 5:
        pytest.skip("transformers 5.x: ERNIE-4.5-MoE's experts are 3-D parameters")
    _, rep = _audit(capsys, "--config-json", _write(tmp_path, "config.json", ERNIE_MOE), "--plan", "fixed",
                    "--batches")
    findings = rep["divergence"]["findings"]
    assert rep["divergence"]["kinds"] == ["text"]
    assert findings and all(f["experts"] and f["patch"] is None for f in findings), findings
    assert all(f["nccl"].startswith(("hang", "wrong gradient")) for f in findings), findings


def test_the_sweep_shows_divergence_and_the_bug_classes_left_per_plan():
    import importlib

    report_mod = importlib.import_module("fsdp2_compat_harness.audit.report")  # the package exports a function

    rows = report_mod.sweep(families=["qwen2_5_vl"], plans=("fixed",))
    (row,) = rows
    assert {f["unit"] for f in row["divergence"]["findings"]} >= {"model.visual.blocks.0"}
    assert row["divergence"]["remaining"] == []  # with qwen2vl every kind runs the tower once
    before, after = row["classes"]
    assert "divergence" in before and after == "none"
    table = report_mod.format_sweep(rows, markdown=True)
    assert "| qwen2_5_vl | fixed |" in table and "-> none |" in table
