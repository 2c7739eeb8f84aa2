"""Rank divergence before the GPU run: what each FSDP2 unit does per kind of micro-batch.

Ranks must issue the same collectives.  A unit whose all-gathers (entries)
differ between two kinds of micro-batch (a vision tower skipped on text, run
twice for an image and a video), or whose reduce-scatter carries different
parameters (an MoE expert no token reached, a module the forward skipped),
makes two ranks with those micro-batches hang on NCCL (gloo: a size
mismatch) or, when the sizes happen to match, average different parameters'
gradients silently.

``divergence(build, kinds, plan, ...)`` shards a fresh model under the plan's
units with torch's real ``fully_shard`` on a 2-rank *fake* process group
(``torch.testing._internal.distributed.fake_pg``: no other process, no
communication; every all-gather copies the local shard, so values are wrong
but finite and the code paths are FSDP2's own), runs one forward + backward
per batch kind, and records every unit collective FSDP2 issues
(``fsdp2_compat.guard.collectives``, the guard's own view of them).  In a model
with experts, several short text micro-batches with different tokens are run
too ("text, tokens N"), so routing that differs by token is seen.  The same is done with the
family's catalogue patch applied (read from ``registry`` at run time): a
finding gone there is fixed by that patch, one that remains is "no patch
covers this".

Units: the plan's (``plan_modules``), plus the root.  With the patch, an
upstream plan's units are those its wrap-selection fix makes (``fixed`` /
``fixed-verl``) when the patch carries it.  A forward that fails under the
plan (the raw-read crash the hazards report comes first) is a note, not a
finding.
"""

from .findings import AuditInputError, Divergence

KINDS = ("text", "image", "video", "image+video", "audio")
AUDIO = ("qwen2_audio", "voxtral", "audioflamingo3")
PROBES = 8  # short text micro-batches with different tokens (routing)
PROBE_TOKENS = 2


def default_kinds(family):
    """The kinds the family's tiny batch (its processor) supports; text only for a model outside the harness."""
    from fsdp2_compat_harness import tiny

    if family is None or family not in tiny.FAMILIES or family in ("qwen2", "llama"):
        return ("text",)
    if family in AUDIO:
        return ("text", "audio")
    if family in tiny.VIDEO_FAMILIES:
        return ("text", "image", "video", "image+video")
    return ("text", "image")


def parse_kinds(text, family):
    """``--batches`` (comma separated, any subset of ``KINDS``; empty: ``default_kinds``) -> a tuple."""
    if not text:
        return default_kinds(family)
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise AuditInputError("--batches: unknown kind %s; valid: %s" % (", ".join(map(repr, bad)), ", ".join(KINDS)))
    supported = default_kinds(family)
    unsupported = [k for k in kinds if k not in supported]
    if unsupported:
        raise AuditInputError("--batches: %s cannot take %s here (its batches: %s)"
                              % (family or "this model", ", ".join(unsupported), ", ".join(supported)))
    return kinds


def batch(kind, family, model, seed):
    """kwargs for ``model(**batch)`` of one kind."""
    import torch

    from fsdp2_compat_harness import tiny
    from fsdp2_compat_harness.tiny.text import text_only

    if kind == "text":
        if family is not None and len(default_kinds(family)) > 1:
            return text_only(tiny.make_batch(family, model, seed=seed), seed=1000 + seed)
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, 240, (2, 12), generator=gen)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    # an audio family's default batch (``media=("image",)``) is its audio one
    media = {"image": ("image",), "audio": ("image",), "video": ("video",), "image+video": ("image", "video")}[kind]
    return tiny.make_batch(family, model, seed=seed, media=media)


def probe(seed):
    """A short text micro-batch (one row of ``PROBE_TOKENS`` tokens): few tokens reach few experts."""
    import torch

    gen = torch.Generator().manual_seed(100 + seed)
    ids = torch.randint(3, 240, (1, PROBE_TOKENS), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _fake_world():
    import torch.distributed as dist

    if dist.is_initialized():
        raise AuditInputError("--batches shards the model on a 2-rank fake process group of its own, and this "
                              "process already has a process group")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)


