"""Mixed text/image micro-batches across ranks (issue #20): proven on real FSDP2, 2 CPU gloo ranks.

One rank's micro-batch has an image, the other's is text-only, then the reverse
(``STEPS``), through each framework's own wrapping (``accum_jobs._prepare``:
verl's and SkyRL's ``apply_fsdp2``, AReaL's ``parallelize_model``,
LLaMA-Factory's ``FSDP2Engine.prepare_model``, accelerate's
``Accelerator.prepare`` with an FSDP2 plugin as TRL's trainers and the HF
``Trainer`` use it; on CPU accelerate never selects FSDP, ``trl_scenarios.cpu_fsdp``
sets it as its GPU branch would, nothing else).  Plain transformers forwards.

- Unpatched (the family's patch without its mixed-ranks targets: the other
  fixes do not help), the text-only rank skips the vision units' collectives
  and gloo reports the mismatch (it aborts that rank; its stderr is kept,
  ``support.mixed_jobs``), under a 20 s process-group timeout for the other
  rank (never a real hang).
- Patched, both steps complete and every gradient equals the unsharded
  reference trained on the data-parallel average (fp32 1e-5), with the sync on
  every micro-batch and with it deferred over 2 micro-batches (bf16 params /
  fp32 reduce too: the accumulation fix of ``fixes/accumulation.py`` and this
  one together).
- verl's own forwards (``apply_monkey_patch``, fused kernels, torch backend)
  run their own dummy vision forward: exact without this fix, and with it the
  wrapper never runs (verl replaced the class's ``forward``): no second dummy.
"""

import os
import tempfile

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")

from fsdp2_compat import integrations, registry  # noqa: E402
from fsdp2_compat.core import guards  # noqa: E402
from fsdp2_compat_harness.ranks import RankError, run_ranks  # noqa: E402
from support import accum_jobs, mixed_jobs  # noqa: E402

DEPENDS_ON = ("torch", "transformers", "{framework}")

_close = accum_jobs.assert_close  # fp32 1e-5; bf16 within bf16 tolerance
PG_TIMEOUT = 20
# rank 0 image / rank 1 text-only, then the reverse, then again: a rank's first text-only micro-batch records its
# dummy, the next one is walked (fixes.unit_walk) beside the other rank's image; with accumulation, each rank
# mixes too (the first micro-batch of a step deferred, the second synced; each rank walks in the second step)
STEPS = ((("image",), ("text",)), (("text",), ("image",)), (("image",), ("text",)))
ACCUM_STEPS = ((("image", "text"), ("text", "image")), (("text", "image"), ("image", "text")))
SHORT_STEPS = STEPS[:2]  # where only the first text-only micro-batch matters (unpatched, verl's own forwards)
MISMATCH = "Received data size doesn't match expected size. Is there a distributed collective mismatch"

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "glm4v", "qwen3_5")  # qwen3_5: accum_jobs.tiny_qwen3_5 (test-only)
USER_PATCH = {f: registry.for_model_type(f).name for f in FAMILIES}
PATCHED_CASES = ("fp32 every", "fp32 deferred", "bf16 deferred")
ACCELERATE = "accelerate"
TRL = guards.installed_version("trl")


def _params():
    from fsdp2_compat_harness import tiny

    wrappers = [(i.dist, None if guards.installed_version(i.dist) else "%s not in this pinned set" % i.dist)
                for i in integrations.wrapping()]
    wrappers.append((ACCELERATE, None if TRL else "trl not in this pinned set (accelerate's FSDP2 preparation "
                     "is proven as TRL's trainers use it)"))
    out = []
    for framework, missing in wrappers:
        for family in FAMILIES:
            reason = missing
            if reason is None and family == "qwen3_5" and not tiny.exports("Qwen3_5ForConditionalGeneration"):
                reason = "transformers %s has no Qwen3.5" % guards.installed_version("transformers")
            if reason is None and USER_PATCH[family] is None:
                reason = "no patch for %s" % family
            # One group per framework: ``_patched`` runs every family of a framework in one pair of rank
            # processes, so all of that framework's cases must share the worker holding its results.
            marks = [pytest.mark.xdist_group("mixed-%s" % framework)]
            if _tiny_family(family):  # whether upstream can wrap it is decided at setup (it builds one)
                marks.append(pytest.mark.wrappable(family))
            if reason:
                marks.append(pytest.mark.skip(reason=reason))
            out.append(pytest.param(framework, family, marks=marks, id="%s-%s" % (framework, family)))
            if not reason:
                RUNNABLE.add((framework, family))
    return out


