"""What the mixed-ranks fix adds to a text-only micro-batch, in wall-clock time, at real tower geometry (issue #40).

A text-only rank must issue its vision units' collectives (``fixes.mixed_media``).
It did that by running the model's own media path on a minimal dummy image
every time; now only its first text-only micro-batch does (the record), and
every later one walks the units through FSDP2's hooks without the tower's code
(``fixes.unit_walk``).  For a real-size vision tower (``--family``; the
published config, ``tests/support/real_size.py``) beside a text side of
``--layers`` decoder layers at the real hidden size and a ``--vocab``-token
vocabulary (the same text side in every row: the rows differ only in the
vision path), one ``fully_shard`` per ``_no_split_modules`` class plus the
root, fp32 on this machine's CPU, it times one forward + backward of:

  text   a text-only micro-batch, no fix (what an unpatched rank runs)
  dummy  the same plus the real dummy media path (the record, every time)
  walk   the same plus the walk
  floor  the same plus only the vision units' collectives, issued directly: each unit's
         ``unshard()`` / ``reshard()`` in forward, again in backward, and a reduce-scatter
         of a zero the size of its parameters (what the walk must issue; its hooks
         and autograd nodes are the difference)
  image  an image micro-batch (``--image`` pixels square)

and prints, in one run: the median milliseconds, what dummy, walk and floor add
to text (ms, and as a fraction of text), walk / dummy, walk / floor, and the aten operators
each dispatches (forward + backward).  On one process (default) the units'
collectives are local copies, so the added time is the fix's own compute and
FSDP2's hooks; ``--ranks 2`` runs two gloo ranks (their collectives included;
both ranks text-only).  The fix runs only with more than one rank: here the
embedding's forward hook calls ``mixed_media.zero_contribution``, its own
code path, as the fix's hook does.

    python benchmarks/text_only_cost.py                       # Qwen2.5-VL-7B's tower, 1 process
    python benchmarks/text_only_cost.py --ranks 2 --depth 8   # two gloo ranks, 8 of its 32 blocks

On a GPU the dummy is latency-bound (a tower call costs per-block Python,
launches and host syncs whatever its input): ``benchmarks/gpu_check.py``
times the same rows there.
"""

import argparse
import os
import statistics
import sys
import time

ROWS = ("text", "dummy", "walk", "floor", "image")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cost import OpCounter, batches, build, shard  # noqa: E402,F401  (shared; gpu_check reads them here)


def with_fix(model, row):
    """Install the fix's zero contribution on the embedding output for ``row``; returns an undo.  "walk": the
    fix's own ``mixed_media.zero_contribution`` (its first call records, the later ones walk); "dummy": the
    real dummy media path every time (what every text-only micro-batch ran before the walk)."""
    from fsdp2_compat.fixes import media_towers, mixed_media

    base = model.model
    run = media_towers.for_model(base).run

    def add_zero(module, inputs, output):
        if row == "dummy":
            zero = mixed_media._zero_of_output(run(base, output.device))
        elif row == "floor":
            zero = _floor(getattr(base, media_towers.for_model(base).attr), output.device)
        else:
            zero = mixed_media.zero_contribution(base, output.device)
        return output if zero is None else output + zero.to(output.dtype)

    handle = base.get_input_embeddings().register_forward_hook(add_zero)
    return handle.remove


