"""``fsdp2-compat audit``: exit 0 when clean, 1 when hazards or divergences are found, 2 on bad input."""

import json
import sys

from .findings import AuditInputError
from .inputs import _families, apply_fused, build_inputs
from .plans import PLANS
from .report import format_report, format_sweep, report, sweep


def add_arguments(parser):
    """Add the ``audit`` arguments to an argparse parser."""
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="FAMILY",
                     help="a built-in tiny family (fsdp2_compat_harness.tiny.FAMILIES), built from its "
                          "config class with 1-2 layers, hidden 32: no download")
    src.add_argument("--config", metavar="CLASSNAME",
                     help="a transformers config class name (e.g. Glm4vConfig); a class of a built-in family "
                          "starts from that family's tiny config (and batch), any other from its defaults "
                          "shrunk as for --config-json, run on a text-only batch")
    src.add_argument("--config-json", metavar="PATH",
                     help="a local config.json, shrunk before building: layer counts -> at most 2, hidden "
                          "sizes -> 32, FFN -> 64, heads -> 2 (kv heads 1, head_dim 16), experts -> 4 (2 "
                          "per token), vocab -> 256 (or just above the largest special token id), in every "
                          "*_config sub-dict alike.  For a built-in family's model_type the tiny family's "
                          "geometry, token ids and rotary settings replace the file's (the tiny batch "
                          "needs them) while flags and tying come from the file; other model types run a "
                          "text-only batch.  Conservative: if the shrunk config does not build, fix it "
                          "with --set")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", default=[],
                        help="override a config value (JSON or plain string; dotted keys reach sub-configs, "
                             "e.g. vision_config.depth=2); repeatable")
    parser.add_argument("--tie", action="store_true", help="tiny families: build with tied input/output embeddings")
    parser.add_argument("--plan", default="verl", metavar="PLAN",
                        help="verl, areal, llamafactory (what the installed release selects, unpatched), skyrl, "
                             "fixed, fixed-verl, hyperparallel, or comma-separated module names (default: verl)")
    parser.add_argument("--layer-classes", metavar="NAMES",
                        help="comma-separated layer class names (default: the model's _no_split_modules)")
    parser.add_argument("--fused", action="store_true",
                        help="run verl's fused-kernel forward (apply_monkey_patch use_fused_kernels=True, torch "
                             "backend; return_dict=True, no labels)")
    parser.add_argument("--batches", nargs="?", const="", default=None, metavar="KINDS",
                        help="also find rank divergence: one forward + backward per batch kind (any of text, image, "
                             "video, image+video, audio; default: the kinds the family's tiny batch supports, text "
                             "only outside the tiny families) plus short text micro-batches with different tokens, "
                             "under the plan's real fully_shard on a fake 2-rank process group; a unit entered a "
                             "different number of times, or reduce-scattering different parameters, is a finding, "
                             "unpatched and with the family's patch")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--sweep", action="store_true",
                        help="audit every available vision/audio tiny family under verl, skyrl, areal, "
                             "llamafactory, fixed and hyperparallel (ignores the model and plan options)")
    parser.add_argument("--markdown", action="store_true", help="with --sweep: a Markdown table")
    parser.add_argument("--no-batches", action="store_true",
                        help="with --sweep: leave out the divergence audit (raw reads only, as before)")


def _check_plan_arg(plan):
    """Reject what cannot be a plan before building a model; module names are checked later."""
    if plan in PLANS:
        return
    parts = [p.strip() for p in (plan or "").split(",")]
    if not all(parts) or any(any(c.isspace() for c in p) for p in parts):
        raise AuditInputError("unknown --plan %r; valid: %s, or comma-separated module names" % (plan, ", ".join(PLANS)))


def run(args):
    """Run a parsed ``audit`` command; returns the exit code (0 clean, 1 hazards, 2 bad input)."""
    import fsdp2_compat

    fsdp2_compat.revert()  # audit upstream as released: nothing of ours applied in this process
    try:
        if args.sweep:
            rows = sweep(batches=not args.no_batches)
            if args.json:
                json.dump(rows, sys.stdout, indent=2)
                sys.stdout.write("\n")
            else:
                print(format_sweep(rows, markdown=args.markdown))
            return 1 if any(r.get("hazards") or (r.get("divergence") or {}).get("findings") for r in rows) else 0
        if not (args.model or args.config or args.config_json):
            raise AuditInputError("say what to audit: --model FAMILY (one of %s), --config CLASSNAME or "
                                  "--config-json PATH" % ", ".join(_families()))
        _check_plan_arg(args.plan)
        model, batch, label, notes = build_inputs(args)
        if args.fused:
            apply_fused(model)
        layer_classes = args.layer_classes.split(",") if args.layer_classes else None
        plan = args.plan if args.plan in PLANS else args.plan.split(",")
        rep = report(model, batch, plan, label, fused=args.fused, layer_classes=layer_classes, notes=notes)
        if args.batches is not None:
            rep["divergence"] = _divergence(args, model, plan, layer_classes)
    except AuditInputError as exc:
        print("fsdp2-compat audit: %s" % exc, file=sys.stderr)
        return 2
    if args.json:
        json.dump(rep, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_report(rep))
    return 1 if rep["hazards"] or (rep.get("divergence") or {}).get("findings") else 0


def _divergence(args, model, plan, layer_classes):
    """``divergence.for_model`` for the CLI's model (rebuilt per pass: sharding is one-way)."""
    from . import divergence
    from .inputs import _family_of_model_type

    if args.fused:
        raise AuditInputError("--batches runs transformers' own forwards: leave out --fused")
    family = args.model or _family_of_model_type(getattr(model.config, "model_type", "") or "")
    if family is not None and args.config_json and not args.model:
        from fsdp2_compat_harness import tiny

        family = family if tiny.unavailable(family) is None else None
    kinds = divergence.parse_kinds(args.batches, family)
    return divergence.for_model(lambda: build_inputs(args)[0], family, kinds, plan, layer_classes)


def main(argv=None):
    """``fsdp2-compat audit ...``: exit 0 when clean, 1 when hazards are found, 2 on bad input."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="fsdp2-compat audit",
        description="Find parameters that a FSDP2 wrap plan leaves sharded where another module's forward "
                    "reads them directly (one CPU forward of a tiny model; no GPU, no process group).")
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
