"""``fsdp2-compat check``: run the bug and the fix on this machine's real stack.

For every installed framework release and every model family a patch
covers (the catalogue's ``model_types``, where the tiny harness has that
family), build a tiny model from its config (no downloads), wrap it with the
framework's own entry point (``apply_fsdp2``; AReaL's ``parallelize_model``,
LLaMA-Factory's ``FSDP2Engine.prepare_model``) on a one-rank CPU gloo group, and run a
training step twice: unpatched, then with the family's patch.  Each row says
what upstream does (the exact error, or "ok"), what the patched run does,
whether its loss matches an unsharded reference, and the patch that fixes
it.  verl's fused-kernel forwards are checked the same way through verl's
own monkey patch, for every family whose patch carries a fused-forward
target.

One rank cannot show the gradient-averaging bug (it needs different data on
two ranks): a fused case whose unpatched run is "ok" while ``lm_head`` has
an FSDP unit of its own is run again on two gloo ranks (separate processes),
where "fixed" means the lm_head gradient matches the data-parallel average.
Where TRL is installed, its SFT loss (``SFTTrainer.compute_loss`` through the
fused LM head) runs the same way on a model prepared by accelerate's own FSDP2
preparation, for ``TRL_FAMILIES`` ("TRL SFT, 2 ranks"; see
``trl_scenarios``).  Where accelerate 1.14.0-1.15.0 is installed, its FSDP2
preparation runs with a Liger-style reader of ``lm_head.weight`` (untied
Qwen2.5-VL) and with a tied text model ("accelerate ..., 2 ranks"; see
``accelerate_scenarios``).  Where axolotl is installed (at a release its
targets cover), its own FSDP2 preparation runs its LoRA kernels on a DoRA
model and its KD trainer's ``compute_loss`` on a tiny Qwen2 ("axolotl DoRA
kernels, 2 ranks": the magnitude gradients off the data-parallel average;
"axolotl KD trainer, 2 ranks": the resharded head read; see ``engines.axolotl``).  Where ms-swift is
installed with the code its proven paths record, its own loader's Qwen3-VL forward runs a text-only rank
against an image rank ("ms-swift Qwen3-VL forward, 2 ranks": gloo's abort unpatched) and GRPO's Liger loss
reads a VLM's head ("ms-swift GRPO Liger, 2 ranks"; see ``engines.ms_swift``).

Mixed text/image micro-batches across ranks ("mixed ranks, 2 ranks", Qwen2.5-VL
through each framework's own wrapping): rank 0 trains on an image, rank 1 on
text only; unpatched gloo aborts on the mismatched collectives (the row shows
its message), patched every gradient matches the data-parallel average
(``fsdp2_compat_harness.mixed``).

MoE experts that the ranks' tokens reach differently ("MoE experts, 2 ranks",
GLM-4.5V and Qwen3-MoE through the first installed framework's wrapping), on
the transformers releases that skip unreached experts (4.x): unpatched gloo
aborts on the reduce-scatters of different sizes (or the experts' gradients
mix silently), patched every gradient matches the data-parallel average
(``fsdp2_compat_harness.moe_scenarios``); on 5.x (3-D experts) the audit rows below show
that nothing diverges.
The audit's rank divergence ("audit divergence": every batch kind a family
takes, on one CPU process) adds a row per family of ``divergence_check``.

Last, the whole path users run: GLM-4.1V through each installed training
engine that runs on CPU here (verl's FSDP engine, SkyRL's FSDPStrategy; see
``fsdp2_compat_harness.engines``), on two gloo ranks with different data, unpatched and
patched; "fixed" means every loss, gradient and parameter matches the
data-parallel reference (within 1e-5, or bf16 tolerance where the engine
computes in bf16 whatever the policy: verl 0.7.0).

What upstream prints while a case runs (verl announces its monkey patches)
is captured per case: shown with ``--verbose`` or when the case is not
fixed, and always in ``--json``.  Exit status 1 when a patch that applied
does not fix its case; 0 otherwise.
"""

import json
import sys
import time

from .rank_cases import captured as _captured, two_ranks as _two_ranks  # noqa: F401  (the rows' runners)
from .check_table import COLUMNS, _LAST_MIN, format_lines, format_rows, summary_line  # noqa: F401  (check.format_rows)
from .mixed import FAMILY as MIXED_FAMILY, KIND as MIXED_KIND  # noqa: F401  (the tests read them here)
from .engines import axolotl as axolotl_rows  # the "axolotl ..." rows
from .engines import ms_swift as swift_rows  # the "ms-swift ..." rows

