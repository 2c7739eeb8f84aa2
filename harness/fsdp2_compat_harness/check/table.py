"""How ``fsdp2-compat check`` shows its rows: one line per case by default, every cell in full on demand.

One line per case names the framework release, the family, the kind of case,
the patch, what upstream does as a short symptom (``crash: aten.grid_sampler_2d
mixed Tensor/DTensor``, ``silent: lm_head.weight grad off the DP average by
0.11``, or ``not reproduced on this stack`` where upstream runs fine here),
what the patched run does, and whether it matches the reference.  The full
messages are in ``format_rows`` (``--verbose``) and in ``--json``.
"""

import re

COLUMNS = ("framework", "family", "kind", "patch", "loss_match", "patched", "unpatched")
_WRAPPED = {"patched": 24}  # free-text columns before the last: wrap at this width
_LAST_MIN = 24

_MIXED = re.compile(r"(aten\.[A-Za-z0-9_]+)\.[A-Za-z0-9_]+ got mixed torch\.Tensor and DTensor")
_OFF_AVERAGE = re.compile(r"runs, but the (\S+) gradient misses the data-parallel average by (\S+)")


def symptom(message):
    """A short symptom for one outcome message (``None``: it ran fine)."""
    if message in (None, "ok"):
        return "ok"
    if message == "-":
        return "-"
    m = _MIXED.search(message)
    if m:
        return "crash: %s mixed Tensor/DTensor" % m.group(1)
    m = _OFF_AVERAGE.search(message)
    if m:
        return "silent: %s grad off the DP average by %s" % (m.group(1), m.group(2))
    if "overlapping meshes" in message:
        return "crash at wrap: nested FSDP units (overlapping meshes)"
    if "Received data size doesn't match" in message or "collective mismatch" in message.lower():
        return "hang: ranks ran different collectives"
    text = re.sub(r"^(step \d+|[a-z_]+): ", "", message.splitlines()[0])
    return text if len(text) <= 60 else text[:57] + "..."


def _match(r):
    return "-" if r.get("loss_err") is None else ("yes" if r["loss_match"] else "NO") + " (%.0e)" % r["loss_err"]


def format_lines(rows):
    """One line per case: release, family, kind, patch, unpatched symptom, patched outcome, match."""
    header = ("FRAMEWORK", "FAMILY", "KIND", "PATCH", "UNPATCHED", "PATCHED", "MATCH")
    body = []
    two_ranks = {(r["framework"], r["family"]) for r in rows if r["kind"].endswith("2 ranks")}
    for r in rows:
        unpatched = symptom(r["unpatched"])
        if unpatched == "ok" and r.get("fixed") is not None:
            # One rank cannot show an unaveraged gradient: the case is then run again on two.
            unpatched = ("not reproduced on 1 rank: see its 2-rank row"
                         if (r["framework"], r["family"]) in two_ranks and not r["kind"].endswith("2 ranks")
                         else "not reproduced on this stack")
        body.append(("%s %s" % (r["framework"], r["version"]), r["family"], r["kind"], r["patch"], unpatched,
                     symptom(r["patched"]), _match(r)))
    widths = [max(len(x[i]) for x in body + [header]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in [header] + body)


def summary_line(rows, seconds):
    failed = sum(r["fixed"] is False for r in rows)
    fixed = sum(r["fixed"] is True for r in rows)
    shown = sum(r["fixed"] is not None and symptom(r["unpatched"]) != "ok" for r in rows)
    return ("check: %d cases, %d fixed by their patch, %d not fixed; the bug showed unpatched in %d; %.1f s"
            % (fixed + failed, fixed, failed, shown, seconds))


COLUMNS = ("framework", "family", "kind", "patch", "loss_match", "patched", "unpatched")
_WRAPPED = {"patched": 24}  # free-text columns before the last: wrap at this width
_LAST_MIN = 24


def format_rows(rows, width=None):
    """The table, every cell in full: the free-text cells wrap at word boundaries, the last one to ``width``
    (but never narrower than ``_LAST_MIN`` characters)."""
    import shutil
    import textwrap

    width = width or max(100, shutil.get_terminal_size((120, 24)).columns)
    display = []
    for r in rows:
        d = {c: str(r.get(c, "")) for c in COLUMNS}
        d["framework"] = "%s %s" % (r["framework"], r["version"])
        d["loss_match"] = "-" if r["loss_err"] is None else ("yes" if r["loss_match"] else "NO") + " (%.1e)" % r["loss_err"]
        display.append(d)
    header = {c: c.upper() for c in COLUMNS}
    widths = {c: min(_WRAPPED.get(c, 10**6), max(len(d[c]) for d in display + [header])) for c in COLUMNS[:-1]}
    widths[COLUMNS[-1]] = max(_LAST_MIN, width - sum(widths.values()) - 2 * (len(COLUMNS) - 1))
    lines = []
    for d in [header] + display:
        cells = {c: textwrap.wrap(d[c], widths[c], break_long_words=False, break_on_hyphens=False) or [""]
                 for c in COLUMNS}
        for k in range(max(len(v) for v in cells.values())):
            parts = [(cells[c][k] if k < len(cells[c]) else "").ljust(widths[c]) for c in COLUMNS]
            lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


