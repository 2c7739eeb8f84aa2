"""Reports: one audit as a dict and a table, and the sweep over families x plans."""

from fsdp2_compat_harness.verl_batches import add_verl_position_ids

from .findings import AuditInputError, Finding
from .ownership import plan_problems
from .plans import INSTALLED_PLANS, PLANS, SWEEP_PLANS, UPSTREAM_PLANS, describe_plan, layer_classes_of, plan_modules
from .tracker import audit


def _versions():
    from fsdp2_compat.core import guards

    return {d: guards.installed_version(d) for d in ("torch", "transformers", "verl", "areal", "llamafactory")}


GLM4V_FORWARD_MODULE = "verl.models.transformers.glm4v"


def _fix_verl_glm4v_forward():
    """Apply the glm4v patch's verl-forward targets only (not its lm_head ones); the attrs that applied."""
    from fsdp2_compat.core import engine
    from fsdp2_compat.integrations import verl
    from fsdp2_compat_harness import subset

    name = subset.request([t.key for t in verl.GLM4V_FORWARD])
    return [o.target.attr for _, o in engine.outcomes([name]) if o.kind == engine.APPLIED]


def report(model, batch, plan, label, fused=False, layer_classes=None, notes=()):
    """Plan, audit and collect everything the CLI prints, as a dict (JSON-ready).

    ``notes``: ``Finding`` records about the inputs; plan problems and notes
    appear in the dict as ``Finding.as_dict()``.
    """
    units = plan_modules(model, plan, layer_classes)
    plan_name = plan if isinstance(plan, str) and plan in PLANS else "explicit"
    if fused:
        batch = {k: v for k, v in batch.items() if k != "labels"}
        batch["return_dict"] = True
        add_verl_position_ids(model, batch)
    notes = list(notes)
    verl_glm4v = fused and getattr(type(model).__dict__.get("forward"), "__module__", "") == GLM4V_FORWARD_MODULE
    try:
        if verl_glm4v:
            adapted = _fix_verl_glm4v_forward()
            if adapted:
                notes.append(Finding(
                    "adapted",
                    "verl's GLM4V forward does not run on this transformers as released (an upstream verl bug, not "
                    "FSDP2; the glm4v patch fixes it): audited with the glm4v patch's %s target(s) applied"
                    % ", ".join(adapted)))
        hazards = audit(model, batch, units, plan=plan_name)
    except AuditInputError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise AuditInputError("the tiny forward of %s failed (%s: %s)" % (label, type(exc).__name__,
                                                                           str(exc).splitlines()[0] if str(exc) else ""))
    finally:
        if verl_glm4v:
            from fsdp2_compat_harness import subset

            subset.forget()
    if plan == "verl" and not layer_classes_of(model) and layer_classes is None:
        notes.append(Finding(
            "empty-layer-classes",
            "model._no_split_modules is empty: verl's apply_fsdp2 asserts a non-empty layer class list "
            "(set wrap_policy.transformer_layer_cls_to_wrap, or --layer-classes here)",
            "empty _no_split_modules: verl's apply_fsdp2 asserts"))
    return {
        "model": label,
        "model_class": type(model).__name__,
        "model_type": getattr(model.config, "model_type", None),
        "plan": plan_name if plan_name != "explicit" else ",".join(units),
        "plan_source": describe_plan(plan_name),
        "fused": bool(fused),
        "units": units,
        "plan_problems": [f.as_dict() for f in plan_problems(model, units)],
        "hazards": [h.as_dict() for h in hazards],
        "notes": [f.as_dict() for f in notes],
        "versions": _versions(),
    }


def format_report(rep):
    lines = _format_hazards(rep)
    if rep.get("divergence") is not None:
        from .divergence import format_lines

        lines += format_lines(rep["divergence"])
    return "\n".join(lines)


