"""What the collective guard (``FSDP2_COMPAT_GUARD=1``) costs per training step, as a ratio.

Two CPU gloo ranks train a tiny model sharded per layer class (the audit's ``fixed`` plan), the same data
on both ranks, ``--steps`` forward + backward + SGD steps with the guard and as many without, alternating
(``fsdp2_compat.guard.install()`` / ``uninstall()`` between steps, so both see the same machine load: these
machines are shared).  Prints the median step time of each, the ratio, and how many checks (one 4-int
all-gather each) a step adds.  On CPU gloo every collective is a
round trip through the kernel, so this is an upper bound for the share of a real step: on GPUs a step's
compute dwarfs a tiny model's, while each check still costs one small all-gather and one device sync.

    python benchmarks/guard_cost.py [--family qwen2_5_vl] [--steps 20] [--json]

No timing is asserted anywhere; the tests prove what the guard does, this says what it costs.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train(rank, world, family, steps):
    import statistics
    import time

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdp2_compat import guard
    from fsdp2_compat.guard import agree
    from fsdp2_compat_harness import tiny
    from fsdp2_compat_harness.audit.plans import plan_modules

    model = tiny.build(family, tie=False, seed=0)
    batch = tiny.make_batch(family, model, seed=1)
    mesh = init_device_mesh("cpu", (world,))
    modules = dict(model.named_modules())
    for name in plan_modules(model, "fixed"):
        fully_shard(modules[name], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = {False: [], True: []}
    for i in range(2 * steps + 2):  # two warm-up steps, then off / on alternating
        on = i % 2 == 1
        if on:
            guard.install()
        checks = agree.STATS["checks"]
        start = time.perf_counter()
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        if i >= 2:
            times[on].append(time.perf_counter() - start)
        if on:
            guard.uninstall()
            per_step = agree.STATS["checks"] - checks
    return {"off_s": statistics.median(times[False]), "on_s": statistics.median(times[True]),
            "checks_per_step": per_step}


def measure(family, steps):
    from fsdp2_compat_harness.ranks import run_ranks

    ranks = run_ranks(train, 2, family, steps, timeout=600)
    off_s = max(r["off_s"] for r in ranks)
    on_s = max(r["on_s"] for r in ranks)
    return {"family": family, "steps": steps, "off_step_s": off_s, "on_step_s": on_s, "ratio": on_s / off_s,
            "checks_per_step": ranks[0]["checks_per_step"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen2_5_vl")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = measure(args.family, args.steps)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print("%s, 2 gloo ranks, %d steps: guard off %.1f ms/step, on %.1f ms/step: ratio %.2fx (%.0f checks per step)"
          % (out["family"], out["steps"], out["off_step_s"] * 1e3, out["on_step_s"] * 1e3, out["ratio"],
             out["checks_per_step"]))


if __name__ == "__main__":
    main()
