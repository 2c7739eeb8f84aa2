"""The guard's error: which unit, what each rank was about to do, the likely cause, the patch.

``message(described, rank)`` turns every rank's ``Collective.describe()``
into one text, the same on every rank (each rank adds which one it is).
Stdlib only; the patch is read from the catalogue (``registry``) when the
error is built, so a patch added later is named without a change here.
"""

# Module-path words that mark a media tower (vision, audio, VQ encoders) in the catalogued families.
TOWER_WORDS = ("visual", "vision", "audio", "tower", "vqmodel", "image", "video", "mm_projector", "multi_modal")
EXPERT_WORDS = ("experts", "expert")
MIXED_FIX = "the mixed-ranks fix: a dummy tower input on a micro-batch without media, one tower call for images and videos"
EXPERTS_FIX = "the MoE fix: every rank reduce-scatters every expert of the unit (an unused expert contributes zeros)"


class GuardError(RuntimeError):
    """Raised on every rank at once when the ranks are about to run different FSDP2 collectives."""


def _is_tower(unit):
    parts = unit.lower().split(".")
    return any(w in p for p in parts for w in TOWER_WORDS)


def _ordinal(n):
    return "%d%s" % (n, {1: "st", 2: "nd", 3: "rd"}.get(n if n < 20 else n % 10, "th"))


def _doing(d):
    what = "%s of %s (%s, %d of its %d parameters, its %s %s this step)" % (
        d["kind"], d["unit"] or "<root>", d["phase"], len(d["params"]), len(d["unit_params"]), _ordinal(d["nth"]),
        d["kind"])
    return what


def _missing(described):
    """{rank: names of the unit's parameters this rank reduce-scatters no gradient for, that another rank does}."""
    every = set().union(*(set(d["params"]) for d in described))
    return {r: sorted(every - set(d["params"])) for r, d in enumerate(described) if every - set(d["params"])}


def cause(described):
    """``(kind, unit, words)``: kind is ``"experts"``, ``"unused"``, ``"tower-skipped"``, ``"tower-again"`` or
    ``"paths"``; unit the module path the error is about."""
    same_unit = len({(d["kind"], d["unit"]) for d in described}) == 1
    if same_unit:
        unit = described[0]["unit"]
        missing = _missing(described)
        names = [n for ns in missing.values() for n in ns]
        listed = "; ".join("rank %d has none for %s" % (r, ", ".join(ns[:6]) + (" ..." if len(ns) > 6 else ""))
                           for r, ns in sorted(missing.items()))
        if names and all(any(w in n.split(".") or w in n for w in EXPERT_WORDS) for n in names):
            return "experts", unit, (
                "MoE experts inside unit %s that no token of some rank's micro-batch reached (%s): the model runs only "
                "the experts a token is routed to (transformers 4.x keeps experts as an nn.ModuleList), so those "
                "parameters get no gradient on that rank and FSDP2 reduce-scatters a different set of parameters "
                "there; same sizes would silently mix different experts' gradients" % (unit or "<root>", listed))
        return "unused", unit, (
            "parameters of unit %s that some rank's forward did not use (%s): FSDP2 reduce-scatters only the "
            "parameters with a gradient, so the ranks' reduce-scatters differ" % (unit or "<root>", listed))
    towers = [(r, d) for r, d in enumerate(described) if _is_tower(d["unit"])]
    others = [(r, d) for r, d in enumerate(described) if not _is_tower(d["unit"])]
    if towers:
        r, d = towers[0]
        unit = d["unit"]
        if d["nth"] > 1 or not others:
            return "tower-again", unit, (
                "rank %d is about to run the media tower (%s) a %s time while %s not: a micro-batch with more than "
                "one kind of media (an image and a video, or local crops) runs the tower once per kind"
                % (r, unit, _ordinal(d["nth"]), ", ".join("rank %d is" % o for o, _ in others) or "the others are"))
        return "tower-skipped", unit, (
            "%s skipped the media tower that rank %d runs (%s): a micro-batch without images / audio does not run the "
            "tower, so its units issue no collectives there (a text-only micro-batch on one rank, media on another)"
            % (" and ".join("rank %d" % o for o, _ in others), r, unit))
    unit = described[0]["unit"]
    return "paths", unit, (
        "the ranks' forwards took different paths through the model: a module run only for some inputs, or a "
        "different number of times (data-dependent control flow), so the ranks reach different units")


def covering_patch(model_type, kind):
    """``(patch name or None, what it does)`` for a cause kind on ``model_type``, read from the catalogue."""
    if not model_type or kind == "paths":
        return None, None
    try:
        from .. import registry
    except Exception:  # noqa: BLE001 - the message must be built whatever happens
        return None, None
    candidates = [p for p in registry.PATCHES if model_type.replace("-", "_") in p.model_types]
    for p in candidates:
        if kind in ("tower-skipped", "tower-again") and any(t in registry.MIXED_MEDIA for t in p.targets):
            return p.name, MIXED_FIX
        if kind == "experts" and any(str(t.seam).startswith("fsdp2_compat.fixes.experts") for t in p.targets):
            return p.name, EXPERTS_FIX
    return None, None


def _applied(name):
    try:
        from ..core import engine

        return engine.is_applied(name)
    except Exception:  # noqa: BLE001
        return False


def message(described, rank=None):
    """The error text (the same on every rank but the last line, which says which rank this is)."""
    kind, unit, words = cause(described)
    model_type = next((d.get("model_type") for d in described if d.get("model_type")), None)
    lines = ["fsdp2-compat guard: the ranks are about to run different FSDP2 collectives at unit %r (without the guard: "
             "gloo aborts with \"Received data size doesn't match expected size\", NCCL hangs until its watchdog or, "
             "when the sizes happen to match, averages the wrong gradients)" % (unit or "<root>")]
    lines += ["  rank %d: %s" % (r, _doing(d)) for r, d in enumerate(described)]
    lines.append("likely cause: " + words)
    name, fix = covering_patch(model_type, kind)
    if name is not None and _applied(name):
        lines.append("patch: %r is applied in this process and covers %s, yet the ranks diverge: a case it does not "
                     "cover (please report it with this message)" % (name, model_type))
    elif name is not None:
        lines.append("fix: set FSDP2_COMPAT_PATCHES=%s in every process (%s)" % (name, fix))
    elif kind == "experts":
        lines.append("fix: no patch covers this%s: call set_reduce_scatter_unused_params(True) on this unit's "
                     "FSDPModule (torch 2.13+), or run every expert on every rank" % (
                         " for model type %r" % model_type if model_type else ""))
    elif kind in ("tower-skipped", "tower-again"):
        lines.append("fix: no patch covers this%s: run the tower on every rank every micro-batch (a dummy input on "
                     "micro-batches without media, one call for all kinds)" % (
                         " for model type %r" % model_type if model_type else ""))
    else:
        lines.append("fix: no patch covers this: make every rank run the same modules the same number of times")
    if rank is not None:
        lines.append("(raised on every rank; this is rank %d)" % rank)
    return "\n".join(lines)
