"""``fsdp2-compat doctor``: which patch a model needs on the installed stack, and the line to export.

    fsdp2-compat doctor PATH               a config.json, or a checkpoint directory holding one
    fsdp2-compat doctor --model-type TYPE  a transformers model_type (glm4v, qwen3_vl, ...)

Local only: the config is read as JSON (no transformers, no download).  The
model type picks the patch (``registry.for_model_type``); each of the patch's
targets whose distribution is installed is classified from the installed
release alone, with the catalogue's own facts (``core.policy``: fixed
upstream, declared not affected, known but not covered; else the release
labels of the recorded fingerprints).  Nothing is imported or patched:
``fsdp2-compat status`` checks the installed code itself.

Bad input (no such file, unreadable or non-JSON config, no ``model_type``)
is one line on stderr and exit code 2.
"""

import json
import os
import sys


class DoctorInputError(ValueError):
    """The PATH or model type given to ``doctor`` cannot be used (exit 2)."""


def read_model_type(path):
    """``(model_type, config dict)`` from a config.json or a directory holding one."""
    config_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(config_path):
        where = "no config.json in directory %s" % path if os.path.isdir(path) else "no such file: %s" % path
        raise DoctorInputError(where + " (give a config.json or a checkpoint directory; nothing is downloaded)")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DoctorInputError("cannot read %s as JSON: %s" % (config_path, exc)) from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str) or not model_type:
        raise DoctorInputError("%s has no model_type (is it a transformers config.json?)" % config_path)
    return model_type, config


def classify(target, version):
    """``Classified(kind, why)`` for ``target`` on installed ``version`` of its distribution.

    kind: ``"fixes"`` (the patch replaces this code), ``"not needed"``, ``"not covered"`` (the
    release has the bug in code the patch does not fit) or ``"unknown release"`` (status decides
    from the code at import).
    """
    from packaging.version import Version

    from ..core import guards, policy
    from ..core.outcomes import Classified

    for reason in (policy.fixed_reason(target, version), policy.declared_reason(target, version)):
        if reason is not None:
            return Classified("not needed", reason)
    reason = policy.unsupported_reason(target, version)
    if reason is not None:
        return Classified("not covered", reason)
    release = Version(version.split("+", 1)[0])
    if any(lo <= release <= hi for lo, hi in guards.release_spans(target)):
        proven = "proven on this release" if guards.in_range(version, target.versions) else "code known, proven on %s" % target.versions
        return Classified("fixes", proven)
    return Classified("unknown release", "not in the catalogue's records: `fsdp2-compat status` checks its code at import")


def diagnose(model_type):
    """What the catalogue says for ``model_type`` on this stack: a dict (see ``format_report``)."""
    from .. import registry
    from ..core import guards

    patch = registry.for_model_type(model_type)
    report = {"model_type": model_type, "patch": None, "rows": [], "absent": []}
    if patch is None:
        return report
    report["patch"] = patch.name
    report["family"] = patch.model_types.get(model_type.replace("-", "_"))
    from ..integrations import transformers_moe

    # A MoE family with nothing to fix in its experts says so (no target to list it under).
    report["notes"] = [n for mt, n in transformers_moe.NOT_AFFECTED.items() if mt == model_type.replace("-", "_")]
    versions = {}
    for target in patch.targets:
        if target.dist not in versions:
            versions[target.dist] = guards.installed_version(target.dist)
        version = versions[target.dist]
        if version is None:
            if target.dist not in report["absent"]:
                report["absent"].append(target.dist)
            continue
        verdict, why = classify(target, version)
        row = {"dist": target.dist, "version": version, "what": registry.seam_kind(target), "targets": [target.key],
               "verdict": verdict, "why": why}
        # One row per kind of fix in a release: alternative layouts and backends of one fix are one
        # line (a layout this release does not use is not news when another layout fixes it).
        same = [r for r in report["rows"] if (r["dist"], r["what"]) == (row["dist"], row["what"])]
        if not same:
            report["rows"].append(row)
        elif same[0]["verdict"] == verdict or verdict == "not needed":
            same[0]["targets"].append(target.key)
        elif same[0]["verdict"] == "not needed":
            row["targets"] += same[0]["targets"]
            report["rows"][report["rows"].index(same[0])] = row
        else:
            report["rows"].append(row)
    report["needed"] = any(r["verdict"] in ("fixes", "unknown release", "not covered") for r in report["rows"])
    return report


def format_report(report, source=None):
    lines = []
    where = " (from %s)" % source if source else ""
    if report["patch"] is None:
        return ("model_type %r%s: nothing known to be needed; no fsdp2-compat patch lists this model type.\n"
                "To look for raw reads across FSDP2 units in it anyway: fsdp2-compat audit --config-json PATH"
                % (report["model_type"], where))
    lines.append("model_type %s%s: %s, patch `%s`" % (report["model_type"], where, report["family"], report["patch"]))
    if report["rows"]:
        width = max(len("%s %s" % (r["dist"], r["version"])) for r in report["rows"])
        for r in report["rows"]:
            lines.append("  %-*s  %-15s %s (%s)" % (width, "%s %s" % (r["dist"], r["version"]), r["verdict"],
                                                   r["what"], r["why"]))
    for note in report.get("notes", ()):
        lines.append("  not affected    MoE experts: %s" % note.split(": ", 1)[-1])
    if report["absent"]:
        lines.append("  not installed here: %s" % ", ".join(report["absent"]))
    if report["needed"]:
        lines.append("export FSDP2_COMPAT_PATCHES=%s" % report["patch"])
    else:
        lines.append("nothing to fix on this stack for %s (the patch would apply nothing); "
                     "export FSDP2_COMPAT_PATCHES=%s anyway if you may change releases" % (report["family"], report["patch"]))
    return "\n".join(lines)


def run(args):
    """The ``doctor`` command; returns the exit code (0, or 2 on bad input)."""
    try:
        if args.model_type:
            if args.path:
                raise DoctorInputError("give a PATH or --model-type, not both")
            model_type, source = args.model_type.strip(), None
            if not model_type:
                raise DoctorInputError("--model-type is empty")
        elif args.path:
            model_type, _ = read_model_type(args.path)
            source = args.path
        else:
            raise DoctorInputError("give a config.json / checkpoint directory, or --model-type TYPE")
    except DoctorInputError as exc:
        print("fsdp2-compat doctor: %s" % exc, file=sys.stderr)
        return 2
    report = diagnose(model_type)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_report(report, source))
    return 0
