"""Memory honesty: what the wrap-selection fix moves out of its own FSDP unit.

For each family a patch covers, build the real-size model on the meta device
(no memory, no downloads), and count the parameters whose FSDP2 unit changes
(upstream gives every untied nn.Embedding a unit of its own; the fix leaves
auxiliary embeddings to the unit around them: the root, or a layer-class unit
such as SigLIP2's embeddings in transformers 5.x).  The receiving unit is
unsharded for its whole forward (the root: the whole step), so these
parameters are held in full on every rank for longer than around their own
read: that is the cost of the fix, printed in parameters and bf16 MiB.
Persistent (sharded) memory does not change.

    python benchmarks/moved_params.py [--json] [FAMILY ...]

Then the time (``step_time``): one training step (forward + backward + SGD,
an image micro-batch) of a real-size ``--step-family`` (default Qwen3-VL-8B,
whose ``pos_embed`` the corrected rule moves into the root and whose
upstream units work: it is called as a module) on 2 gloo ranks, sharded by
upstream's rule (``upstream_units``: verl 0.4.0-0.7.0's and SkyRL's, every
untied ``nn.Embedding`` a unit of its own) and by the corrected one
(``select_wrap_targets``), both models in the same rank processes,
alternating step by step (``benchmarks/_cost.py``): the median ms, the time
ratio and the aten operators of each, fp32, its full vision tower
(``--depth``), ``--layers`` text layers at the real hidden size (default 0) and a
``--vocab``-token vocabulary (the moved parameters are the tower's).  A family
whose raw read crashes upstream (GLM-4.1V) has no upstream step to time;
Qwen2.5-VL moves nothing (both rules give the same units).

    python benchmarks/moved_params.py --quick --json   # the smoke run: a 2-block tower, a tiny text side

Every family the selection patches cover is measured, or printed as skipped
with the reason (not in this transformers; no real-size config:
``tests/support/real_size.MISSING``).  Run in every pinned set by
``tests/tooling/test_benchmarks.py``.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

UPSTREAM, CORRECTED = "upstream's selection", "corrected selection"
QUICK = dict(depth=2, layers=0, vocab=512, tokens=16, image=64, runs=1)


def owners(model, units):
    """{param id: unit name} with each parameter owned by its deepest unit ("" = root)."""
    unit_names = {id(m): n for n, m in model.named_modules() if id(m) in {id(u) for u in units}}
    owner = {}
    for name, module in model.named_modules():
        unit = ""
        prefix = name
        while True:
            m = model.get_submodule(prefix) if prefix else model
            if id(m) in unit_names:
                unit = unit_names[id(m)]
                break
            if not prefix:
                break
            prefix = prefix.rpartition(".")[0]
        for p in module.parameters(recurse=False):
            owner.setdefault(id(p), unit)
    return owner


def upstream_units(model):
    """verl / SkyRL's inline rule: layer classes, plus every nn.Embedding when untied."""
    import torch.nn as nn

    from fsdp2_compat.fixes.selection import embeddings_tied, layer_class_names

    names = layer_class_names(getattr(model, "_no_split_modules", None))
    tied = embeddings_tied(model)
    return [m for m in model.modules() if m is not model and (type(m).__name__ in names or (isinstance(m, nn.Embedding) and not tied))]


def measure(family):
    import torch
    import transformers

    from fsdp2_compat.fixes.selection import select_wrap_targets
    from fsdp2_compat_harness import tiny
    from support.real_size import real_size_config

    config = real_size_config(family)
    with torch.device("meta"):
        model = getattr(transformers, tiny.CLASSES[family][0])(config)
    params = {id(p): p for p in model.parameters()}
    before = owners(model, upstream_units(model))
    after = owners(model, select_wrap_targets(model, getattr(model, "_no_split_modules", None)))
    import torch.nn as nn

    embedding_params = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    changed = [pid for pid in params if before.get(pid) != after.get(pid)]
    # Auxiliary embeddings leave their own unit: that is the memory cost.
    moved = [pid for pid in changed if pid in embedding_params]
    # A layer class nested in a kept layer (Qwen2-Audio's attention) joins it:
    # it was unsharded inside that layer's forward anyway, so no cost.
    nested = [pid for pid in changed if pid not in embedding_params]
    moved_numel = sum(params[pid].numel() for pid in moved)
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "family": family,
        "total_params": sum(p.numel() for p in params.values()),
        "moved_params": moved_numel,
        "moved_bf16_mib": moved_numel * 2 / 2**20,
        "moved": sorted("%s -> %s" % (names[pid], after[pid] or "<root>") for pid in moved),
        "nested_params_merged": sum(params[pid].numel() for pid in nested),
    }


