"""The wrap-plan auditor (fsdp2_compat_harness.audit): one CPU forward, no process group.

What it must see: GLM4V's vision position table read raw (``grid_sample``)
when upstream plans give it a unit of its own, verl's fused forward reading a
separately sharded ``lm_head.weight``, and nothing on the controls.  The
auditor's own rules (metadata is not a read, taint follows ops on the
sharded value, ownership of tied weights by identity, nested non-unit
children) are tested on hand-made modules.  The sweep crosses every
vision/audio tiny family with the four plans and checks it against the
families tests/integrations/test_wrap_selection.py proves crash on real FSDP2.
"""

import json
import time

import pytest

torch = pytest.importorskip("torch", reason="needs torch (one CPU forward)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")
nn = torch.nn

import fsdp2_compat  # noqa: E402
from fsdp2_compat import registry  # noqa: E402
from fsdp2_compat.core import engine, guards  # noqa: E402
from fsdp2_compat_harness import audit  # noqa: E402
from fsdp2_compat.fixes import glm4v_forward  # noqa: E402
from fsdp2_compat_harness import tiny as tiny_models  # noqa: E402
from support import real_size  # noqa: E402

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("torch", "transformers")

VERL = guards.installed_version("verl")
needs_verl = pytest.mark.skipif(VERL is None, reason="verl is not installed")
needs_areal = pytest.mark.skipif(guards.installed_version("areal") is None, reason="areal is not installed")
needs_lf = pytest.mark.skipif(guards.installed_version("llamafactory") is None, reason="llamafactory is not installed")
INSTALLED_MARKS = {"verl": needs_verl, "areal": needs_areal, "llamafactory": needs_lf}
GLM4V_POS = "model.visual.embeddings.position_embedding.weight"

# tests/integrations/test_wrap_selection.py proves that every family the catalogue
# lists for the wrap-selection fix crashes unpatched on real FSDP2 under verl / SkyRL.
PATCH_OF = registry.selection_model_types()
CRASHING = tuple(f for f in tiny_models.FAMILIES if f in PATCH_OF)
CONTROLS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")

_MODELS = {}


def tiny(family, tie=False):
    reason = tiny_models.unavailable(family)
    if reason is not None:
        pytest.skip(str(reason))
    key = (family, tie)
    if key not in _MODELS:
        model = tiny_models.build(family, tie=tie)
        _MODELS[key] = (model, tiny_models.make_batch(family, model, seed=0))
    return _MODELS[key]


def run_plan(family, plan, tie=False):
    model, batch = tiny(family, tie)
    return audit.audit(model, batch, audit.plan_modules(model, plan), plan=plan)


def upstream_plans():
    return [pytest.param(p, marks=INSTALLED_MARKS[p]) if p in INSTALLED_MARKS else p for p in audit.UPSTREAM_PLANS]


# ---------------------------------------------------------------------------
# GLM4V


@pytest.mark.depends_on("torch", "transformers", "verl", "areal", "llamafactory")
@pytest.mark.parametrize("plan", upstream_plans())
def test_glm4v_position_embedding_is_the_only_hazard_under_upstream_plans(plan):
    hazards = run_plan("glm4v", plan)
    assert [h.param for h in hazards] == [GLM4V_POS], hazards
    h = hazards[0]
    assert h.owner == "model.visual.embeddings.position_embedding"
    assert h.reader == "model.visual.embeddings" and h.reader_class == "Glm4vVisionEmbeddings"
    assert h.op == "grid_sample" and h.mixed
    assert h.read_op == "view"  # taint followed view -> permute -> unsqueeze -> to into grid_sample
    assert h.patch == "glm4v" and "glm4v" in h.advice


@pytest.mark.depends_on("torch", "transformers", "verl")
@pytest.mark.parametrize("plan", ["fixed", pytest.param("fixed-verl", marks=needs_verl)])
def test_glm4v_fixed_plan_has_no_hazard(plan):
    model, _ = tiny("glm4v")
    assert "model.visual.embeddings.position_embedding" not in audit.plan_modules(model, plan)
    assert run_plan("glm4v", plan) == []


