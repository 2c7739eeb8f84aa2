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
two ranks): the test-suite proves that part (tests/test_fused_forwards.py).
"""

import functools
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
# family -> patch name, for verl's fused-kernel forwards.  Not GLM-4.1V: verl's
# own glm4v forward does not run on stock transformers at all (see
# examples/glm4v_bridge.py); GLM-4.5V / 4.6V get dense_common's forward.
FUSED_CASES = {"qwen3_vl": "qwen3vl", "qwen2": "textlm", "glm4v_moe": "glm4v", "glm46v": "glm4v"}

FRAMEWORKS = ("verl", "skyrl", "skyrl-train")
TOL = 1e-5


@functools.lru_cache(maxsize=None)
def _wrappable(family):
    """Available here, and with layer classes upstream can use (verl and SkyRL
    assert on an empty ``_no_split_modules``, e.g. LFM2-VL on transformers 4.57)."""
    from .examples import tiny_models

    return tiny_models.available(family) is True and bool(tiny_models.build(family)._no_split_modules)


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


def run_checks(families=None, frameworks=None, progress=None):
    """Return the result rows; ``progress(message)`` is called before each case."""
    import datetime
    import logging

    # A one-rank mesh makes torch warn about sequential all-gathers: noise here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

    import torch
    import torch.distributed as dist

    from . import guards
    from .examples import scenarios, tiny_models

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
            if (families is None or family in families) and _wrappable(family):
                cases.append((framework, version, family, patch, "selection"))
    verl = guards.installed_version("verl")
    if verl and guards.in_range(verl, ">=0.6.0") and (frameworks is None or "verl" in frameworks):
        # Last: verl's monkey patch rewrites model classes for the whole process.
        for family, patch in FUSED_CASES.items():
            if (families is None or family in families) and tiny_models.available(family) is True:
                cases.append(("verl", verl, family, patch, "fused forward"))
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
            else:
                unpatched = _run(scenarios.train_fused, family, None, steps=1)
                patched = _run(scenarios.train_fused, family, patch, steps=1)
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
            if any(r["kind"] == "fused forward" for r in rows):
                print("note: one rank cannot show verl 0.9.x's unaveraged lm_head gradient (it needs 2+ ranks "
                      "with different data); tests/test_fused_forwards.py proves that part.")
    return 1 if failed else 0