TOL = 1e-5
VERL_FUSED_PREFIX = "verl.models.transformers."


def _short(error):
    return "ok" if error is None else error


def _run(fn, *args, **kwargs):
    """Run one scenario in this process, then undo every patch it requested."""
    import fsdp2_compat

    from .scenarios import first_line

    try:
        result, output = _captured(fn, 0, 1, *args, **kwargs)
    except Exception as exc:  # the scenario itself broke: report, do not die
        result, output = {"error": "%s: %s" % (type(exc).__name__, first_line(exc)), "loss_err": None}, ""
    finally:
        fsdp2_compat.revert()
    result["output"] = output
    return result


def quiet_train_fused(rank, world, *args, **kwargs):
    """``train_fused`` in a rank process, its prints captured into ``result["output"]``."""
    from .scenarios import train_fused

    result, output = _captured(train_fused, rank, world, *args, **kwargs)
    result["output"] = output
    return result


def quiet_train_trl(rank, world, *args, **kwargs):
    """``trl_scenarios.train_trl`` in a rank process, its prints captured into ``result["output"]``."""
    from .trl_scenarios import train_trl

    result, output = _captured(train_trl, rank, world, *args, **kwargs)
    result["output"] = output
    return result


def quiet_reader_steps(rank, world, *args, **kwargs):
    """``accelerate_scenarios.reader_steps`` in a rank process, its prints captured into ``result["output"]``."""
    from .accelerate_scenarios import reader_steps

    result, output = _captured(reader_steps, rank, world, *args, **kwargs)
    result["output"] = output
    return result


# kind -> (framework, harness module in fsdp2_compat_harness.engines, its rank function)
ENGINES = {
    "verl engine": ("verl", "verl_engine", "train_verl_engine"),
    "skyrl strategy": ("skyrl", "skyrl_strategy", "train_skyrl_strategy"),
}
ENGINE_FAMILY = "glm4v"


def _harness(name):
    import importlib

    return importlib.import_module("fsdp2_compat_harness.engines." + name)


def engine_cases(families=None):
    """``[(framework, version, family, patch, kind)]``: GLM-4.1V once per training engine runnable here."""
    from fsdp2_compat import registry
    from fsdp2_compat.core import guards

    from . import tiny

    if families is not None and ENGINE_FAMILY not in families or tiny.unwrappable(ENGINE_FAMILY) is not None:
        return []
    patch = registry.for_model_type(ENGINE_FAMILY).name
    return [(dist, guards.installed_version(dist), ENGINE_FAMILY, patch, kind)
            for kind, (dist, harness, _) in ENGINES.items() if _harness(harness).unrunnable() is None]


def quiet_engine(rank, world, kind, *args):
    """The ``fsdp2_compat_harness.engines`` rank function of ``kind``, its prints captured into ``result["output"]``."""
    _, harness, fn = ENGINES[kind]
    result, output = _captured(getattr(_harness(harness), fn), rank, world, *args)
    result["output"] = output
    return result


def _engine(kind, family, patch, root):
    """One engine case on 2 gloo ranks: the merged result, a wrong-but-running patched run reported as an error."""
    from .engines import common
    from .ranks import run_ranks
    from .scenarios import first_line

    try:
        path = common.model_dir(family, root, tokenizer=ENGINES[kind][0] == "verl")
        results = run_ranks(quiet_engine, 2, kind, family, path, patch, timeout=600)
    except Exception as exc:  # the scenario itself broke: report, do not die
        return {"error": "%s: %s" % (type(exc).__name__, first_line(exc)), "loss_err": None, "output": ""}
    merged = common.merge(results)
    merged["output"] = results[0].get("output", "")
    merged["tol"] = common.tolerance(merged)  # bf16 where the engine computes in bf16 whatever the policy
    worst = max([v for k, v in merged.items() if k.endswith("grad_err") or k.startswith("param_err")] or [0.0])
    if merged["error"] is None and worst >= merged["tol"]:
        merged["error"] = "runs, but gradients or parameters miss the data-parallel average by %.2g" % worst
    return merged