def test_hyperparallel_plan_flags_glm4v_position_embedding_and_no_patch_covers_it():
    model, _ = tiny("glm4v")
    units = audit.plan_modules(model, "hyperparallel")
    assert "model.visual.embeddings.position_embedding" in units  # grandchild of Glm4vVisionModel
    hazards = run_plan("glm4v", "hyperparallel")
    assert [(h.param, h.op) for h in hazards] == [(GLM4V_POS, "grid_sample")]
    assert hazards[0].patch is None and hazards[0].advice.startswith(audit.NO_PATCH)


@pytest.mark.depends_on("torch", "transformers", "verl")
@needs_verl
def test_verl_plan_is_computed_unpatched_while_our_patch_is_applied():
    import importlib

    fsdp2_compat.apply("glm4v")
    fsdp_utils = importlib.import_module("verl.utils.fsdp_utils")
    if guards.in_range(VERL, ">=0.7.1"):
        assert engine.is_applied("glm4v")
        assert hasattr(fsdp_utils._select_fsdp2_wrap_targets, "__wrapped__")  # our seam is in place
    model, _ = tiny("glm4v")
    assert "model.visual.embeddings.position_embedding" in audit.plan_modules(model, "verl")


@pytest.mark.depends_on("torch", "transformers", "llamafactory")
@needs_lf
def test_llamafactory_plan_is_computed_unpatched_while_our_patch_is_applied():
    """The lookup fix is in place, yet the plan shows what 0.9.5 does on transformers 5.x."""
    model, _ = tiny("glm4v")
    fsdp2_compat.apply("glm4v")
    import importlib

    fsdp2 = importlib.import_module("llamafactory.v1.plugins.trainer_plugins.distributed.fsdp2")
    assert engine.is_applied("glm4v") and hasattr(fsdp2.get_transformer_layer_cls, "__wrapped__")
    units = audit.plan_modules(model, "llamafactory")
    assert "model.visual.embeddings.position_embedding" in units
    if isinstance(model._no_split_modules, set):
        assert not any("blocks" in u or "layers" in u for u in units), units  # no layer class found


@pytest.mark.depends_on("torch", "transformers", "areal", "llamafactory")
@pytest.mark.parametrize("plan", [pytest.param("areal", marks=needs_areal), pytest.param("llamafactory", marks=needs_lf)])
def test_upstream_plan_refuses_code_it_does_not_know(plan, monkeypatch):
    from fsdp2_compat.integrations import areal, llamafactory

    target = areal.WRAP_SELECTION if plan == "areal" else llamafactory.WRAP_SELECTION
    monkeypatch.setattr(target, "fingerprints", {"9.9.9": "0000000000000000"})
    model, _ = tiny("glm4v")
    with pytest.raises(audit.AuditInputError, match=r"fingerprint [0-9a-f]{16}, not the code of 9\.9\.9"):
        audit.plan_modules(model, plan)


@pytest.mark.parametrize("framework", [pytest.param("areal", marks=needs_areal),
                                       pytest.param("llamafactory", marks=needs_lf)])
@pytest.mark.depends_on("torch", "transformers", "{framework}")
def test_upstream_plan_is_the_units_the_installed_release_creates(framework):
    """The audit's plan and the release's own entry point on real FSDP2 (1 gloo rank), every family."""
    from fsdp2_compat_harness.ranks import run_ranks
    from support.rank_jobs import wrap_plans

    families = [f for f in tiny_models.FAMILIES if tiny_models.unwrappable(f) is None]
    [plans] = run_ranks(wrap_plans, 1, framework, families, "glm4v")
    for family in families:
        model = tiny_models.build(family)
        assert sorted(audit.plan_modules(model, framework) + ["<root>"]) == plans[family]["unpatched"], family


# ---------------------------------------------------------------------------
# controls


