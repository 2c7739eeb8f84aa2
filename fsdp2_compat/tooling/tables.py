"""The README's generated tables, from the catalogue alone (``fsdp2-compat list --markdown``).

- ``patch_table``: which patch a model family needs, one line per family;
- ``matrix_table``: upstream distribution x kind of fix, each cell the
  releases the fix covers, those known not to be affected, and those known
  to have the bug in code it does not cover.

``tests/tooling/test_readme.py`` keeps the README equal to them.  Only the
catalogue's facts go in: no cell is written by hand.
"""


def patch_table():
    from .. import registry

    lines = ["| family | `model_type` | patch |", "|---|---|---|"]
    for p in registry.PATCHES:
        for mt, label in p.model_types.items():
            lines.append("| %s | `%s` | `%s` |" % (label, mt, p.name))
    return "\n".join(lines)


def _spans(targets):
    from ..core.guards import release_spans

    return [span for t in targets for span in release_spans(t)]


def _overlaps(spec, spans):
    from ..core import guards

    return any(guards.in_range(str(v), spec) for span in spans for v in span)


def cell(targets):
    """What the catalogue says about one (distribution, kind of fix): fixed / not affected / not covered."""
    spans = _spans(targets)
    parts = []
    if spans:
        lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
        parts.append("fixed %s" % (lo if lo == hi else "%s-%s" % (lo, hi)))
    import re

    # Probe points of the ranges known to have the bug: a declared range that meets one is not "not affected".
    uncovered_points = [(v, v) for t in targets for spec in t.unsupported
                        for v in re.findall(r"[0-9]+(?:\.[0-9A-Za-z]+)*", spec)]
    not_affected = []
    for t in targets:
        for spec in ([t.fixed_in] if t.fixed_in else []) + list(t.declared):
            # Another layout's range, or one with the bug in other code, is not "not affected".
            if spec not in not_affected and not _overlaps(spec, spans + uncovered_points):
                not_affected.append(spec)
    if not_affected:
        parts.append("not affected %s" % ", ".join(sorted(not_affected)))
    uncovered = sorted({spec for t in targets for spec in t.unsupported})
    if uncovered:
        parts.append("**not covered** %s" % ", ".join(uncovered))
    return "; ".join(parts)


def matrix_table():
    from .. import registry

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