def _row(framework, version, family, patch, kind, unpatched, patched):
    tol = patched.get("tol", TOL)
    fixed = patched.get("error") is None and patched.get("loss_err") is not None and patched["loss_err"] < tol
    return {
        "framework": framework,
        "version": version,
        "family": family,
        "kind": kind,
        "unpatched": _short(unpatched.get("error")),
        "patched": _short(patched.get("error")),
        "loss_match": None if patched.get("loss_err") is None else patched["loss_err"] < tol,
        "loss_err": patched.get("loss_err"),
        "tol": tol,
        "patch": patch,
        "fixed": fixed,
        "output": {"unpatched": unpatched.get("output", ""), "patched": patched.get("output", "")},
    }


def selection_cases(families=None):
    """``[(family, patch)]``: model types whose patch corrects the wrap selection, that the tiny harness has."""
    from fsdp2_compat import registry

    from . import tiny

    return [(mt, name) for mt, name in registry.selection_model_types().items()
            if (families is None or mt in families) and mt in tiny.FAMILIES and tiny.unwrappable(mt) is None]


def fused_cases(families=None):
    """``[(family, patch)]``: model types whose patch carries a verl fused-forward target, in the tiny harness.

    GLM-4.1V gets verl's own glm4v forward, which the ``glm4v`` patch also
    makes run on the transformers verl admits.
    """
    from fsdp2_compat import registry

    from . import tiny

    out = []
    for p in registry.PATCHES:
        if not any(t.dist == "verl" and t.module.startswith(VERL_FUSED_PREFIX) for t in p.targets):
            continue
        for mt in p.model_types:
            if families is not None and mt not in families:
                continue
            if mt not in tiny.FAMILIES or tiny.unwrappable(mt) is not None:
                continue
            out.append((mt, p.name))
    return out


# TRL's check runs on these families only (each costs two 2-rank runs); the tests cover more.
TRL_FAMILIES = ("qwen3_vl", "qwen2_5_vl")
TRL_KIND = "TRL SFT, 2 ranks"


def trl_cases(families=None):
    """``[(family, patch)]`` for TRL: ``TRL_FAMILIES`` whose patch carries a TRL target (and in ``families``)."""
    from fsdp2_compat import registry

    from . import tiny

    out = []
    for mt in TRL_FAMILIES:
        p = registry.for_model_type(mt)
        if (families is None or mt in families) and p is not None and any(t.dist == "trl" for t in p.targets):
            if tiny.unavailable(mt) is None:
                out.append((mt, p.name))
    return out


# accelerate's tail unit (1.14.0-1.15.0): (family, tied, kind) rows, each two 2-rank runs.
ACC_CASES = (("qwen2_5_vl", False, "accelerate lm_head reader, 2 ranks"),
             ("qwen2", True, "accelerate tied, 2 ranks"))


def accelerate_cases(families=None):
    """``[(family, patch, kind)]`` for accelerate's tail unit, where a patch of the family carries its targets."""
    from fsdp2_compat import registry

    from . import tiny

    out = []
    for mt, _, kind in ACC_CASES:
        p = registry.for_model_type(mt)
        if (families is None or mt in families) and p is not None and any(t.dist == "accelerate" for t in p.targets):
            if tiny.unavailable(mt) is None:
                out.append((mt, p.name, kind))
    return out


