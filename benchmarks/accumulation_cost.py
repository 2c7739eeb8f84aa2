"""What the torch gradient-accumulation fix costs a deferred-sync step, in time and aten operators, at real size.

The fix (``fsdp2_compat/fixes/accumulation.py``, torch 2.6.0-2.14.1) wraps
``FSDPParam.to_accumulated_grad_if_needed`` (called once per parameter per
backward) and ``FSDPParamGroup.post_backward`` (once per unit per backward).
It changes something only on a micro-batch that skips a unit (a text-only one
beside image ones); there, unpatched, torch crashes
(``AttributeError: ... '_unsharded_param'``) and nothing can be timed.  So
this times the step where it changes nothing and upstream runs: every
micro-batch has an image (uses every unit), what every step of a VLM's
training pays once the fix is on.

Real-size Qwen2.5-VL-7B (``tests/support/real_size.py``): its 32-block vision
tower (``--depth``), ``--layers`` text decoder layers at 3584 (default 1 of
28) and a ``--vocab``-token vocabulary (default 4096: the head is not what
the fix touches), one ``fully_shard`` per ``_no_split_modules`` class plus the
root, bf16 parameters and fp32 reduce (verl's and SkyRL's default policy: the
one where accumulation upcasts).  One step: ``--micro`` micro-batches with a
``--image``-pixel image and ``--tokens`` tokens, the gradient sync deferred
on all but the last (``set_requires_gradient_sync``), then ``zero_grad``.
With and without the fix's two targets (requested through the engine, as
the family patches install them, and reverted), alternating step by step
(``_cost.alternate``); prints the median step ms, the time ratio and the
aten operators of each (measured in one run).  ``--ranks 2``: two gloo ranks
(the same image micro-batches on both).

    python benchmarks/accumulation_cost.py              # 1 process, the default geometry (a few minutes)
    python benchmarks/accumulation_cost.py --depth 2 --layers 0 --vocab 512 --tokens 16 --image 56 --runs 1

torch 2.15.0+ rewrote accumulation: the fix installs nothing there, and this says so and times nothing.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _rank(rank, world, args):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import _cost
    from fsdp2_compat.integrations import torch_fsdp
    from fsdp2_compat_harness import subset

    model = _cost.build("qwen2_5_vl", args["depth"], args["layers"], args["vocab"])
    line = _cost.geometry(model, args["tokens"], args["image"])
    _cost.shard(model, init_device_mesh("cpu", (world,)),
                MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    batch = _cost.batches(model, "qwen2_5_vl", args["tokens"], args["image"])["image"]
    micro = args["micro"]

    def step():
        for i in range(micro):
            model.set_requires_gradient_sync(i == micro - 1)
            (model(**batch).loss / micro).backward()
        model.zero_grad(set_to_none=True)

    keys = [torch_fsdp.GRAD_ACCUM_GUARD.key, torch_fsdp.GRAD_ACCUM_UNIFORM.key]

    def on():
        import wrapt
        from torch.distributed.fsdp._fully_shard import _fsdp_param

        subset.request(keys)
        if not isinstance(vars(_fsdp_param.FSDPParam)["to_accumulated_grad_if_needed"], wrapt.FunctionWrapper):
            raise RuntimeError("the accumulation fix was not installed: %s" % [
                row for row in __import__("fsdp2_compat").status() if row.get("patch") == subset.NAME])

    rows = _cost.alternate({
        "without the fix": (None, None, step),
        "with the fix (its 2 torch targets)": (on, subset.forget, step),
    }, args["runs"])
    return {"rows": rows, "geometry": line}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=None, help="vision blocks (default: the real 32)")
    parser.add_argument("--layers", type=int, default=1, help="text decoder layers")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per micro-batch")
    parser.add_argument("--image", type=int, default=112, help="image side in pixels")
    parser.add_argument("--micro", type=int, default=2, help="micro-batches per step (all but the last deferred)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=1)
    args = parser.parse_args()

    import _cost
    from fsdp2_compat.core import guards
    from fsdp2_compat_harness.ranks import run_ranks

    torch_version = guards.installed_version("torch")
    if not guards.in_range(torch_version, ">=2.6.0,<=2.14.1"):
        print("torch %s: the accumulation fix installs nothing here (its targets cover 2.6.0-2.14.1; 2.15.0 rewrote "
              "accumulation), nothing to time" % torch_version)
        return 0
    results = run_ranks(_rank, args.ranks, vars(args), timeout=3600, pg_timeout=900)
    rows = {label: max(tuple(r["rows"][label]) for r in results) for label in results[0]["rows"]}
    _cost.print_rows(rows, "accumulation fix, Qwen2.5-VL-7B (%s), bf16 params / fp32 reduce, %d micro-batches with an "
                           "image (all but the last deferred), %d rank(s); %s; median of %d (slowest rank)"
                     % (results[0]["geometry"], args.micro, args.ranks, _cost.stack(), args.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
