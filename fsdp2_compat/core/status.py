"""What fsdp2-compat did in this process, as rows for people and machines."""

from . import engine, guards


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
    for name, outcome in engine.outcomes(names):
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
        elif outcome.kind == engine.WAITING and not guards.in_range(versions[dist], outcome.target.versions):
            # Its module will never be imported from this release (e.g. renamed).
            row["outcome"] = "not for this release"
            row["detail"] = "required %s %s, found %s" % (dist, outcome.target.versions, versions[dist])
        live = row["outcome"] in (engine.APPLIED, engine.WAITING) and row["found"] and guards.in_range(
            row["found"], outcome.target.versions
        )
        row["diff"] = _existing_diff(engine.diff_path(outcome.target, row["found"])) if live else None
        if row["outcome"] == engine.VERSION:
            _mark_sibling_seam(row, outcome.target, name)
        rows.append(row)
    return rows


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


def _mark_sibling_seam(row, target, patch_name):
    """An out-of-range seam whose release another seam of the patch covers is not a skip."""
    from .. import registry

    other = registry.sibling(target, row["found"], [patch_name])
    if other is not None:
        row["outcome"] = "other seam"
        row["diff"] = _existing_diff(engine.diff_path(other, row["found"]))
        row["detail"] = "%s %s uses the %s seam" % (row["dist"], row["found"], other.attr)


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