def _format_hazards(rep):
    lines = [
        "model: %s (%s)  %s" % (rep["model"], rep["model_class"],
                                " ".join("%s %s" % (k, v) for k, v in rep["versions"].items() if v)),
        "plan: %s - %s%s" % (rep["plan"], rep["plan_source"], "  [verl fused forward]" if rep["fused"] else ""),
        "units (%d + root): %s" % (len(rep["units"]), ", ".join(rep["units"]) or "none"),
    ]
    for p in rep["plan_problems"]:
        lines.append("plan problem: " + p["message"])
    for n in rep["notes"]:
        lines.append("note: " + n["message"])
    hz = rep["hazards"]
    if not hz:
        lines.append("no hazards: every parameter is read while its unit's forward runs")
        return lines
    rows = [("PARAMETER", "OWNER UNIT", "READ BY", "OP", "PATCH")]
    for h in hz:
        rows.append((h["param"], h["owner"] or "<root>", "%s (%s)" % (h["reader"] or "<root>", h["reader_class"]),
                     h["op"] + ("" if h["mixed"] else " (no mix seen)"), h["patch"] or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines.append("%d hazard(s): sharded parameters read outside their unit's forward" % len(hz))
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    for h in hz:
        lines.append("- %s: %s" % (h["param"], h["advice"]))
    return lines


def sweep(families=None, plans=SWEEP_PLANS, batches=True):
    """Audit tiny families x plans (unfused); rows of dicts for ``format_sweep``.

    ``batches``: also the divergence audit (``divergence.for_model``, the family's default batch kinds,
    unpatched and with its patch; computed once per distinct set of units) and ``bug_classes``."""
    from fsdp2_compat.core import guards
    from fsdp2_compat_harness import tiny as tiny_models

    if families is None:
        families = [f for f in tiny_models.FAMILIES if f not in ("qwen2", "llama")]
    rows = []
    for family in families:
        why = tiny_models.unavailable(family)
        if why is not None:
            rows.append({"family": family, "plan": "-", "skipped": why})
            continue
        model = tiny_models.build(family)
        batch = tiny_models.make_batch(family, model, seed=0)
        diverged = {}  # units -> divergence: plans with the same units diverge alike
        for plan in plans:
            if plan in INSTALLED_PLANS and guards.installed_version(plan) is None:
                rows.append({"family": family, "plan": plan, "skipped": "%s not installed" % plan})
                continue
            try:
                rep = report(model, batch, plan, family)
            except AuditInputError as exc:  # upstream cannot take this model under this plan at all
                rows.append({"family": family, "plan": plan, "skipped": str(exc).split(". ")[0]})
                continue
            row = {"family": family, "plan": plan, "units": len(rep["units"]),
                   "hazards": rep["hazards"], "plan_problems": rep["plan_problems"], "notes": rep["notes"]}
            if batches:
                key = (plan in UPSTREAM_PLANS, tuple(rep["units"]))
                if key not in diverged:
                    diverged[key] = _sweep_divergence(family, plan)
                row["divergence"] = diverged[key]
                row["classes"] = bug_classes(row, family)
            rows.append(row)
    return rows


def _sweep_divergence(family, plan):
    from fsdp2_compat_harness import tiny as tiny_models

    from . import divergence

    try:
        return divergence.for_model(lambda: tiny_models.build(family), family, divergence.default_kinds(family), plan)
    except AuditInputError as exc:
        return {"kinds": [], "findings": [], "notes": [str(exc)]}


def bug_classes(row, family):
    """``(unpatched, with the package)``: which of the bug classes this family x plan has on this stack.

    ``raw read`` (a hazard: the first-step mixed Tensor/DTensor crash), ``divergence`` (a unit the batch
    kinds or token routing enter or reduce-scatter differently: hang or wrong gradient), ``accumulation``
    (torch 2.7-2.14.1 with deferred sync crashes on a unit a micro-batch left unused: derived from the
    divergence, fixed by every patch carrying torch's accumulation targets).  The fourth class, the
    unaveraged ``lm_head`` gradient, needs a fused forward (``--fused``; TRL): not in the sweep."""
    from fsdp2_compat import registry
    from fsdp2_compat.core import guards

    before, after = [], []
    if row["hazards"]:
        before.append("raw read")
        if any(h["patch"] is None for h in row["hazards"]):
            after.append("raw read")
    div = row.get("divergence") or {}
    found = div.get("findings") or []
    remaining = div.get("remaining")
    if found:
        before.append("divergence")
    if (remaining if remaining is not None else [f for f in found if f["patch"] is None]):
        after.append("divergence")
    torch_version = guards.installed_version("torch")
    if (found or remaining) and torch_version and guards.in_range(torch_version, ">=2.7.0,<=2.14.1"):
        before.append("accumulation")
        listed = registry.for_model_type(family)
        if listed is None or not any(t in registry.GRAD_ACCUMULATION for t in listed.targets):
            after.append("accumulation")
    return ", ".join(before) or "none", ", ".join(after) or "none"


def _divergence_cell(findings):
    if not findings:
        return "none"
    cells = ["%s (%s)" % (f["unit"] or "<root>", "experts" if f["experts"] else "/".join(f["labels"]))
             for f in findings[:3]]
    return "; ".join(cells) + (" +%d more" % (len(findings) - 3) if len(findings) > 3 else "")


def format_sweep(rows, markdown=False):
    batches = any("divergence" in r for r in rows)
    head = ("family", "plan", "units", "hazards (parameter <- reader, op)", "covering patch", "plan problems")
    if batches:
        head += ("divergence (unit: batch kinds)", "left with the package", "bug classes: unpatched -> with the package")
    body = []
    for r in rows:
        if "skipped" in r:
            body.append((r["family"], r["plan"], "-", "skipped: " + r["skipped"], "-", "-") + (("-",) * 3 if batches else ()))
            continue
        hz = "; ".join("%s <- %s, %s" % (h["param"], h["reader_class"], h["op"]) for h in r["hazards"]) or "none"
        patches = "; ".join(h["patch"] or "none (gap)" for h in r["hazards"]) or "-"
        problems = "; ".join(f["short"] for f in list(r["plan_problems"]) + list(r.get("notes", ()))) or "-"
        row = (r["family"], r["plan"], str(r["units"]), hz, patches, problems)
        if batches:
            div = r.get("divergence") or {}
            found, notes, remaining = div.get("findings") or [], div.get("notes") or [], div.get("remaining")
            cell = _divergence_cell(found) if found or not notes else "not measured: the forward fails first"
            left = remaining if remaining is not None else [f for f in found if f["patch"] is None]
            unknown = remaining is None and not found and notes  # the patched forward failed too (or no patch)
            row += (cell, "not measured" if unknown else _divergence_cell(left), "%s -> %s" % r["classes"])
        body.append(row)
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
        return "\n".join(out)
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head] + body)