@pytest.mark.depends_on("torch", "transformers", "verl", "areal", "llamafactory")
@pytest.mark.parametrize("plan", upstream_plans() + ["fixed", pytest.param("fixed-verl", marks=needs_verl), "hyperparallel"])
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2", "llama"])
def test_controls_have_no_hazard_under_every_plan(family, plan):
    model, _ = tiny(family)
    units = audit.plan_modules(model, plan)
    if family == "qwen3_vl":
        assert any(u.startswith("model.visual.") for u in units), units  # the vision tower is split
    assert run_plan(family, plan) == []


# ---------------------------------------------------------------------------
# verl's fused forward (apply_monkey_patch patches classes process-wide: run in a child)

_FUSED = """
import contextlib, io, json
from fsdp2_compat_harness import audit
for family in ("qwen3_vl", "qwen2", "glm4v", "glm4v_moe"):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = audit.main(["--model", family, "--plan", "verl", "--fused", "--json"])
    print(json.dumps({"family": family, "rc": rc, "report": json.loads(buf.getvalue()) if rc in (0, 1) else None}))
"""


@pytest.mark.depends_on("torch", "transformers", "verl")
@needs_verl
@pytest.mark.skipif(VERL is None or not guards.in_range(VERL, ">=0.6.0"), reason="verl < 0.6.0 has no fused Qwen3-VL forward")
def test_fused_forward_lm_head_read(warm_python):
    families = ("qwen3_vl", "qwen2", "glm4v", "glm4v_moe")
    for family in families:
        reason = tiny_models.unavailable(family)
        if reason is not None:
            pytest.skip(str(reason))
    proc = warm_python(_FUSED)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["family"] for r in results] == list(families), proc.stdout + proc.stderr
    for r in results:
        rep = r["report"]
        assert rep is not None and rep["fused"], (r, proc.stderr)
        hazards = {h["param"]: h for h in rep["hazards"]}
        if r["family"] == "glm4v":
            # Where verl's GLM4V forward does not run on this transformers as released, the audit applies
            # the glm4v patch's forward targets (never its lm_head ones) and says which.
            adapted = glm4v_forward.adapted_for(guards.installed_version("transformers"))
            notes = [n["message"] for n in rep["notes"] if n["kind"] == "adapted"]
            assert len(notes) == (1 if adapted else 0), rep["notes"]
            assert all(("%s target" % ", ".join(adapted)) in n for n in notes), notes
            # The vision tower's raw read is there under verl's plan whatever the release.
            vision = hazards.pop("model.visual.embeddings.position_embedding.weight")
            assert (vision["op"], vision["patch"]) == ("grid_sample", "glm4v"), vision
        if guards.in_range(VERL, ">=0.7.1"):
            # lm_head is its own unit; the fused forward reads its weight raw in the root's forward.
            assert "lm_head" in rep["units"]
            assert r["rc"] == 1
            [h] = hazards.values()
            assert (h["param"], h["owner"], h["reader"], h["mixed"]) == ("lm_head.weight", "lm_head", "", True)
            # GLM-4.5V gets dense_common's forward, which textlm also covers: the patch named for the model wins.
            assert h["patch"] == {"qwen3_vl": "qwen3vl", "qwen2": "textlm", "glm4v": "glm4v",
                                  "glm4v_moe": "glm4v"}[r["family"]], h
        else:
            # Before 0.7.1 lm_head stays in the root unit: the raw read is safe.
            assert "lm_head" not in rep["units"] and hazards == {}
            assert r["rc"] == (1 if r["family"] == "glm4v" else 0)


# ---------------------------------------------------------------------------
# the auditor's rules, on hand-made modules