def run_checks(families=None, frameworks=None, progress=None):
    """Return the result rows; ``progress(message)`` is called before each case."""
    import datetime
    import logging
    import warnings

    # A one-rank mesh makes torch warn about sequential all-gathers: noise here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

    import torch
    import torch.distributed as dist

    from fsdp2_compat import integrations
    from fsdp2_compat.core import guards

    from . import divergence_check, mixed, moe_scenarios, scenarios

    torch.manual_seed(0)
    # The audit's divergence rows shard on a fake process group of their own: before the check's gloo group.
    tf = guards.installed_version("transformers")
    audit_rows = [dict(_row("transformers", tf, family, patch, divergence_check.KIND, unpatched, patched),
                       fixed=patched.get("error") is None)
                  for family, patch, unpatched, patched in
                  (divergence_check.results(families, progress) if not dist.is_initialized() else [])]
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(
            "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
        )
    cases, rows, importable = [], [], []
    for integration in integrations.INTEGRATIONS:
        framework = integration.dist
        if frameworks is not None and framework not in frameworks:
            continue
        version = guards.installed_version(framework)
        if version is None or integration.wrap_module is None:  # TRL: accelerate wraps; its own case below
            continue
        try:
            _captured(scenarios.import_fsdp_utils, framework)  # AReaL announces its platform on import
        except Exception as exc:  # installed but not importable here: say so once
            rows.append({
                "framework": framework, "version": version, "family": "-", "kind": "selection",
                "unpatched": "cannot import %s: %s: %s" % (integration.wrap_module, type(exc).__name__, exc),
                "patched": "-", "loss_match": None, "loss_err": None, "patch": "-", "fixed": None,
                "output": {"unpatched": "", "patched": ""},
            })
            continue
        importable.append((framework, version))
        cases += [(framework, version, family, patch, "selection") for family, patch in selection_cases(families)]
    verl = guards.installed_version("verl")
    if verl and guards.in_range(verl, ">=0.6.0") and (frameworks is None or "verl" in frameworks):
        # Last: verl's monkey patch rewrites model classes for the whole process.
        cases += [("verl", verl, family, patch, "fused forward") for family, patch in fused_cases(families)]
    trl = guards.installed_version("trl")
    if trl and guards.in_range(trl, ">=1.16.0") and (frameworks is None or "trl" in frameworks):
        # TRL 1.15.0's fused head needs Triton: it cannot run on CPU.
        cases += [("trl", trl, family, patch, TRL_KIND) for family, patch in trl_cases(families)]
    acc = guards.installed_version("accelerate")
    if acc and guards.in_range(acc, ">=1.14.0,<=1.15.0") and (frameworks is None or "accelerate" in frameworks):
        # Where the tail unit exists: a Liger-style lm_head reader (untied VLM), and a tied model.
        cases += [("accelerate", acc, family, patch, kind) for family, patch, kind in accelerate_cases(families)]
    cases += [c for c in engine_cases(families) if frameworks is None or c[0] in frameworks]
    versions = dict(importable)
    cases += [(fw, versions[fw], family, patch, MIXED_KIND) for fw, family, patch in mixed.cases(versions, families)]
    cases += [(fw, versions[fw], family, patch, mixed.OWN_KIND)
              for fw, family, patch in mixed.own_forward_cases(versions, families)]
    cases += [(fw, versions[fw], family, patch, moe_scenarios.KIND)
              for fw, family, patch in moe_scenarios.cases(versions, families)]
    if frameworks is None or "axolotl" in frameworks:
        cases += [("axolotl", guards.installed_version("axolotl"), family, patch, kind)
                  for kind, family, patch in axolotl_rows.cases(families)]
    if frameworks is None or "ms-swift" in frameworks:
        cases += [("ms-swift", guards.installed_version("ms-swift"), family, patch, kind)
                  for kind, family, patch in swift_rows.cases(families)]
    import tempfile

    models = tempfile.TemporaryDirectory(prefix="fsdp2_compat_check_models_")
    saved_filters = warnings.filters[:]
    try:
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad=True to a scalar.*")
        i = 0
        while i < len(cases):
            framework, version, family, patch, kind = cases[i]
            i += 1
            if progress:
                progress("[%d/%d] %s %s: %s (%s)" % (i, len(cases), framework, version, family, kind))
            if kind == "selection":
                from . import tiny

                refusal = scenarios.tie_flag_refusal(framework, tiny.quiet(tiny.tiny_config, family, False))
                if refusal is not None:  # upstream cannot take this config at all, patched or not
                    rows.append(dict(_row(framework, version, family, patch, kind, {"error": refusal}, {"error": "-"}),
                                     fixed=None))
                    continue
                unpatched = _run(scenarios.train, framework, family, None, steps=1)
                patched = _run(scenarios.train, framework, family, patch, steps=1)
            elif kind == "fused forward":
                unpatched = _run(scenarios.train_fused, family, None, steps=1)
                patched = _run(scenarios.train_fused, family, patch, steps=1)
                if unpatched.get("error") is None and "lm_head" in (unpatched.get("wrapped") or ()):
                    # Runs on one rank with lm_head sharded apart: only two ranks can tell.
                    cases.append((framework, version, family, patch, "fused, 2 ranks"))
            elif kind == TRL_KIND:
                unpatched = _two_ranks(quiet_train_trl, family, "sft", None)
                patched = _two_ranks(quiet_train_trl, family, "sft", patch)
            elif kind in {k for _, _, k in ACC_CASES}:
                tied = dict((k, t) for _, t, k in ACC_CASES)[kind]
                read = None if tied else "raw"
                unpatched = _two_ranks(quiet_reader_steps, family, tied, read, None)
                patched = _two_ranks(quiet_reader_steps, family, tied, read, patch)
            elif kind in (MIXED_KIND, mixed.OWN_KIND):
                unpatched = mixed.run_case(framework, family, None, kind == mixed.OWN_KIND)
                patched = mixed.run_case(framework, family, patch, kind == mixed.OWN_KIND)
            elif kind == moe_scenarios.KIND:
                unpatched = moe_scenarios.run_case(framework, family, patch, unpatched=True)
                patched = moe_scenarios.run_case(framework, family, patch)
            elif kind in axolotl_rows.KINDS or kind in swift_rows.KINDS:
                rows_of = axolotl_rows if kind in axolotl_rows.KINDS else swift_rows
                unpatched = rows_of.run_case(kind, family, None)
                patched = rows_of.run_case(kind, family, patch)
            elif kind in ENGINES:
                unpatched = _engine(kind, family, None, models.name)
                patched = _engine(kind, family, patch, models.name)
            else:
                unpatched = _two_ranks(quiet_train_fused, family, None)
                patched = _two_ranks(quiet_train_fused, family, patch)
            rows.append(_row(framework, version, family, patch, kind, unpatched, patched))
    finally:
        models.cleanup()
        warnings.filters[:] = saved_filters
        if owns_group:
            dist.destroy_process_group()
    return rows + audit_rows


