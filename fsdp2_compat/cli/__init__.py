"""``fsdp2-compat``: see what applies to the installed packages.

    fsdp2-compat check [--json] [--verbose] [--families a,b]
    fsdp2-compat audit --model FAMILY --plan verl|skyrl|fixed|hyperparallel|NAMES [--json]
    fsdp2-compat status [--json] [--wide] [--patches NAMES] [--no-import]
    fsdp2-compat doctor PATH | --model-type TYPE [--json]
    fsdp2-compat list [--markdown]
    fsdp2-compat fingerprint FILE NAME
"""

import argparse
import json
import sys


def _cmd_status(args):
    from . import registry
    from .core import config, engine
    from .core.status import by_target, format_table, status

    selection = args.patches if args.patches is not None else config.explicit_selection()
    chosen = engine.apply(selection)
    errors = {}
    if not args.no_import:
        # Import each installed target module so its outcome is real, not "waiting".
        _, errors = registry.import_installed_targets({t.key for n in chosen for t in registry.patch(n).targets})
    rows = status()
    from . import integrations
    from .activation.bootstrap import activation_summary
    from .core import covered

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

        from .core.status import by_target, format_compact, headline, legend

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


def _cmd_check(args):
    from .tooling import check

    return check.main(args)


def _cmd_doctor(args):
    from .tooling import doctor

    return doctor.run(args)


def _cmd_list(args):
    from . import registry

    if args.markdown:
        print(list_markdown())
        return 0
    for p in registry.PATCHES:
        for i, symptom in enumerate(registry.symptoms(p)):
            print("%-14s %s %s" % (p.name if i == 0 else "", "-" if i == 0 else "+", symptom))
        print("%-14s model types: %s%s" % ("", ", ".join(p.families), "; " + p.note if p.note else ""))
        for t in p.targets:
            print("%-14s   %s.%s (%s)" % ("", t.module, t.attr, t.dist))
            for line in classification(t):
                print("%-14s       %s" % ("", line))
    from . import integrations

    for integration in integrations.INTEGRATIONS:
        if integration.covered:
            print("%-14s no seam of its own; its paths as proven through its code:" % integration.dist)
            for path in integration.covered:
                print("%-14s   %s.%s (%s): %s" % ("", path.module, path.attr, ", ".join(path.fingerprints), path.by))
    return 0


def classification(t):
    """How the catalogue classifies every release of ``t.dist`` for target ``t`` (the census checks it)."""
    lines = ["code known: %s" % ", ".join("%s (%s)" % (label, fp) for label, fp in t.fingerprints.items()),
             "proven on: %s" % t.versions]
    if t.fixed_in:
        lines.append("fixed upstream: %s" % t.fixed_in)
    for spec, reason in t.declared.items():
        lines.append("declared %s: %s" % (spec, reason))
    for spec, reason in t.unsupported.items():
        lines.append("not covered %s: %s" % (spec, reason))
    return lines


def list_markdown():
    """The README's two generated tables (family -> patch; upstream x kind of fix), from the catalogue."""
    from .tooling import tables

    return tables.patch_table() + "\n\n" + tables.matrix_table()


def _cmd_fingerprint(args):
    from .core.guards import fingerprint_source

    with open(args.file, encoding="utf-8") as f:
        print(fingerprint_source(f.read(), args.name))
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="fsdp2-compat", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check", help="run each covered bug unpatched and patched on tiny models (CPU, no downloads)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--families", help="comma-separated tiny model families (default: all covered)")
    p.add_argument("--verbose", action="store_true", help="also show what upstream printed in each case")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("audit", help="find raw reads across FSDP units for a wrap plan, in one CPU forward")
    from .tooling.audit import cli as audit_cli

    audit_cli.add_arguments(p)
    p.set_defaults(func=audit_cli.run)

    p = sub.add_parser("status", help="apply the requested patches here and show what happened")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--patches", help="selection like FSDP2_COMPAT_PATCHES (default: that variable, or all)")
    p.add_argument("--no-import", action="store_true", help="do not import upstream modules; show what waits")
    p.add_argument("--wide", action="store_true", help="one row per (patch, target), every column in full")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("doctor", help="which patch a model needs on this stack, and the line to export")
    p.add_argument("path", nargs="?", help="a config.json, or a checkpoint directory holding one (read locally)")
    p.add_argument("--model-type", help="a transformers model_type instead of a config (glm4v, qwen3_vl, ...)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser("list", help="list patches, the families they cover and their targets")
    p.add_argument("--markdown", action="store_true", help="the README's tables: family -> patch, upstream x fix")
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("fingerprint", help="fingerprint a function in a released source file")
    p.add_argument("file")
    p.add_argument("name")
    p.set_defaults(func=_cmd_fingerprint)

    args = parser.parse_args(argv)
    from .core.config import ConfigError

    try:
        return args.func(args)
    except ConfigError as exc:
        print("fsdp2-compat: %s" % exc, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