def step_time(rank, world, args):
    """``{"rows": {label: (median s, aten ops)}, "units": {label: count}, "geometry": line}``: one step of the
    same real-size model sharded by upstream's rule and by the corrected one, alternating."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import _cost
    from fsdp2_compat.fixes.selection import select_wrap_targets

    mesh = init_device_mesh("cpu", (world,))
    variants, units, line = {}, {}, None
    for label in (UPSTREAM, CORRECTED):
        model = _cost.build(args["family"], args["depth"], args["layers"], args["vocab"])
        line = _cost.geometry(model, args["tokens"], args["image"])
        chosen = upstream_units(model) if label == UPSTREAM else \
            select_wrap_targets(model, getattr(model, "_no_split_modules", None))
        units[label] = len(chosen) + 1
        _cost.shard(model, mesh, units=chosen)
        batch = _cost.batches(model, args["family"], args["tokens"], args["image"])["image"]
        opt = torch.optim.SGD(model.parameters(), lr=1e-5)

        def step(model=model, batch=batch, opt=opt):
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()

        variants[label] = (None, None, step)
    return {"rows": _cost.alternate(variants, args["runs"]), "units": units, "geometry": line}


def print_step(args, as_json):
    import _cost
    from fsdp2_compat_harness import tiny as tiny_models
    from fsdp2_compat_harness.ranks import run_ranks

    if tiny_models.unavailable(args["family"]):
        return {"skipped": tiny_models.unavailable(args["family"])}
    ranks = run_ranks(step_time, 2, args, timeout=3600, pg_timeout=900)
    rows = {label: max(tuple(r["rows"][label]) for r in ranks) for label in (UPSTREAM, CORRECTED)}
    out = {"family": args["family"], "geometry": ranks[0]["geometry"], "units": ranks[0]["units"],
           "rows": rows, "time_ratio": rows[CORRECTED][0] / rows[UPSTREAM][0]}
    if not as_json:
        _cost.print_rows(rows, "one step, %s (%s), fp32, an image micro-batch, 2 gloo ranks, %s; FSDP2 units: "
                               "upstream %d, corrected %d; median of %d (slowest rank)" % (
                                   args["family"], out["geometry"], _cost.stack(), out["units"][UPSTREAM],
                                   out["units"][CORRECTED], args["runs"]))
    return out


def main(argv=None):
    from fsdp2_compat import registry
    from fsdp2_compat_harness import tiny as tiny_models

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("families", nargs="*")
    parser.add_argument("--step-family", default="qwen3_vl", help="whose step is timed ('none': no step)")
    parser.add_argument("--depth", type=int, default=None, help="vision blocks of the timed step (default: all)")
    parser.add_argument("--layers", type=int, default=0, help="text layers of the timed step (the moved "
                        "parameters are the tower's; two models per rank must fit this shared machine)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--image", type=int, default=128, help="image side in pixels")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the timed step at %s" % QUICK)
    args = parser.parse_args(argv)
    step_args = dict(family=args.step_family, depth=args.depth, layers=args.layers, vocab=args.vocab,
                     tokens=args.tokens, image=args.image, runs=args.runs)
    if args.quick:
        step_args.update(QUICK)
    # The families whose patch fixes the selection, plus Qwen3-VL, whose called
    # pos_embed the corrected rule also moves (no patch needed for it).
    covered = dict(registry.selection_model_types(), qwen3_vl="(none needed)")
    from support.real_size import MISSING

    rows, skipped = [], {}
    for family in args.families or covered:
        # Said, never silently dropped: a family this transformers lacks, or one without real-size numbers.
        unavailable = tiny_models.unavailable(family)
        if unavailable is not None or family in MISSING:
            skipped[family] = MISSING.get(family) or unavailable
            continue
        row = measure(family)
        row["patch"] = covered.get(family, "")
        rows.append(row)
    if args.json:
        step = print_step(step_args, True) if args.step_family != "none" else None
        json.dump({"rows": rows, "skipped": skipped, "step": step}, sys.stdout, indent=2)
        print()
        return 0
    print("%-15s %-14s %14s %11s %8s %9s %14s  %s" % (
        "family", "patch", "total params", "moved", "share", "bf16 MiB", "nested merged", "auxiliary embedding -> unit"))
    for r in rows:
        print("%-15s %-14s %14d %11d %7.4f%% %9.1f %14d  %s" % (
            r["family"], r["patch"], r["total_params"], r["moved_params"],
            100.0 * r["moved_params"] / r["total_params"], r["moved_bf16_mib"], r["nested_params_merged"],
            ", ".join(r["moved"]) or "-"))
    for family, reason in skipped.items():
        print("%-15s skipped: %s" % (family, reason))
    if args.step_family != "none":
        print()
        print_step(step_args, False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