def _floor(tower, device):
    """A 0-dim zero whose forward and backward issue the tower's units' collectives and nothing else."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from fsdp2_compat.fixes import unit_walk

    units = [m for m in tower.modules() if isinstance(m, FSDPModule)]
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # (renamed in 2.13)

    def shard_size(unit):
        """(elements, dtype) of the shards of the parameters ``unit`` holds (not its nested units'); read while
        sharded (after ``unshard()`` its parameters are plain tensors)."""
        params = [p for m in unit_walk.held_modules(unit) for p in m._parameters.values() if p is not None]
        return sum(p.to_local().numel() for p in params), (params[0].dtype if params else torch.float32)

    sizes = [shard_size(unit) for unit in units]

    def collectives(reduce):
        order = list(zip(units, sizes))
        for unit, (local, dtype) in (reversed(order) if reduce else order):
            unit.unshard()
            if reduce:
                shard = torch.empty(local, dtype=dtype, device=device)
                scatter(shard, torch.zeros(local * dist.get_world_size(), dtype=dtype, device=device))
            unit.reshard()

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            collectives(reduce=False)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            collectives(reduce=True)
            return grad

    return Floor.apply(torch.zeros((), device=device, requires_grad=True))


def step(model, batch, sync=None):
    model(**batch).loss.backward()
    if sync:
        sync()
    model.zero_grad(set_to_none=True)


def measure(model, family, runs, tokens, image_side, sync=None, device="cpu"):
    """``{row: (median seconds, aten ops)}``."""
    from fsdp2_compat.fixes import media_towers, unit_walk

    data = batches(model, family, tokens, image_side, device)
    out = {}
    for row in ROWS:
        undo = with_fix(model, row) if row in ("dummy", "walk", "floor") else (lambda: None)
        try:
            batch = data["image" if row == "image" else "text"]
            step(model, batch, sync)  # warm-up (and the walk's record)
            walks = unit_walk.STATS["walks"]
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                step(model, batch, sync)
                times.append(time.perf_counter() - start)
            if row == "walk" and unit_walk.STATS["walks"] - walks != runs:
                raise RuntimeError("the walk did not run: %s" % unit_walk.why_not(
                    model.model, media_towers.for_model(model.model).run))
            with OpCounter() as counter:
                step(model, batch, sync)
            out[row] = (statistics.median(times), counter.ops)
        finally:
            undo()
    return out


def _rank(rank, world, args):
    from torch.distributed.device_mesh import init_device_mesh

    model = shard(build(args["family"], args["depth"], args["layers"], args["vocab"]), init_device_mesh("cpu", (world,)))
    return measure(model, args["family"], args["runs"], args["tokens"], args["image"])


def report(results, label):
    text = results["text"][0]
    print(label)
    print("%-6s %10s %10s %12s %12s" % ("row", "ms", "+ms", "+ / text", "aten ops"))
    for row in ROWS:
        seconds, ops = results[row]
        added = seconds - text
        print("%-6s %10.1f %10s %12s %12d" % (row, 1e3 * seconds, "" if row == "text" else "%+.1f" % (1e3 * added),
                                             "" if row == "text" else "%.2f" % (added / text), ops))
    dummy, walk, floor = (results[row][0] - text for row in ("dummy", "walk", "floor"))
    print("added time: walk / dummy %.3f, walk / floor %.3f; aten ops added: dummy %d, walk %d, floor %d" % (
        walk / dummy if dummy > 0 else float("nan"), walk / floor if floor > 0 else float("nan"),
        *(results[row][1] - results["text"][1] for row in ("dummy", "walk", "floor"))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen2_5_vl", choices=("qwen2_5_vl", "qwen3_vl", "glm4v"))
    parser.add_argument("--depth", type=int, default=None, help="vision blocks (default: the real number)")
    parser.add_argument("--layers", type=int, default=1, help="text decoder layers")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per micro-batch")
    parser.add_argument("--image", type=int, default=448, help="image side in pixels")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=1)
    args = parser.parse_args()

    from fsdp2_compat_harness import tiny
    from fsdp2_compat_harness.ranks import run_ranks

    if tiny.unavailable(args.family):
        print("%s: %s" % (args.family, tiny.unavailable(args.family)))
        return 0
    import torch
    import transformers

    config = vars(args)
    results = run_ranks(_rank, args.ranks, config, timeout=3600, pg_timeout=600)
    for rank, r in enumerate(results):
        report(r, "%s tower (%s blocks), %d text layer(s), %d tokens, fp32 CPU, torch %s, transformers %s, "
                  "%d rank(s): rank %d" % (args.family, args.depth or "all", args.layers, args.tokens,
                                           torch.__version__, transformers.__version__, args.ranks, rank))
    return 0


if __name__ == "__main__":
    sys.exit(main())