def _tiny_family(family):
    """A family of ``tooling.tiny`` (qwen3_5 is ``accum_jobs.tiny_qwen3_5``, not one)."""
    return family != "qwen3_5"


RUNNABLE = set()  # (framework, family) no collection-time reason skips; tiny.wrappable is decided at setup
PARAMS = _params()
# The unpatched stall is shown once per framework, on the family (the same mechanism for every tower).
UNPATCHED_FAMILY = "qwen2_5_vl"
_RESULTS = {}


PATCHED_CASES = ("fp32 every", "fp32 deferred", "bf16 deferred")


def _patched(framework, family):
    """Every family's patched cases of one framework, in one pair of rank processes."""
    key = ("patched", framework)
    if key not in _RESULTS:
        from fsdp2_compat_harness import tiny

        # The families whose tests run: a tiny family upstream cannot wrap here is skipped at setup (wrappable mark).
        families = [f for f in FAMILIES
                    if (framework, f) in RUNNABLE and (not _tiny_family(f) or tiny.unwrappable(f) is None)]
        cases = [(name, "user", name.split()[0], name.split()[1], STEPS if name.endswith("every") else ACCUM_STEPS)
                 for name in PATCHED_CASES]
        per_rank = run_ranks(mixed_jobs.per_family, 2, framework, families, cases, timeout=300)
        _RESULTS[key] = {f: [r[f] for r in per_rank] for f in families}
    return _RESULTS[key][family]


def _unpatched(framework, family):
    """The family's patch without its mixed-ranks targets, under a short process-group timeout.

    ``[(what each rank returned or died of, its stderr)]``: gloo aborts the rank that sees the mismatch.
    """
    key = ("unpatched", framework, family)
    if key not in _RESULTS:
        cases = [("unpatched", "user-without-mixed", "fp32", "every", SHORT_STEPS)]
        with tempfile.TemporaryDirectory(prefix="mixed_ranks_") as tmp:
            try:
                got = run_ranks(mixed_jobs.with_stderr_file, 2, tmp, framework, [family], cases,
                                timeout=PG_TIMEOUT + 60, retries=0, pg_timeout=PG_TIMEOUT)
                outcomes = [r[family]["unpatched"]["error"] for r in got]
            except RankError as exc:
                outcomes = [exc.errors.get(rank, ("reported nothing else", ""))[0] for rank in range(2)]
            stderr = []
            for rank in range(2):
                path = os.path.join(tmp, "rank%d.err" % rank)
                stderr.append(open(path, encoding="utf-8", errors="replace").read() if os.path.exists(path) else "")
        _RESULTS[key] = list(zip(outcomes, stderr))
    return _RESULTS[key]


@pytest.mark.parametrize("framework,family", [p for p in PARAMS if p.values[1] == UNPATCHED_FAMILY])
def test_unpatched_a_text_only_rank_breaks_the_vision_units_collectives(framework, family):
    ranks = _unpatched(framework, family)
    # gloo sees the first mismatched collective at once (the text-only rank's next all-gather is a
    # text unit's, the image rank's a vision unit's): that rank aborts, the other one fails or times out
    assert any(MISMATCH in outcome or MISMATCH in stderr for outcome, stderr in ranks), ranks
    assert not any(outcome is None for outcome, _ in ranks), ranks  # no rank trained through it


