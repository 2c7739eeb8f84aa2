"""What the collective guard (``FSDP2_COMPAT_GUARD=1``) costs per training step, in time and aten operators.

Two CPU gloo ranks train a real-size vision-language model (``--family``, default Qwen2.5-VL-7B: its
32-block vision tower, ``--layers`` text decoder layers at the real hidden size, a ``--vocab``-token
vocabulary; ``tests/support/real_size.py``), one ``fully_shard`` per ``_no_split_modules`` class plus the
root, fp32, on an image micro-batch (every unit runs): ``--steps`` forward + backward + SGD steps with the
guard and as many without, alternating (``fsdp2_compat.guard.install()`` / ``uninstall()`` between steps,
``_cost.alternate``, so both see the same machine load: these machines are shared).  Prints the median step
time of each, the ratio, the aten operators each dispatches, and how many checks (one 4-int all-gather
each, before every unit all-gather and reduce-scatter) a step adds.  On CPU gloo every collective is a
round trip through the kernel; on GPUs each check also costs one device sync.

    python benchmarks/guard_cost.py [--family qwen2_5_vl] [--steps 3] [--json]
    python benchmarks/guard_cost.py --depth 2 --layers 0 --vocab 512 --tokens 16 --image 56 --steps 1   # quick

No timing is asserted anywhere; the tests prove what the guard does, this says what it costs.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

OFF, ON = "guard off", "guard on"


def train(rank, world, args):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import _cost
    from fsdp2_compat import guard
    from fsdp2_compat.guard import agree

    model = _cost.build(args["family"], args["depth"], args["layers"], args["vocab"])
    line = _cost.geometry(model, args["tokens"], args["image"])
    _cost.shard(model, init_device_mesh("cpu", (world,)))
    batch = _cost.batches(model, args["family"], args["tokens"], args["image"])["image"]
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    checks = []

    def step():
        before = agree.STATS["checks"]
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        checks.append(agree.STATS["checks"] - before)

    rows = _cost.alternate({OFF: (None, None, step), ON: (guard.install, guard.uninstall, step)}, args["steps"])
    return {"rows": rows, "checks_per_step": max(checks), "geometry": line}


def measure(args):
    from fsdp2_compat_harness.ranks import run_ranks

    ranks = run_ranks(train, 2, args, timeout=3600, pg_timeout=900)
    rows = {label: max(tuple(r["rows"][label]) for r in ranks) for label in (OFF, ON)}  # the slowest rank's
    return {"family": args["family"], "steps": args["steps"], "geometry": ranks[0]["geometry"],
            "off_step_s": rows[OFF][0], "on_step_s": rows[ON][0], "ratio": rows[ON][0] / rows[OFF][0],
            "off_aten_ops": rows[OFF][1], "on_aten_ops": rows[ON][1],
            "checks_per_step": ranks[0]["checks_per_step"], "rows": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen2_5_vl", choices=("qwen2_5_vl", "qwen3_vl"))
    parser.add_argument("--depth", type=int, default=None, help="vision blocks (default: the real number)")
    parser.add_argument("--layers", type=int, default=1, help="text decoder layers")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--image", type=int, default=112, help="image side in pixels")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each (median)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = measure(vars(args))
    if args.json:
        print(json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=2))
        return
    import _cost

    _cost.print_rows(out["rows"], "guard, %s (%s), fp32, 2 gloo ranks, an image micro-batch, %s; median of %d steps "
                                  "(slowest rank); %d checks per step" % (
                                      out["family"], out["geometry"], _cost.stack(), out["steps"],
                                      out["checks_per_step"]))


if __name__ == "__main__":
    main()
