"""What fsdp2-compat did in this process, as rows for people and machines."""

from . import engine, guards, policy


def status(names=None):
    """One dict per (patch, target): outcome, versions required and found, diff.

    ``names`` defaults to the requested patches (all patches when none are).

    Targets still waiting for their module also show the installed version,
    so "waiting" and "not installed" can be told apart.
    """
    rows = []
    versions = {}
    if names is None:
        names = engine.requested() or None
    for name, outcome in engine.outcomes(names):  # PatchOutcome
        row = outcome.as_dict()
        row["patch"] = name
        dist = outcome.target.dist
        if dist not in versions:
            versions[dist] = guards.installed_version(dist)
        row["installed"] = versions[dist]
        if row["found"] is None:
            row["found"] = versions[dist]
        if outcome.kind in (engine.WAITING, engine.NOT_REQUESTED) and versions[dist] is None:
            row["outcome"] = engine.NOT_INSTALLED
        elif outcome.kind == engine.WAITING:
            fixed = policy.fixed_reason(outcome.target, versions[dist])
            reason = policy.declared_reason(outcome.target, versions[dist])
            unsupported = policy.unsupported_reason(outcome.target, versions[dist])
            if fixed is not None:  # what the engine will say at import, known from the release already
                row["outcome"] = engine.NOT_NEEDED
                row["detail"] = "%s %s: %s (its module is not imported yet)" % (dist, versions[dist], fixed)
            elif reason is not None:  # the catalogue knows this release has nothing to patch here
                row["outcome"] = NOT_FOR_THIS_RELEASE
                row["detail"] = "%s %s: %s" % (dist, versions[dist], reason)
            elif unsupported is not None:  # ... or that it has the bug where the patch does not reach
                row["outcome"] = engine.UNSUPPORTED
                row["detail"] = "%s %s: %s" % (dist, versions[dist], unsupported)
        if row["outcome"] == engine.APPLIED:
            other = engine.displaced(outcome.target)
            if other is not None:  # someone installed their own code over ours: that runs, ours does not
                row["outcome"] = engine.NOT_NEEDED
                row["detail"] = "%s was replaced after the patch by %s.%s, which runs instead" % (
                    outcome.target.attr, getattr(other, "__module__", "?"), getattr(other, "__qualname__", "?"))
        live = row["outcome"] in (engine.APPLIED, engine.WAITING) and row["found"] and guards.in_range(
            row["found"], outcome.target.versions
        )
        row["diff"] = _existing_diff(engine.diff_path(outcome.target, row["found"])) if live else None
        rows.append(row)
    return rows


NOT_FOR_THIS_RELEASE = "not for this release"

LEGEND = {
    engine.APPLIED: "patched (proven: inside the release range the fix was proven on; otherwise the code is "
                    "identical to a proven release's)",
    engine.WAITING: "requested; applies when its module is imported",
    engine.OTHER_SEAM: "another target of the same patch fits this release's code",
    engine.NOT_NEEDED: "this release carries the fix or does not need it",
    NOT_FOR_THIS_RELEASE: "the catalogue records that this release has no such code",
    engine.DRIFTED: "requested, but the installed code matches no recorded fingerprint: left untouched "
                    "(pin a known release, upgrade fsdp2-compat, or FSDP2_COMPAT_STRICT=1 to fail)",
    engine.VERSION: "known code outside the proven range, refused because FSDP2_COMPAT_STRICT=proven",
    engine.UNSUPPORTED: "requested, but this release has the bug in code the patch does not cover: untouched, "
                        "with a warning (the detail says which releases are covered)",
    engine.FAILED: "the patch raised; nothing was changed",
    engine.NOT_INSTALLED: "the distribution is not installed",
}


def legend(rows):
    """``[(outcome, meaning)]`` for the outcomes present in ``rows``, in a fixed order."""
    present = {r["outcome"] for r in rows}
    return [(k, v) for k, v in LEGEND.items() if k in present]


def _existing_diff(path):
    """The diff's repository path; None when a source checkout shows it does not exist
    (diffs are written for the pinned releases only)."""
    import os

    if path is None:
        return None
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.isdir(os.path.join(repo, "patches")) and not os.path.exists(os.path.join(repo, path)):
        return None
    return path


def format_table(rows, columns=("patch", "dist", "found", "required", "what", "outcome", "diff", "detail")):
    """Plain-text table, one line per row, columns sized to fit."""
    header = [c.upper() for c in columns]
    body = [[("" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    widths[-1] = len(header[-1])  # the last column is free text: do not pad it
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    for b in body:
        lines.append("  ".join(v.ljust(w) for v, w in zip(b, widths)).rstrip())
    return "\n".join(lines)


def by_target(rows):
    """One row per target: ``status()``'s rows merged, with every patch that requested it in ``patches``.

    A target several patches carry (torch's accumulation seams are in every multimodal patch) has
    one outcome: it is applied once.
    """
    merged = {}
    for row in rows:
        if row["target"] not in merged:
            merged[row["target"]] = dict(row, patches=[])
        merged[row["target"]]["patches"].append(row["patch"])
    for row in merged.values():
        row.pop("patch", None)
    return list(merged.values())


def headline(rows):
    """The first lines of ``status``: is anything requested refused or failed, and why (one line each)."""
    problems = [r for r in rows if r["outcome"] in engine.PROBLEMS]
    applied = sum(r["outcome"] == engine.APPLIED for r in rows)
    if not problems:
        return ["ok: nothing requested was refused (%d applied, %d targets)" % (applied, len(rows))]
    lines = ["NOT APPLIED: %d requested target(s) refused or failed (%d applied)" % (len(problems), applied)]
    for r in problems:
        lines.append("  %s %s: %s (%s): %s" % (r["dist"], r["found"] or "", r["what"], r["outcome"], r["detail"]))
    return lines


def format_compact(rows, width=100):
    """``by_target`` rows as one line each, fitted to ``width`` (the detail is cut; ``--wide`` has it all)."""
    body = [("%s %s" % (r["dist"], r["found"] or "-"), "%s.%s" % (r["module"].rsplit(".", 1)[-1], r["attr"]),
             r["outcome"], ",".join(r["patches"]) if len(r["patches"]) <= 3 else "%d patches" % len(r["patches"]),
             r["detail"] or "") for r in rows]
    header = ("RELEASE", "TARGET", "OUTCOME", "PATCHES", "DETAIL")
    widths = [max([len(header[i])] + [len(b[i]) for b in body]) for i in range(4)]
    # The target's name gives way first (its tail names the function), then the detail.
    widths[1] = max(min(widths[1], width - sum(widths) + widths[1] - 3 * 2 - 12), 16)
    lines = []
    for cells in [header] + body:
        target = cells[1] if len(cells[1]) <= widths[1] else "..." + cells[1][-(widths[1] - 3):]
        cells = (cells[0], target) + tuple(cells[2:])
        head = "  ".join(c.ljust(w) for c, w in zip(cells[:4], widths))
        room = width - len(head) - 2
        detail = cells[4] if len(cells[4]) <= room else cells[4][: max(room - 3, 0)] + "..." if room > 3 else ""
        lines.append((head + "  " + detail).rstrip()[:max(width, len(head))])
    return "\n".join(lines)
