"""The README's generated tables, from the catalogue alone (``fsdp2-compat list --markdown``).

- ``patch_table``: which patch a model family needs, one line per family;
- ``matrix_table``: upstream distribution x kind of fix, each cell the
  releases the fix covers, those known not to be affected, and those known
  to have the bug in code it does not cover.

``tests/tooling/test_readme.py`` keeps the README equal to them.  Only the
catalogue's facts go in: no cell is written by hand.  The ranges of a cell
are merged (``merge_specs``): the targets of one kind each declare their own
ranges, and a reader wants the fewest ranges that say the same.
"""

import re

# One clause of a range the merge understands; a spec with any other clause (``!=``, ``~=``, ``==1.*``) is kept
# as written, never merged: its set of releases is not one interval.
_CLAUSE = re.compile(r"^\s*(>=|<=|==|>|<)\s*([0-9][0-9A-Za-z.+!-]*)\s*$")


def patch_table():
    from fsdp2_compat import registry

    lines = ["| family | `model_type` | patch |", "|---|---|---|"]
    for p in registry.PATCHES:
        for mt, label in p.model_types.items():
            lines.append("| %s | `%s` | `%s` |" % (label, mt, p.name))
    return "\n".join(lines)


def _spans(targets):
    """The releases whose code a target's seam fits; code of releases upstream fixed (``fixed_in``: recorded
    where a target has no seam of its own, torch's ``RECOMPUTE_CAST``) is never patched, so it is not "fixed"."""
    from fsdp2_compat.core.guards import in_range, release_spans

    return [span for t in targets for span in release_spans(t)
            if not (t.fixed_in and in_range(str(span[0]), t.fixed_in))]


def _overlaps(spec, spans):
    from fsdp2_compat.core import guards

    return any(guards.in_range(str(v), spec) for span in spans for v in span)


def _interval(spec):
    """``spec`` as ``(lo, lo_inclusive, hi, hi_inclusive)`` (``None``: unbounded), or None if it is not one."""
    from packaging.version import InvalidVersion, Version

    lo, lo_inc, hi, hi_inc = None, False, None, False
    for clause in spec.split(","):
        m = _CLAUSE.match(clause)
        if not m:
            return None
        op, text = m.groups()
        try:
            v = Version(text)
        except InvalidVersion:
            return None
        if op in (">=", ">", "==") and (lo is None or v > lo or (v == lo and op == ">")):
            lo, lo_inc = v, op != ">"
        if op in ("<=", "<", "==") and (hi is None or v < hi or (v == hi and op == "<")):
            hi, hi_inc = v, op != "<"
    return lo, lo_inc, hi, hi_inc


def _format(lo, lo_inc, hi, hi_inc):
    if lo is not None and lo == hi:
        return "==%s" % lo
    low = "" if lo is None else "%s%s" % (">=" if lo_inc else ">", lo)
    high = "" if hi is None else "%s%s" % ("<=" if hi_inc else "<", hi)
    return ",".join(p for p in (low, high) if p) or ">=0"


def merge_specs(specs):
    """The fewest ranges whose union is that of ``specs``: overlapping and adjacent ones become one
    (``<1.6.0`` + ``>=1.6.0,<1.14.0`` -> ``<1.14.0``; ``<0.9.4`` + ``==0.9.4`` -> ``<=0.9.4``), ordered by
    their first release; a range that merges with nothing keeps its spelling, and one the merge cannot
    read (``!=``, ``~=``, wildcards) stays as written, after the others."""
    intervals, kept = [], []
    for spec in dict.fromkeys(specs):
        iv = _interval(spec)
        if iv is None:
            kept.append(spec)
        else:
            intervals.append((iv, spec))

    def low_key(item):  # unbounded below first; at one version, an inclusive bound first
        (lo, lo_inc, _, _), _ = item
        return (lo is not None, lo, not lo_inc)

    merged = []  # [lo, lo_inc, hi, hi_inc, [spellings]]
    for (lo, lo_inc, hi, hi_inc), spec in sorted(intervals, key=low_key):
        if merged:
            cur = merged[-1]
            chi, chi_inc = cur[2], cur[3]
            # touches: the current one is unbounded above, or reaches this one's start (closed on either side)
            if chi is None or lo is None or lo < chi or (lo == chi and (chi_inc or lo_inc)):
                if chi is not None and (hi is None or hi > chi or (hi == chi and hi_inc)):
                    cur[2], cur[3] = hi, hi_inc
                cur[4].append(spec)
                continue
        merged.append([lo, lo_inc, hi, hi_inc, [spec]])
    out = [m[4][0] if len(m[4]) == 1 else _format(*m[:4]) for m in merged]
    return out + sorted(kept)


def cell(targets):
    """What the catalogue says about one (distribution, kind of fix): fixed / not affected / not covered."""
    spans = _spans(targets)
    parts = []
    if spans:
        lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
        parts.append("fixed %s" % (lo if lo == hi else "%s-%s" % (lo, hi)))
    # Probe points of the ranges known to have the bug: a declared range that meets one is not "not affected".
    from fsdp2_compat.core.guards import in_range

    uncovered_points = [(v, v) for t in targets for spec in t.unsupported
                        for v in re.findall(r"[0-9]+(?:\.[0-9A-Za-z]+)*", spec) if in_range(v, spec)]
    not_affected = []
    for t in targets:
        for spec in ([t.fixed_in] if t.fixed_in else []) + list(t.declared):
            # Another layout's range, or one with the bug in other code, is not "not affected".
            if spec not in not_affected and not _overlaps(spec, spans + uncovered_points):
                not_affected.append(spec)
    if not_affected:
        parts.append("not affected %s" % ", ".join(merge_specs(not_affected)))
    uncovered = merge_specs(spec for t in targets for spec in t.unsupported)
    if uncovered:
        parts.append("**not covered** %s" % ", ".join(uncovered))
    return "; ".join(parts)


def matrix_table():
    from fsdp2_compat import registry

    kinds, dists, by = [], [], {}
    for t in registry.targets():
        kind = registry.seam_kind(t)
        if kind not in kinds:
            kinds.append(kind)
        if t.dist not in dists:
            dists.append(t.dist)
        by.setdefault((t.dist, kind), []).append(t)
    lines = ["| upstream | %s |" % " | ".join(kinds), "|---|%s" % ("---|" * len(kinds))]
    for dist in dists:
        lines.append("| %s | %s |" % (dist, " | ".join(cell(by[(dist, k)]) if (dist, k) in by else "-" for k in kinds)))
    return "\n".join(lines)