@pytest.mark.parametrize("framework,family", PARAMS)
@pytest.mark.parametrize("case", PATCHED_CASES)
def test_patched_mixed_ranks_train_to_the_dp_average(framework, family, case):
    results = _patched(framework, family)
    for rank, r in enumerate(results):
        _close(r[case], case.split()[0], "%s %s %s rank %d" % (framework, family, case, rank))
    # the text-only rank ran the dummy vision forward, once per text-only micro-batch; the image rank never;
    # each rank's first one recorded (the real dummy), the later ones walked the units
    text_micro_batches = [sum(k == "text" for step in (STEPS if case.endswith("every") else ACCUM_STEPS)
                              for k in step[rank]) for rank in range(2)]
    assert [r[case]["dummy_forwards"] for r in results] == text_micro_batches, results
    assert [r[case]["walks"] for r in results] == [max(n - 1, 0) for n in text_micro_batches], results
    if case.startswith("fp32"):  # (bf16 losses may round to the same value on both ranks)
        assert results[0][case]["losses"] != results[1][case]["losses"], "same data on both ranks"


# ---------------------------------------------------------------------------
# verl's own forwards: its dummy, not ours

VERL = guards.installed_version("verl")
VERL_FAMILIES = ("qwen2_5_vl", "qwen3_vl")  # verl's GLM4V dummy hard-codes 1176-wide patches (real GLM-4.1V only)


@pytest.mark.skipif(not VERL or not guards.in_range(VERL, ">=0.7.1"),
                    reason="verl %s: the fused-forward runs need verl >= 0.7.1 (lm_head its own unit)" % VERL)
@pytest.mark.parametrize("framework", ["verl"])
@pytest.mark.parametrize("family", VERL_FAMILIES)
def test_verl_own_forwards_need_nothing_and_get_no_second_dummy(framework, family):
    key = ("verl own", framework)
    if key not in _RESULTS:
        cases = [("with", "user", "fp32", "every", SHORT_STEPS),
                 ("without", "user-without-mixed", "fp32", "every", SHORT_STEPS)]
        _RESULTS[key] = run_ranks(mixed_jobs.per_family, 2, framework, VERL_FAMILIES, cases, kwargs={"fused": True},
                                  timeout=300)
    for rank, per_family in enumerate(_RESULTS[key]):
        r = per_family[family]
        for name in ("with", "without"):
            _close(r[name], "fp32", "verl own forward %s %s rank %d" % (family, name, rank))
            assert r[name]["dummy_forwards"] == 0, r[name]  # verl's forward replaced the class's: ours never ran


@pytest.mark.skipif(not VERL or not guards.in_range(VERL, ">=0.8.0.dev0"),
                    reason="verl %s: the Qwen2-VL forward with a text-only dummy runs on transformers 5.x from 0.8.0"
                    % VERL)
@pytest.mark.skipif(not guards.in_range(guards.installed_version("transformers"), ">=5.0.0"),
                    reason="transformers < 5.0.0: the vision tower returns the tensor verl's dummy expects")
def test_verl_own_qwen2_vl_forward_fails_every_text_only_micro_batch_without_its_fix():
    """verl's own dummy calls ``.mean()`` on the vision output, an object from transformers 5.0.0:
    one rank, one text-only micro-batch (no FSDP2 needed to see it); the qwen2vl patch carries the fix."""
    cases = [("bare", ["t-qwen2vl-without-verl-forward"], "fp32", "every", ((("text",),),)),
             ("fixed", ["t-qwen2vl-without-mixed"], "fp32", "every", ((("text",),),))]
    (r,) = run_ranks(accum_jobs.accumulation_cases, 1, "verl", "qwen2_5_vl", cases, kwargs={"fused": True})
    assert r["bare"]["error"] == ("step 0: AttributeError: 'BaseModelOutputWithPooling' object has no attribute "
                                  "'mean'"), r["bare"]
    _close(r["fixed"], "fp32", "verl own Qwen2.5-VL forward, text-only, with the vision-output fix")