class Table(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(8, 4)


class MetadataOnly(Table):
    def forward(self, x):
        w = self.table.weight
        n = w.shape[0] + w.size(0) + w.dim() + w.numel()
        assert w.dtype == torch.float32 and w.device.type == "cpu" and w.ndim == 2 and n > 0
        return x + self.table(torch.arange(4)).sum(0)  # called as a module: unsharded there


class RawRead(Table):
    def forward(self, x):
        scale = self.table.weight.reshape(-1).to(torch.float32)  # stays sharded-derived
        return x * scale.sum()  # a DTensor scalar times a plain tensor: FSDP2 raises here


class Inner(nn.Module):
    def __init__(self, outer_table):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self._outer = [outer_table]  # not a child: reads the parent's table raw

    def forward(self, x):
        return self.proj(x) + self._outer[0].weight[0]


class NestedChildReads(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(8, 4)
        self.inner = Inner(self.table)

    def forward(self, x):
        return self.inner(x)


class Wrapper(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return self.body(x)


def test_metadata_access_alone_is_not_a_hazard():
    model = MetadataOnly()
    assert audit.audit(model, {"x": torch.randn(4)}, ["table"]) == []


def test_raw_read_flagged_at_the_op_that_mixes():
    model = RawRead()
    [h] = audit.audit(model, {"x": torch.randn(4)}, ["table"])
    assert (h.param, h.owner, h.reader, h.reader_class) == ("table.weight", "table", "", "RawRead")
    assert (h.read_op, h.op, h.mixed) == ("reshape", "mul", True)
    assert audit.audit(model, {"x": torch.randn(4)}, []) == []  # in the root unit: safe


def test_nested_non_unit_child_reads_while_the_owning_unit_runs():
    model = Wrapper(NestedChildReads())
    # body is the unit: its forward (and its non-unit child inner's) sees body's params unsharded.
    assert audit.audit(model, {"x": torch.randn(4)}, ["body"]) == []
    # the table its own unit: inner reads it raw -> flagged, reader is the innermost module.
    [h] = audit.audit(model, {"x": torch.randn(4)}, ["body", "body.table"])
    assert (h.param, h.owner, h.reader) == ("body.table.weight", "body.table", "body.inner")
    assert (h.read_op, h.op) == ("__getitem__", "add")
    # an active ancestor unit does not unshard a child unit's parameters
    [h2] = audit.audit(model, {"x": torch.randn(4)}, ["body.table"])
    assert h2.owner == "body.table"


def test_tied_weights_resolved_by_identity():
    model, batch = tiny("qwen2", tie=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    units = audit.plan_modules(model, "fixed")
    assert "model.embed_tokens" not in units and "lm_head" not in units
    assert audit.audit(model, batch, units) == [] and audit.plan_problems(model, units) == []
    # Split the tied weight: the first unit in fully_shard order (embed_tokens, root last) owns it,
    # so lm_head's own forward (in the root unit) reads a sharded weight.
    owners = audit.parameter_owners(model, ["model.embed_tokens"])
    _, name, owner, cands = owners[id(model.lm_head.weight)]
    assert (name, owner, cands) == ("model.embed_tokens.weight", "model.embed_tokens", ["model.embed_tokens", ""])
    [h] = audit.audit(model, batch, ["model.embed_tokens"])
    assert (h.param, h.reader, h.op) == ("model.embed_tokens.weight", "lm_head", "linear")
    [problem] = audit.plan_problems(model, ["model.embed_tokens"])
    assert problem.kind == "split-tied" and "tied parameter model.embed_tokens.weight" in problem.message
    assert problem.short == "split tied: model.embed_tokens.weight"


def test_explicit_plan_and_unknown_names():
    model, batch = tiny("glm4v")
    units = audit.plan_modules(model, "model.visual.embeddings.position_embedding, model.visual.blocks.0")
    assert units == ["model.visual.embeddings.position_embedding", "model.visual.blocks.0"]
    [h] = audit.audit(model, batch, units, plan="explicit")
    assert h.param == GLM4V_POS and h.patch is None
    with pytest.raises(audit.AuditInputError, match="model.visual.embedding"):
        audit.plan_modules(model, "model.visual.embedding")


def test_nested_units_are_a_plan_problem():
    model, _ = tiny("qwen2_audio")
    units = audit.plan_modules(model, "skyrl")
    problems = audit.plan_problems(model, units)
    if not any(p.kind == "nested" for p in problems):
        pytest.skip("this transformers lists no nested layer classes for Qwen2-Audio")
    assert all("is nested in unit" in p.message and p.short.startswith("nested: ") for p in problems if p.kind == "nested")
    assert audit.plan_problems(model, audit.plan_modules(model, "fixed")) == []


def test_a_tiny_audit_takes_well_under_a_second():
    model, batch = tiny("glm4v")
    units = audit.plan_modules(model, "skyrl")
    audit.audit(model, batch, units)  # warm
    start = time.perf_counter()
    audit.audit(model, batch, units)
    elapsed = time.perf_counter() - start
    print("glm4v audit: %.3f s" % elapsed)
    assert elapsed < 1.0


# ---------------------------------------------------------------------------
# CLI


def test_cli_exit_codes_and_json(capsys):
    tiny("glm4v")
    assert audit.main(["--model", "qwen2", "--plan", "fixed"]) == 0
    assert "no hazards" in capsys.readouterr().out
    assert audit.main(["--model", "glm4v", "--plan", "skyrl", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert [h["param"] for h in rep["hazards"]] == [GLM4V_POS] and rep["plan"] == "skyrl"
    assert "model.visual.embeddings.position_embedding" in rep["units"]
    assert audit.main(["--model", "glm4v", "--plan", "skyrl"]) == 1
    table = capsys.readouterr().out
    assert "grid_sample" in table and "glm4v" in table


@pytest.mark.parametrize("argv, names", [
    (["--model", "nope"], ["'nope'", "glm4v", "qwen2"]),
    (["--model", "glm4v", "--plan", "bogus"], ["'bogus'", "verl", "hyperparallel"]),
    (["--model", "glm4v", "--plan", "verl skyrl"], ["'verl skyrl'", "fixed"]),
    (["--model", "glm4v", "--set", "nokey=1"], ["nokey"]),
    (["--model", "glm4v", "--set", "novalue"], ["novalue", "KEY=VALUE"]),
    (["--config", "NotAConfig"], ["NotAConfig"]),
    (["--config-json", "/nonexistent/config.json"], ["/nonexistent/config.json"]),
    ([], ["--model", "glm4v"]),
    (["--model", "glm4v", "--bogus-flag"], ["--bogus-flag"]),
])
def test_cli_bad_input_exits_2_naming_the_value(capsys, argv, names):
    assert audit.main(argv) == 2
    err = capsys.readouterr().err
    for n in names:
        assert n in err, err


def test_cli_config_without_the_tie_flag_skyrl_reads_exits_2_with_the_reason(capsys):
    """Step-3.7's config class has no top-level tie_word_embeddings, which SkyRL reads without a
    default: upstream cannot wrap it at all; the auditor says so instead of a traceback."""
    tiny("step3p7")
    for argv in (["--config", "Step3p7Config", "--plan", "skyrl"], ["--model", "step3p7", "--plan", "skyrl"]):
        assert audit.main(argv) == 2
        err = capsys.readouterr().err
        assert "Step3p7Config has no top-level tie_word_embeddings" in err and "Traceback" not in err, err
    assert audit.main(["--model", "step3p7", "--plan", "fixed"]) == 0  # fsdp2-compat decides by identity


@pytest.mark.skipif(not hasattr(__import__("transformers"), "Gemma4Config"), reason="no Gemma-4 in this transformers")
def test_cli_config_class_with_per_layer_overrides_is_shrunk_and_untied_gemma4_is_a_gap(capsys):
    """Gemma4Config keeps per-layer overrides by layer index: shrinking drops those past the
    tiny layer count.  Untied, Gemma-4 reads its input embedding's weight raw (pad row,
    ``torch.where``): the corrected selection gives that embedding its own unit, so no patch
    covers it (docs/audit-sweep.md, known gaps)."""
    assert audit.main(["--config", "Gemma4Config", "--plan", "skyrl"]) == 0  # tied by default: no unit
    capsys.readouterr()
    untie = ["--set", "tie_word_embeddings=false", "--set", "text_config.tie_word_embeddings=false"]
    assert audit.main(["--config", "Gemma4Config", "--plan", "fixed", "--json"] + untie) == 1
    rep = json.loads(capsys.readouterr().out)
    assert [(h["param"], h["reader_class"], h["op"], h["patch"]) for h in rep["hazards"]] == [
        ("model.language_model.embed_tokens.weight", "Gemma4Model", "where", None)]


def test_cli_config_class_and_config_json(capsys, tmp_path):
    tiny("glm4v")
    assert audit.main(["--config", "Glm4vConfig", "--set", "vision_config.depth=2", "--plan", "skyrl", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert [h["param"] for h in rep["hazards"]] == [GLM4V_POS]
    assert "model.visual.blocks.1" in rep["units"]
    path = tmp_path / "config.json"
    real_size.real_size_config("glm4v").to_json_file(str(path))  # a published config, shrunk on load
    assert audit.main(["--config-json", str(path), "--plan", "skyrl", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert [(h["param"], h["op"]) for h in rep["hazards"]] == [(GLM4V_POS, "grid_sample")]
    # A config class with no tiny family: text-only batch, said so.
    assert audit.main(["--config", "MistralConfig", "--plan", "skyrl", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["hazards"] == [] and rep["notes"][0]["kind"] == "text-only" and "text-only" in rep["notes"][0]["message"]


@pytest.mark.parametrize("family", ["lfm2_vl", "qwen2_audio"])
def test_config_json_keeps_the_files_tying(capsys, tmp_path, family):
    """A published config that is silent about tying gets the config class default, not the tiny
    family's explicit False (LFM2-VL-1.6B is tied: no embedding unit, no hazard)."""
    tiny(family)
    config = real_size.real_size_config(family)
    path = tmp_path / "config.json"
    config.to_json_file(str(path))
    rc = audit.main(["--config-json", str(path), "--plan", "skyrl", "--json"])
    rep = json.loads(capsys.readouterr().out)
    if config.tie_word_embeddings:
        assert rc == 0 and rep["hazards"] == [], rep["hazards"]
    else:
        assert rc == 1 and [h["patch"] for h in rep["hazards"]] == [PATCH_OF[family]]


def test_audit_module_imports_without_torch(python):
    proc = python("import sys, fsdp2_compat_harness.audit; print('torch' in sys.modules, 'transformers' in sys.modules)")
    assert proc.stdout.split() == ["False", "False"]


# ---------------------------------------------------------------------------
# sweep


def test_sweep_matches_the_real_fsdp2_crashes():
    plans = tuple(p for p in audit.SWEEP_PLANS if p not in INSTALLED_MARKS or guards.installed_version(p))
    rows = audit.sweep(plans=plans, batches=False)  # raw reads; divergence: test_audit_batches.py
    print()
    print(audit.format_sweep(rows))
    done = [r for r in rows if "skipped" not in r]
    assert done
    by = {(r["family"], r["plan"]): r for r in done}
    for family in CRASHING:
        removed = tiny_models.raw_read_removed(family)  # PaddleOCR-VL from transformers 5.15.0
        for plan in audit.UPSTREAM_PLANS:
            r = by.get((family, plan))
            if r is None:
                continue
            if removed is not None:
                assert r["hazards"] == [], (family, plan, removed, r["hazards"])
                continue
            assert r["hazards"], (family, plan, "crashes on real FSDP2 but the auditor sees no raw read")
            assert {h["patch"] for h in r["hazards"]} == {PATCH_OF[family]}, (family, plan, r["hazards"])
        if (family, "fixed") in by:
            assert by[(family, "fixed")]["hazards"] == [], family
    for family in CONTROLS:
        for plan in plans:
            if (family, plan) in by:
                assert by[(family, plan)]["hazards"] == [], (family, plan)
    # Plans upstream cannot apply at all are skipped with the reason (Step-3.7 under SkyRL).
    for r in rows:
        if r["plan"] == "skyrl" and "skipped" in r:
            assert "tie_word_embeddings" in r["skipped"], r
    # HyperParallel: no fsdp2-compat patch targets it, so whatever it hits is a known gap.
    for r in done:
        if r["plan"] == "hyperparallel":
            assert all(h["patch"] is None for h in r["hazards"])
