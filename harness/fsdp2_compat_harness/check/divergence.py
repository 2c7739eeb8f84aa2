"""``fsdp2-compat check`` rows for the rank divergences the audit finds (``audit --batches``), one per family.

For each of ``FAMILIES`` the installed transformers has, ``audit.divergence.for_model``
runs one CPU forward + backward per batch kind the family takes (text, image,
video, image+video; and short text micro-batches with different tokens where
the model has experts) under the corrected unit plan (layer classes and the
untied input embedding: the units every framework's fixed selection makes), on
a fake 2-rank process group, unpatched and with the family's catalogue patch.

A row says which units diverge unpatched (the unit, and what it does on NCCL)
and whether any diverges with the patch: "fixed" means none does.  A stack
where nothing diverges says "not reproduced on this stack" (transformers 5.x's
3-D experts).  The 2-rank rows ("mixed ranks", "MoE experts") prove the same
cases on real collectives; these rows cover every batch kind in seconds.
"""

from .scenario import Case, Result, Scenario

KIND = "audit divergence"
# A VLM with images and videos, the MoE VLM of the issue, and a text MoE (no FAMILIES entry: text kinds only).
FAMILIES = ("qwen2_5_vl", "glm4v_moe", "qwen3_moe")
PLAN = "fixed"


def cases(families=None):
    """``[(family, patch)]`` for the check: ``FAMILIES`` (within ``families``) that the installed
    transformers has and that the catalogue lists."""
    from fsdp2_compat import registry

    from .. import tiny

    out = []
    for family in FAMILIES:
        p = registry.for_model_type(family)
        if (families is None or family in families) and p is not None and tiny.unavailable(family) is None:
            out.append((family, p.name))
    return out


def _summary(findings):
    units = ["%s (%s)" % (f["unit"] or "<root>", f["nccl"].split(" (")[0]) for f in findings]
    return "%d unit(s) diverge: %s" % (len(units), "; ".join(units))


def run_case(family, patch):
    """``(unpatched, patched)`` result dicts for ``check``'s row of ``family``."""
    from .. import tiny
    from ..audit import divergence
    from ..tiny import moe

    def build():
        return tiny.build(family, experts=family in moe.VLM_EXPERT_KEYS)

    try:
        div = divergence.for_model(build, family, divergence.default_kinds(family), PLAN)
    except Exception as exc:  # the audit itself broke: report, do not die
        error = "%s: %s" % (type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return {"error": error, "loss_err": None}, {"error": error, "loss_err": None}
    found, remaining = div["findings"], div["remaining"]
    unpatched = {"error": _summary(found) if found else None, "loss_err": None}
    if not found:
        return unpatched, {"error": None, "loss_err": None}
    if remaining is None:
        left = "; ".join(div["notes"]) or "not run"
        return unpatched, {"error": "with patch %r: %s" % (patch, left), "loss_err": None}
    if remaining:
        return unpatched, {"error": "still " + _summary(remaining), "loss_err": None}
    return unpatched, {"error": None, "loss_err": None}


class Divergence(Scenario):
    """Run with no process group up (the audit makes its own); "fixed" means no unit diverges with the patch:
    the audit compares collectives, not a loss."""

    KINDS = (KIND,)
    ORDER = 100
    BEFORE_GROUP = True

    def cases(self, stack):
        from fsdp2_compat.core import guards

        version = guards.installed_version("transformers")
        return [Case("transformers", version, family, patch, KIND) for family, patch in cases(stack.families)]

    def __init__(self):
        self._patched = {}  # case -> its patched side: one audit serves both sides

    def run(self, case, patched, scratch):
        if patched:
            return Result.of(self._patched.pop(case))
        unpatched, self._patched[case] = run_case(case.family, case.patch)
        return Result.of(unpatched)

    def fixed(self, case, unpatched, patched):
        return patched.error is None


SCENARIO = Divergence()
