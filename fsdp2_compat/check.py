"""``fsdp2-compat check``: run the bug and the fix on this machine's real stack.

For every installed framework release (verl, skyrl, skyrl-train) and every
model family a patch covers, build a tiny model from its config (no
downloads), wrap it with the framework's own ``apply_fsdp2`` on a one-rank
CPU gloo group, and run a training step twice: unpatched, then with the
family's patch.  Each row says what upstream does (the exact error, or "ok"),
what the patched run does, whether its loss matches an unsharded reference,
and the patch that fixes it.  verl's fused-kernel forwards (Qwen3-VL, text
models, GLM-4.5V / 4.6V) are checked the same way through verl's own monkey
patch.

Exit status 1 when a patch that applied does not fix its case; 0 otherwise.
One rank cannot show the gradient-averaging bug (it needs different data on
two ranks), so on verl releases with that bug Qwen3-VL's fused forward is
also run on two gloo ranks (separate processes), where "fixed" means the
lm_head gradient matches the data-parallel average.
"""

import json
import sys
import time

# family -> patch name, for the wrap-selection cases (all frameworks)
SELECTION_CASES = {
    "glm4v": "glm4v",
    "glm4v_moe": "glm4v",
    "glm46v": "glm4v",
    "lfm2_vl": "lfm2vl",
    "qwen2_audio": "qwen2audio",
    "voxtral": "voxtral",
    "audioflamingo3": "audioflamingo3",
    "paddleocr_vl": "paddleocrvl",
}
# family -> patch name, for verl's fused-kernel forwards.  GLM-4.5V / 4.6V get
# dense_common's forward; GLM-4.1V gets verl's glm4v one, which runs only where
# transformers needs no adapting (examples/glm4v_bridge.py), so only there.
FUSED_CASES = {"qwen3_vl": "qwen3vl", "qwen2": "textlm", "glm4v": "glm4v", "glm4v_moe": "glm4v", "glm46v": "glm4v"}

# family -> patch name, for verl releases whose fused forward calls plain
# full_tensor(): runs, but the lm_head gradient is not averaged.  Shown on two
# ranks with different data (one rank cannot show it).
GRADIENT_CASES = {"qwen3_vl": "qwen3vl"}
GRADIENT_TRAP = ">=0.9.0"

FRAMEWORKS = ("verl", "skyrl", "skyrl-train")
TOL = 1e-5


def _short(error):
    return "ok" if error is None else error


def _run(fn, *args, **kwargs):
    """Run one scenario in this process, then undo every patch it requested."""
    import contextlib

    import fsdp2_compat

    try:
        # verl prints its monkey-patch decisions to stdout; keep stdout for our table / JSON.
        with contextlib.redirect_stdout(sys.stderr):
            return fn(0, 1, *args, **kwargs)
    except Exception as exc:  # the scenario itself broke: report, do not die
        from .examples.scenarios import _first_line

        return {"error": "%s: %s" % (type(exc).__name__, _first_line(exc)), "loss_err": None}
    finally:
        fsdp2_compat.revert()


def _row(framework, version, family, patch, kind, unpatched, patched):
    fixed = patched.get("error") is None and patched.get("loss_err") is not None and patched["loss_err"] < TOL
    return {
        "framework": framework,
        "version": version,
        "family": family,
        "kind": kind,
        "unpatched": _short(unpatched.get("error")),
        "patched": _short(patched.get("error")),
        "loss_match": None if patched.get("loss_err") is None else patched["loss_err"] < TOL,
        "loss_err": patched.get("loss_err"),
        "patch": patch,
        "fixed": fixed,
    }


def _quiet_train_fused(rank, world, *args, **kwargs):
    """``train_fused`` in a rank process, verl's prints sent to stderr (stdout may carry JSON)."""
    import contextlib

    from .examples.scenarios import train_fused

    with contextlib.redirect_stdout(sys.stderr):
        return train_fused(rank, world, *args, **kwargs)


def _two_ranks(family, patch):
    """``train_fused`` on 2 gloo ranks (separate processes) with different data per rank."""
    from .examples.ranks import run_ranks

    try:
        results = run_ranks(_quiet_train_fused, 2, family, patch, kwargs={"steps": 1})
    except Exception as exc:  # the scenario itself broke: report, do not die
        from .examples.scenarios import _first_line

        return {"error": "%s: %s" % (type(exc).__name__, _first_line(exc)), "loss_err": None}
    errors = [r for r in results if r["error"] is not None]
    if errors:
        return errors[0]
    worst = max(results, key=lambda r: r["grad_err"])
    out = dict(worst)
    if worst["grad_err"] >= TOL:
        # Runs, but wrong: report it where a crash would go, with the measured size.
        out["error"] = "runs, but the %s gradient misses the data-parallel average by %.2g" % (
            worst["worst_grad"], worst["grad_err"])
    return out


