"""``fsdp2-compat``: see what applies to the installed packages.

``status``, ``doctor``, ``list`` and ``fingerprint`` read the catalogue and the installed releases (this
package); ``check`` and ``audit`` run the bugs and the fixes on tiny models (the harness distribution,
``fsdp2_compat_harness``: they say how to install it where it is absent).

    fsdp2-compat check [--json] [--verbose] [--families a,b]
    fsdp2-compat audit --model FAMILY --plan verl|skyrl|fixed|hyperparallel|NAMES [--json]
    fsdp2-compat status [--json] [--wide] [--patches NAMES] [--no-import]
    fsdp2-compat doctor PATH | --model-type TYPE [--json]
    fsdp2-compat list [--markdown]
    fsdp2-compat fingerprint FILE NAME
"""

import argparse
import sys


# ``check`` and ``audit`` run the bugs and the fixes on tiny models: the harness, a distribution of its own that a
# training process never loads (``harness/`` in the repository).
HARNESS = "fsdp2_compat_harness"
HARNESS_MISSING = (
    "fsdp2-compat %s needs the harness that proves the fixes (tiny models, the frameworks' engines on CPU ranks), a "
    "second distribution of the fsdp2-compat repository that training processes never load; it is not installed "
    "here. From a clone: pip install ./harness (torch, transformers and your frameworks are used as installed, never "
    "installed by it), or bash .ci/install-set tf5 for a pinned stack with it."
)


def harness(name):
    """``fsdp2_compat_harness.<name>`` (``main`` answers ``check`` / ``audit`` itself where it is absent)."""
    import importlib

    return importlib.import_module("%s.%s" % (HARNESS, name))


def _harness_installed():
    """Whether the harness is importable here, found without importing it."""
    import importlib.util

    return importlib.util.find_spec(HARNESS) is not None


def _needs_harness(command):
    def run(args):
        print(HARNESS_MISSING % command, file=sys.stderr)
        return 2

    return run


def _cmd_status(args):
    from . import status

    return status.run(args)


def _cmd_check(args):
    return harness("check").main(args)


def _cmd_doctor(args):
    from . import doctor

    return doctor.run(args)


def _cmd_list(args):
    from . import listing

    return listing.run(args)


def _cmd_fingerprint(args):
    from ..core.guards import fingerprint_source

    with open(args.file, encoding="utf-8") as f:
        print(fingerprint_source(f.read(), args.name))
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    present = _harness_installed()
    if not present and argv[:1] in (["check"], ["audit"]):  # whatever else was asked: how to get the harness
        return _needs_harness(argv[0])(None)
    parser = argparse.ArgumentParser(prog="fsdp2-compat", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check", help="run each covered bug unpatched and patched on tiny models (CPU, no downloads)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--families", help="comma-separated tiny model families (default: all covered)")
    p.add_argument("--verbose", action="store_true", help="also show what upstream printed in each case")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("audit", help="find raw reads across FSDP units for a wrap plan, in one CPU forward")
    if present:
        audit_cli = harness("audit.cli")
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
    from ..core.config import ConfigError

    try:
        return args.func(args)
    except ConfigError as exc:
        print("fsdp2-compat: %s" % exc, file=sys.stderr)
        return 2
