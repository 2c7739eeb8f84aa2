"""``fsdp2-compat doctor``: from a model's config to the patch and the line to export, locally."""

import json
import subprocess
import sys

import pytest

from fsdp2_compat import registry
from fsdp2_compat.integrations import trl as trl_integration
from fsdp2_compat.cli import doctor

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python", "transformers")


def run_doctor(*args):
    proc = subprocess.run([sys.executable, "-m", "fsdp2_compat.cli", "doctor", *args], capture_output=True, text=True,
                          timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize("model_type", [mt for p in registry.PATCHES for mt in p.model_types])
def test_every_catalogued_model_type_gets_its_patch(model_type, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    report = doctor.diagnose(doctor.read_model_type(str(tmp_path))[0])
    assert report["patch"] == registry.for_model_type(model_type).name
    assert {r["dist"] for r in report["rows"]}.isdisjoint(report["absent"])


def test_a_checkpoint_directory_prints_the_export_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm4v", "tie_word_embeddings": False}))
    rc, out, err = run_doctor(str(tmp_path))
    assert rc == 0, err
    assert out.splitlines()[0].startswith("model_type glm4v (from %s): GLM-4.1V, patch `glm4v`" % tmp_path)
    rows = doctor.diagnose("glm4v")["rows"]
    if any(r["verdict"] != "not needed" for r in rows):
        assert out.splitlines()[-1] == "export FSDP2_COMPAT_PATCHES=glm4v"
    else:
        assert "nothing to fix on this stack" in out


def test_the_tiny_models_configs_are_diagnosed_as_saved(tmp_path):
    pytest.importorskip("transformers", reason="needs transformers (the tiny configs)")
    from fsdp2_compat_harness import tiny as tiny_models

    for family in ("glm4v", "qwen3_vl", "qwen2"):
        if tiny_models.unavailable(family) is not None:
            continue
        tiny_models.quiet(tiny_models.tiny_config, family, False).save_pretrained(str(tmp_path / family))
        rc, out, err = run_doctor(str(tmp_path / family))
        assert rc == 0 and "patch `%s`" % registry.for_model_type(family).name in out.splitlines()[0], out + err


def test_an_unknown_model_type_says_nothing_is_known_and_how_to_audit_it():
    rc, out, err = run_doctor("--model-type", "bert")
    assert rc == 0 and "nothing known to be needed" in out and "audit --config-json" in out, out + err


@pytest.mark.parametrize("case", ["missing", "empty-dir", "not-json", "no-model-type", "both", "neither"])
def test_bad_input_is_one_line_and_exit_code_2(case, tmp_path):
    bad = tmp_path / "config.json"
    args = {
        "missing": [str(tmp_path / "nope.json")],
        "empty-dir": [str(tmp_path)],
        "not-json": [str(bad)],
        "no-model-type": [str(bad)],
        "both": [str(bad), "--model-type", "glm4v"],
        "neither": [],
    }[case]
    if case == "not-json":
        bad.write_text("{not json")
    elif case in ("no-model-type", "both"):
        bad.write_text(json.dumps({"architectures": ["X"]}))
    rc, out, err = run_doctor(*args)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (out, err)
    assert err.startswith("fsdp2-compat doctor: ")


def test_a_release_is_classified_by_the_catalogues_own_facts():
    target = trl_integration.FUSED_LM_HEAD
    assert doctor.classify(target, "1.16.0") == ("fixes", "proven on this release")
    assert doctor.classify(target, "1.14.2")[0] == "not covered"
    assert doctor.classify(target, "1.0.0")[0] == "not needed"
    assert doctor.classify(target, "9.0.0")[0] == "unknown release"


def test_moe_experts_are_classified_by_the_loop_each_release_has():
    """transformers 4.x loops that skip unreached experts are fixed; 5.x's 3-D experts and 4.40-4.51's
    run-every-expert loop are not needed; the 3-D-only MoE VLMs are reported not affected."""
    from fsdp2_compat.integrations import transformers_moe

    qwen3_moe = next(t for t in transformers_moe.TEXT if "qwen3_moe" in t.module)
    assert doctor.classify(qwen3_moe, "4.57.6") == ("fixes", "proven on this release")
    assert doctor.classify(qwen3_moe, "4.54.0")[0] == "fixes"
    assert doctor.classify(qwen3_moe, "4.52.0") == ("not needed", transformers_moe.EVERY_EXPERT)
    assert doctor.classify(qwen3_moe, "5.8.0") == ("not needed", transformers_moe.THREE_D)
    assert doctor.classify(transformers_moe.GLM4V_MOE[0], "4.57.6")[0] == "fixes"
    code, out, _ = run_doctor("--model-type", "qwen3_vl_moe")
    assert code == 0 and "not affected    MoE experts: routed experts are 3-D" in out, out
