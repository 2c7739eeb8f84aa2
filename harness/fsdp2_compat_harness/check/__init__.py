"""``fsdp2-compat check``: run the bug and the fix on this machine's real stack.

Every scenario of this package (``scenario.scenarios()``: each module here that
holds a ``SCENARIO``) says which cases the installed stack has, runs one side
of a case (unpatched, then with the family's patch) and says what the table
must note about its rows; this module runs them all the same way and prints
one row per case: what upstream does (the exact error, or "ok"), what the
patched run does, whether its loss matches an unsharded data-parallel
reference, and the patch that fixes it.  The scenarios:

- ``selection``: each covered family through each installed framework's own wrapping, one CPU gloo rank;
- ``fused``: verl's fused-kernel forwards (and on two ranks, where one cannot show the unaveraged gradient);
- ``sp_labels``: verl 0.7.0-0.7.1's fused forwards under Ulysses SP 2 (its actor, two ranks, one SP group);
- ``trl``: TRL's SFT loss through its fused LM head on accelerate's FSDP2, two ranks;
- ``accelerate``: accelerate's FSDP2 tail unit (a Liger-style ``lm_head`` reader; a tied model), two ranks;
- ``engines``: GLM-4.1V through verl's FSDP engine and SkyRL's FSDPStrategy, two ranks;
- ``mixed_ranks``: an image rank against a text-only rank, through each framework's wrapping;
- ``moe_experts``: ranks whose tokens reach different MoE experts (transformers 4.x);
- ``axolotl``, ``ms_swift``: those frameworks' own FSDP2 paths, where their proven code is installed;
- ``divergence``: the audit's rank divergences, every batch kind a family takes, one CPU process.

What upstream prints while a case runs (verl announces its monkey patches) is
captured per case: shown with ``--verbose`` or when the case is not fixed, and
always in ``--json``.  Exit status 1 when a patch that applied does not fix
its case; 0 otherwise.
"""

import json
import sys
import time

from .scenario import Case, Result, Stack, row, scenarios
from .table import format_lines, format_rows, summary_line


def installed_stack(families=None, frameworks=None):
    """``(Stack, rows)``: the wrapping frameworks whose FSDP2 module imports here, and one row for each
    installed one that does not (said once, not per family)."""
    from fsdp2_compat import integrations
    from fsdp2_compat.core import guards

    from .. import scenarios as training
    from ..rank_cases import captured

    importable, rows = {}, []
    for integration in integrations.wrapping():
        framework = integration.dist
        version = guards.installed_version(framework)
        if version is None or (frameworks is not None and framework not in frameworks):
            continue
        try:
            captured(training.import_fsdp_utils, framework)  # AReaL announces its platform on import
        except Exception as exc:  # installed but not importable here: say so once
            error = Result.failed("cannot import %s: %s: %s" % (integration.wrap_module, type(exc).__name__, exc))
            rows.append(row(Case(framework, version, "-", "-", "selection"), error, Result.failed("-"), None))
            continue
        importable[framework] = version
    return Stack(families, frameworks, importable), rows


def _run(todo, stack, scratch, progress):
    """The rows of every case of the scenarios ``todo``, in their order (follow-up cases last)."""
    cases = [(s, c) for s in todo for c in s.cases(stack) if stack.frameworks is None or c.framework in stack.frameworks]
    rows, i = [], 0
    while i < len(cases):
        scenario, case = cases[i]
        i += 1
        if progress:
            progress("[%d/%d] %s %s: %s (%s)" % (i, len(cases), case.framework, case.version, case.family, case.kind))
        refusal = scenario.refusal(case)
        if refusal is not None:  # upstream cannot take this case at all, patched or not
            rows.append(row(case, Result.failed(refusal), Result.failed("-"), None))
            continue
        unpatched = scenario.run(case, False, scratch)
        patched = scenario.run(case, True, scratch)
        cases += [(scenario, more) for more in scenario.follow_up(case, unpatched)]
        rows.append(row(case, unpatched, patched, scenario.fixed(case, unpatched, patched)))
    return rows


def run_checks(families=None, frameworks=None, progress=None):
    """Return the result rows; ``progress(message)`` is called before each case."""
    import datetime
    import logging
    import tempfile
    import warnings

    # A one-rank mesh makes torch warn about sequential all-gathers: noise here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    all_scenarios = scenarios()
    owns_group = not dist.is_initialized()
    scratch = tempfile.TemporaryDirectory(prefix="fsdp2_compat_check_models_")
    saved_filters = warnings.filters[:]
    try:
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad=True to a scalar.*")
        # The audit's divergence rows shard on a fake process group of their own: before the check's gloo group,
        # and before any framework is imported.
        early = (_run([s for s in all_scenarios if s.BEFORE_GROUP], Stack(families, frameworks, {}), scratch.name,
                      progress) if owns_group else [])
        stack, rows = installed_stack(families, frameworks)
        if owns_group:
            dist.init_process_group(
                "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
            )
        rows += _run([s for s in all_scenarios if not s.BEFORE_GROUP], stack, scratch.name, progress)
    finally:
        scratch.cleanup()
        warnings.filters[:] = saved_filters
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()
    return rows + early


def notes(rows):
    """What the table says under ``rows``: each scenario's notes, each once, in the scenarios' order."""
    out = []
    for scenario in scenarios():
        out += [n for n in scenario.notes(rows) if n not in out]
    return out


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
    for note in notes(rows):
        print(note)
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