def record(model, units, labelled):
    """Shard ``model`` (``units`` then the root) and run each ``(label, batch)``:
    ``({label: {"gathers": {unit: n}, "reduced": {unit: set of names}}}, error or None)``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdp2_compat.guard import collectives

    from ..scenarios import first_line

    _fake_world()
    out, current = {}, {}

    def listen(event):
        if event.kind == collectives.ALL_GATHER:
            current["gathers"][event.unit] = current["gathers"].get(event.unit, 0) + 1
        else:
            current["reduced"].setdefault(event.unit, set()).update(event.params)

    collectives.listen(listen)
    try:
        mesh = init_device_mesh("cpu", (2,))
        modules = dict(model.named_modules())
        for name in units:
            fully_shard(modules[name], mesh=mesh)
        fully_shard(model, mesh=mesh)
        for label, kwargs in labelled:
            _forget_rope_deltas(model)
            current.clear()
            current.update(gathers={}, reduced={})
            model(**kwargs).loss.backward()
            model.zero_grad(set_to_none=True)
            out[label] = {"gathers": dict(current["gathers"]), "reduced": dict(current["reduced"])}
        return out, None
    except Exception as exc:  # noqa: BLE001 - the plan's first-step crash: reported as a note
        return out, "%s: %s" % (type(exc).__name__, first_line(exc))
    finally:
        collectives.unlisten(listen)
        dist.destroy_process_group()


def _forget_rope_deltas(model):
    """Drop the M-RoPE offsets a Qwen/GLM VLM keeps from its last forward (for generation): each labelled
    micro-batch is a fresh one, as in training (transformers 5.3.0's GLM-4.5V reuses them for a shorter
    text micro-batch after an image one, and its rotary embedding then fails on the shapes)."""
    for module in model.modules():
        if getattr(module, "rope_deltas", None) is not None:
            module.rope_deltas = None


def compare(records, numels):
    """``[Divergence]``: per unit, the labels whose entries or reduce-scattered parameters differ."""
    labels = list(records)
    units = sorted({u for r in records.values() for part in ("gathers", "reduced") for u in r[part]})
    found = []
    for unit in units:
        gathers = {lab: records[lab]["gathers"].get(unit, 0) for lab in labels}
        reduced = {lab: records[lab]["reduced"].get(unit, set()) for lab in labels}
        probes = [lab for lab in labels if lab.startswith("text, tokens")]
        kinds = [lab for lab in labels if lab not in probes]
        for group in (kinds, probes):
            if len(group) < 2:
                continue
            g_differ = len({gathers[lab] for lab in group}) > 1
            sets = {lab: frozenset(reduced[lab]) for lab in group}
            r_differ = len(set(sets.values())) > 1
            if not (g_differ or r_differ):
                continue
            if group is probes:  # the first two micro-batches that differ are enough to show it
                first = group[0]
                other = next(lab for lab in group[1:] if gathers[lab] != gathers[first] or sets[lab] != sets[first])
                group = [first, other]
            every = set().union(*(sets[lab] for lab in group))
            missing = {lab: sorted(every - sets[lab]) for lab in group if every - sets[lab]}
            sizes = {sum(numels.get(n, 0) for n in sets[lab]) for lab in group if sets[lab]}
            if g_differ or len(sizes) > 1 or any(not sets[lab] for lab in group):
                nccl = "hang (NCCL waits in a collective the other rank never issues; gloo: size mismatch)"
            else:
                nccl = "wrong gradient (same reduce-scatter size, different parameters: averaged silently)"
            found.append(Divergence(unit, tuple(group), {lab: gathers[lab] for lab in group},
                                    {lab: len(sets[lab]) for lab in group}, missing, nccl))
    return found


def divergence(build, family, kinds, units, patched_units=None, patch=None):
    """Findings of one model under one plan, unpatched and with ``patch`` (a catalogue name or None).

    ``build()``: a fresh model each call (sharding is one-way).  Returns a dict (JSON-ready):
    ``{"kinds", "findings": [Divergence.as_dict() with "patch" / "advice"], "notes": [str]}``."""
    import fsdp2_compat

    def labelled(model):
        out = [(k, batch(k, family, model, seed=1)) for k in kinds]
        if not any(name.rpartition(".")[2] == "experts" for name, _ in model.named_modules()):
            return out  # token routing needs experts: the probes would only repeat the text kind
        return out + [("text, tokens %d" % i, probe(i)) for i in range(1, PROBES + 1)]

    model = build()
    numels = {n: p.numel() for n, p in model.named_parameters()}
    records, error = record(model, units, labelled(model))
    notes = []
    if error is not None and patched_units is not None and _names(patched_units) != _names(units):
        # The plan's raw-read crash (the hazards above) hides what the ranks would do next: look under the
        # units the wrap-selection fix makes, without any other fix, so the remaining classes still show.
        notes.append("unpatched, the forward under this plan fails (%s); the divergence below is under the units "
                     "the wrap-selection fix makes, with no other fix" % error)
        model = build()
        records, error = record(model, patched_units, labelled(model))
    if error is not None:
        notes.append("unpatched, the forward under this plan fails before any divergence can show (%s)" % error)
    found = compare(records, numels)
    fixed, remaining = set(), None
    if patch is not None and (found or error is not None):
        fsdp2_compat.apply(patch)
        try:
            model = build()
            p_records, p_error = record(model, patched_units if patched_units is not None else units,
                                        labelled(model))
        finally:
            fsdp2_compat.revert(patch)
        if p_error is not None:
            notes.append("with patch %r the forward fails (%s)" % (patch, p_error))
        else:
            remaining = compare(p_records, numels)
            left = {(d.unit, d.labels) for d in remaining}
            fixed = {(d.unit, d.labels) for d in found if (d.unit, d.labels) not in left}
    for d in found:
        d.patch = patch if (d.unit, d.labels) in fixed else None
    return {"kinds": list(kinds), "findings": [d.as_dict() for d in found], "notes": notes,
            # with the patch (None: not run, no patch for the model type or nothing to fix)
            "remaining": None if remaining is None else [d.as_dict() for d in remaining]}


def _names(units):
    """Comparable form of a unit list (``plan_modules`` gives module paths)."""
    return sorted(units)


def for_model(build, family, kinds, plan, layer_classes=None):
    """``divergence`` for a model of the CLI or the sweep: the plan's units, the catalogue's patch for its
    ``model_type`` (with the units its wrap-selection fix makes, for an upstream plan)."""
    from fsdp2_compat import registry

    from .plans import UPSTREAM_PLANS, plan_modules

    model = build()
    units = plan_modules(model, plan, layer_classes)
    listed = registry.for_model_type(getattr(model.config, "model_type", None))
    patched_units = units
    if listed is not None and plan in UPSTREAM_PLANS and registry.fixes_selection(listed):
        patched_units = plan_modules(model, "fixed-verl" if plan == "verl" else "fixed", layer_classes)
    out = divergence(build, family, kinds, units, patched_units, listed.name if listed else None)
    out["patch_tried"] = listed.name if listed else None
    return out


def format_lines(div):
    """Lines for the text report."""
    lines = ["divergence across micro-batches (%s%s):" % (", ".join(div["kinds"]), ", and %d short text micro-batches "
                                                         "with different tokens (the model has experts)" % PROBES)]
    for note in div["notes"]:
        lines.append("  note: " + note)
    if not div["findings"]:
        lines.append("  none: every unit is entered as often and reduce-scatters the same parameters for every kind")
        return lines
    for f in div["findings"]:
        labels = f["labels"]
        lines.append("  unit %s: entered (all-gathers) %s; parameters with a gradient %s" % (
            f["unit"] or "<root>", "; ".join("%s: %d" % (lab, f["gathers"][lab]) for lab in labels),
            "; ".join("%s: %d" % (lab, f["reduced"][lab]) for lab in labels)))
        for lab, names in f["missing"].items():
            lines.append("    %s leaves without a gradient: %s" % (lab, ", ".join(names[:6]) + (" ..." if len(names) > 6 else "")))
        lines.append("    NCCL: %s; %s%s" % (f["nccl"], f["advice"], " (MoE experts a micro-batch's tokens do not reach)"
                                               if f["experts"] else ""))
    return lines
