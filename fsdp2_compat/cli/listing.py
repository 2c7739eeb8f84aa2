"""``fsdp2-compat list``: every patch, the families it covers and its targets, from the catalogue alone."""

import sys


def run(args):
    from .. import registry
    from . import HARNESS_MISSING, _harness_installed

    if args.markdown:  # (the README's tables: a maintainer's tool, in the harness)
        if not _harness_installed():
            print(HARNESS_MISSING % "list --markdown", file=sys.stderr)
            return 2
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
    from .. import integrations

    for integration in integrations.INTEGRATIONS:
        if integration.covered:
            print("%-14s its paths as proven through its code:" % integration.dist)
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
    """The README's two generated tables (family -> patch; upstream x kind of fix), from the catalogue (the
    harness's ``tables``)."""
    from . import harness

    tables = harness("tables")

    return tables.patch_table() + "\n\n" + tables.matrix_table()