def _print_outputs(row):
    for side in ("unpatched", "patched"):
        text = row["output"][side].rstrip()
        if text:
            print("  [%s %s %s, %s] upstream printed:" % (row["framework"], row["family"], row["kind"], side))
            print("\n".join("    " + line for line in text.splitlines()))


def main(args):
    start = time.time()

    def progress(message):
        print(message, file=sys.stderr, flush=True)

    families = set(args.families.split(",")) if args.families else None
    rows = run_checks(families=families, progress=None if args.json else progress)
    failed = [r for r in rows if r["fixed"] is False]
    if args.json:
        json.dump({"rows": rows, "failed": len(failed), "seconds": round(time.time() - start, 1)}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 1 if failed else 0
    if not rows:
        from fsdp2_compat import integrations
        from fsdp2_compat.core import guards

        found = ["%s %s" % (d, guards.installed_version(d)) for d in integrations.dists() if guards.installed_version(d)]
        if found:
            print("nothing to check for these families with %s" % ", ".join(found))
        else:
            print("nothing to check: none of %s is installed" % ", ".join(integrations.dists()))
        return 0
    skipped = sum(r["fixed"] is None for r in rows)
    summary = summary_line(rows, time.time() - start)
    print(summary)
    print(format_rows(rows) if getattr(args, "verbose", False) else format_lines(rows))
    print(summary)
    if any(r["kind"] in ("fused, 2 ranks", TRL_KIND) + tuple(k for _, _, k in ACC_CASES) for r in rows):
        print("note: '2 ranks' rows train on two gloo ranks with different data and compare the "
              "lm_head gradient with the data-parallel average; one rank cannot show that bug.")
    for rows_of in (axolotl_rows, swift_rows):
        if any(r["kind"] in rows_of.KINDS for r in rows):
            print(rows_of.NOTE)
    if any(r["kind"] in ENGINES for r in rows):
        print("note: 'verl engine' / 'skyrl strategy' rows train through the framework's own training engine "
              "(2 gloo ranks, different data; CPU stand-ins only for CUDA-only code) and compare every loss, "
              "gradient and parameter with the data-parallel reference.")
        if any(r["kind"] in ENGINES and r.get("tol", TOL) > TOL for r in rows):
            print("note: a row whose engine computes in bf16 whatever the policy (verl 0.7.0 autocasts its "
                  "forward to bf16) is held to bf16's bound, 1e-2, instead of 1e-5.")
    if skipped:
        print("note: %d case(s) not applicable here (framework not importable, or it refuses the config)" % skipped)
    if not getattr(args, "verbose", False):
        print("full messages and what upstream printed: fsdp2-compat check --verbose (or --json)")
    shown = [r for r in rows if getattr(args, "verbose", False) or r["fixed"] is False]
    if shown:
        print()
        for r in shown:
            _print_outputs(r)
    return 1 if failed else 0