def run_checks(families=None, frameworks=None, progress=None):
    """Return the result rows; ``progress(message)`` is called before each case."""
    import datetime
    import logging

    # A one-rank mesh makes torch warn about sequential all-gathers: noise here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

    import torch
    import torch.distributed as dist

    from . import guards
    from .examples import glm4v_bridge, scenarios, tiny_models

    torch.manual_seed(0)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(
            "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
        )
    cases, rows = [], []
    for framework in frameworks or FRAMEWORKS:
        version = guards.installed_version(framework)
        if version is None:
            continue
        try:
            scenarios.import_fsdp_utils(framework)
        except Exception as exc:  # installed but not importable here: say so once
            rows.append({
                "framework": framework, "version": version, "family": "-", "kind": "selection",
                "unpatched": "cannot import %s: %s: %s" % (scenarios.FSDP_UTILS[framework], type(exc).__name__, exc),
                "patched": "-", "loss_match": None, "loss_err": None, "patch": "-", "fixed": None,
            })
            continue
        for family, patch in SELECTION_CASES.items():
            if (families is None or family in families) and tiny_models.wrappable(family) is True:
                cases.append((framework, version, family, patch, "selection"))
    verl = guards.installed_version("verl")
    if verl and guards.in_range(verl, ">=0.6.0") and (frameworks is None or "verl" in frameworks):
        # Last: verl's monkey patch rewrites model classes for the whole process.
        for family, patch in FUSED_CASES.items():
            if family == "glm4v" and glm4v_bridge.needed() is not None:
                continue  # verl's own GLM-4.1V forward cannot run for users here
            if (families is None or family in families) and tiny_models.wrappable(family) is True:
                cases.append(("verl", verl, family, patch, "fused forward"))
        if guards.in_range(verl, GRADIENT_TRAP):
            for family, patch in GRADIENT_CASES.items():
                if (families is None or family in families) and tiny_models.wrappable(family) is True:
                    cases.append(("verl", verl, family, patch, "fused, 2 ranks"))
    import warnings

    saved_filters = warnings.filters[:]
    try:
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad=True to a scalar.*")
        for i, (framework, version, family, patch, kind) in enumerate(cases):
            if progress:
                progress("[%d/%d] %s %s: %s (%s)" % (i + 1, len(cases), framework, version, family, kind))
            if kind == "selection":
                unpatched = _run(scenarios.train, framework, family, None, steps=1)
                patched = _run(scenarios.train, framework, family, patch, steps=1)
            elif kind == "fused forward":
                unpatched = _run(scenarios.train_fused, family, None, steps=1)
                patched = _run(scenarios.train_fused, family, patch, steps=1)
            else:
                unpatched = _two_ranks(family, None)
                patched = _two_ranks(family, patch)
            rows.append(_row(framework, version, family, patch, kind, unpatched, patched))
    finally:
        warnings.filters[:] = saved_filters
        if owns_group:
            dist.destroy_process_group()
    return rows


def format_rows(rows):
    from .status import format_table

    display = []
    for r in rows:
        d = dict(r)
        d["framework"] = "%s %s" % (r["framework"], r["version"])
        d["loss_match"] = "-" if r["loss_err"] is None else ("yes" if r["loss_match"] else "NO") + " (%.1e)" % r["loss_err"]
        d["unpatched"] = r["unpatched"][:90]
        display.append(d)
    return format_table(display, columns=("framework", "family", "kind", "patch", "patched", "loss_match", "unpatched"))


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
    else:
        if not rows:
            print("nothing to check: none of verl, skyrl, skyrl-train is installed")
        else:
            print(format_rows(rows))
            skipped = sum(r["fixed"] is None for r in rows)
            print("%d cases, %d not fixed, %d frameworks not importable, %.1f s" % (
                len(rows) - skipped, len(failed), skipped, time.time() - start))
            if any(r["kind"] == "fused, 2 ranks" for r in rows):
                print("note: 'fused, 2 ranks' rows train on two gloo ranks with different data and compare the "
                      "lm_head gradient with the data-parallel average; one rank cannot show that bug.")
    return 1 if failed else 0