def test_one_process_gets_no_dummy_and_status_says_why():
    """No process group (or one rank): the wrapper is applied but runs transformers' forward untouched."""
    import fsdp2_compat
    from fsdp2_compat.core import engine
    from fsdp2_compat.fixes import mixed_media
    from fsdp2_compat_harness import tiny
    from fsdp2_compat_harness.tiny.text import text_only

    fsdp2_compat.apply("qwen2vl")
    model = tiny.build("qwen2_5_vl")
    (target,) = [t for t in registry.MIXED_MEDIA if t.attr == "Qwen2_5_VLModel.forward"]
    assert target in registry.patch("qwen2vl").targets
    outcome = dict((o.target.key, o) for _, o in engine.outcomes(["qwen2vl"]))[target.key]
    installed = guards.installed_version("transformers")
    if not guards.in_range(installed, ">=4.57.0,<=5.24.0"):
        assert outcome.kind != engine.APPLIED, outcome.as_dict()
        return
    assert outcome.kind == engine.APPLIED, outcome.as_dict()
    assert mixed_media.needed_for(model.model) == (
        False, "torch.distributed is not initialised with more than one rank")
    batch = text_only(tiny.make_batch("qwen2_5_vl", model, seed=1), seed=2)
    before = mixed_media.STATS["dummy_forwards"]
    model(**batch).loss.backward()
    assert mixed_media.STATS["dummy_forwards"] == before
    assert all(p.grad is None for p in model.model.visual.parameters())  # the tower did not run
    assert mixed_media.unknown_tower(tiny.build("qwen2")) == "it has no `visual` tower"


@pytest.mark.skipif(not VERL or not guards.in_range(VERL, ">=0.6.0"),
                    reason="verl %s: its own Qwen2-VL forward with the text-only dummy is 0.6.0+" % VERL)
def test_status_says_not_needed_where_verl_installed_its_own_forward(warm_python):
    """verl's ``apply_monkey_patch`` assigns its own ``Qwen2_5_VLModel.forward`` over ours: status says that code
    runs instead ("not needed": it runs its own dummy, proven above), never "applied"."""
    out = warm_python("""
        import fsdp2_compat
        fsdp2_compat.apply("qwen2vl")
        from fsdp2_compat_harness import tiny
        from verl.models.transformers.monkey_patch import apply_monkey_patch
        model = tiny.build("qwen2_5_vl")
        def row():
            return [r for r in fsdp2_compat.status(["qwen2vl"]) if r["target"].endswith("Qwen2_5_VLModel.forward")][0]
        print("before", row()["outcome"])
        apply_monkey_patch(model, use_remove_padding=False)
        r = row()
        print("after", r["outcome"], "|", r["detail"])
    """).stdout
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.splitlines() if line.startswith(("before", "after"))}
    if not guards.in_range(guards.installed_version("transformers"), ">=4.57.0,<=5.24.0"):
        pytest.skip("transformers %s: the target does not apply here" % guards.installed_version("transformers"))
    assert lines["before"] == "applied", out
    assert lines["after"] == ("not needed | Qwen2_5_VLModel.forward was replaced after the patch by "
                              "verl.models.transformers.qwen2_vl.qwen2_vl_base_forward, which runs instead"), out


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
def test_one_unit_around_the_whole_model_needs_it_too(patched, tmp_path):
    """No vision unit of its own: the root unit's reduce-scatter is shorter on the text-only rank (its vision
    parameters have no gradient).  The fix finds the enclosing unit (``mixed_media.tower_is_sharded``)."""
    if not guards.in_range(guards.installed_version("transformers"), ">=4.57.0,<=5.24.0"):
        pytest.skip("transformers %s: the target does not apply here" % guards.installed_version("transformers"))
    try:
        results = run_ranks(mixed_jobs.root_unit_only, 2, str(tmp_path), ["qwen2vl"] if patched else None,
                            timeout=PG_TIMEOUT + 60, retries=0, pg_timeout=PG_TIMEOUT)
    except RankError as exc:
        results = [{"error": msg} for msg, _ in exc.errors.values()]
    stderr = "".join(p.read_text(errors="replace") for p in tmp_path.glob("rank*.err"))
    if not patched:
        assert MISMATCH in stderr or any(MISMATCH in (r["error"] or "") for r in results), (results, stderr)
        return
    assert [r["wrapped"] for r in results] == [["<root>"], ["<root>"]], results
    for rank, r in enumerate(results):
        _close(r, "fp32", "root unit only, rank %d" % rank)
    assert [r["dummy_forwards"] for r in results] == [0, 1], results
