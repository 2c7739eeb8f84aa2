"""Per-call cost of a method seam's argument reading, on torch's hottest seam.

``FSDPParam.to_accumulated_grad_if_needed`` runs once per parameter per
backward.  Its seam (``fixes.accumulation.guard_seam``) finds the parameter
with ``core.calls.Signature.receiver``, which also covers calls through the
class attribute itself and keyword self (issue #22).  This times, on a real
``FSDPParam`` of a ``fully_shard``-ed module (one gloo rank, after a forward,
so torch's method does its ordinary early return):

    torch         the released method, unwrapped
    instance-only a wrapper that reads ``instance`` alone (the seam before #22)
    seam          the installed seam (``calls``'s rule)

    python benchmarks/seam_calls.py [--calls N] [--json]

On torch 2.15.0+ the method is gone (and the seam with it): it says so and times nothing.
"""

import argparse
import json
import timeit


def _gathered_fsdp_param():
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = nn.Sequential(nn.Linear(8, 8))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    model(torch.randn(2, 8)).sum().backward()
    return model._get_fsdp_state()._fsdp_param_group.fsdp_params[0]


def measure(calls, rounds=15):
    import wrapt
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    from fsdp2_compat.fixes.accumulation import guard_seam, never_all_gathered

    attr = "FSDPParam.to_accumulated_grad_if_needed"
    released = vars(_fsdp_param.FSDPParam)["to_accumulated_grad_if_needed"]

    def instance_only(wrapped, instance, args, kwargs):
        if instance is not None and never_all_gathered(instance):
            return None
        return wrapped(*args, **kwargs)

    variants = {
        "torch": released,
        "instance-only": wrapt.FunctionWrapper(released, instance_only),
        "seam": guard_seam(_fsdp_param, attr)[attr],
    }
    param = _gathered_fsdp_param()
    out = {label: float("inf") for label in variants}
    try:
        # interleaved and the best of many rounds: the machine is shared, the minimum is the cost
        for _ in range(rounds):
            for label, method in variants.items():
                _fsdp_param.FSDPParam.to_accumulated_grad_if_needed = method
                elapsed = timeit.timeit(param.to_accumulated_grad_if_needed, number=calls)
                out[label] = min(out[label], elapsed / calls * 1e9)
    finally:
        _fsdp_param.FSDPParam.to_accumulated_grad_if_needed = released
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    if "to_accumulated_grad_if_needed" not in vars(_fsdp_param.FSDPParam):
        import torch

        why = ("torch %s has no FSDPParam.to_accumulated_grad_if_needed (2.15.0 rewrote accumulation): the seam is "
               "not installed there, nothing to time" % torch.__version__)
        print(json.dumps({"skipped": why}) if args.json else why)
        return
    ns = measure(args.calls)
    if args.json:
        print(json.dumps({k: round(v, 1) for k, v in ns.items()}))
        return
    for label, value in ns.items():
        print("%-14s %7.1f ns per call (+%.1f ns over torch)" % (label, value, value - ns["torch"]))


if __name__ == "__main__":
    main()
