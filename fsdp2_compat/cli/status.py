"""``fsdp2-compat status``: apply the requested patches here and show what happened, one row per target."""

import json
import sys


def run(args):
    from .. import registry
    from ..core import config, engine
    from ..core.status import by_target, format_table, status

    selection = args.patches if args.patches is not None else config.explicit_selection()
    chosen = engine.apply(selection)
    errors = {}
    if not args.no_import:
        # Import each installed target module so its outcome is real, not "waiting".
        _, errors = registry.import_installed_targets({t.key for n in chosen for t in registry.patch(n).targets})
    rows = status()
    from .. import integrations
    from ..activation.bootstrap import activation_summary
    from ..core import covered

    paths = covered.rows(integrations.INTEGRATIONS)  # frameworks with no seam of their own (ms-swift)

    # How fsdp2-compat reaches other processes (start-up .pth, verl plugin, Ray hook).
    activation = activation_summary()
    if args.json:
        json.dump(
            {"requested": list(chosen), "rows": rows, "targets": by_target(rows), "import_errors": errors,
             "covered": paths, "activation": activation},
            sys.stdout,
            indent=2,
            default=str,
        )
        sys.stdout.write("\n")
    else:
        import shutil

        from ..core.status import by_target, format_compact, headline, legend

        targets = by_target(rows)
        for line in headline(targets):
            print(line)
        print("requested: %s" % (", ".join(chosen) or "none"))
        if args.wide:
            print(format_table(rows))
        else:
            print(format_compact(targets, shutil.get_terminal_size((120, 24)).columns))
        for outcome, meaning in legend(rows):
            print("  %-34s %s" % (outcome, meaning))
        for line in covered.format_lines(paths):
            print(line)
        for module, error in errors.items():
            print("could not import %s: %s" % (module, error))
        for line in activation["lines"]:
            print(line)
    bad = [r for r in rows if r["outcome"] in engine.PROBLEMS]
    return 1 if bad else 0
