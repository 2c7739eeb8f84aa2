"""lm_head communication per training step: verl 0.9.1's plain ``full_tensor()`` vs the patch.

Two CPU gloo ranks, tiny Qwen3-VL through verl's own fused forward
(``use_fused_kernels=True``, torch backend) and ``apply_fsdp2`` with a bf16
``MixedPrecisionPolicy`` (fp32 reduce).  The collectives are counted by
wrapping ``torch.distributed.all_gather_single`` / ``reduce_scatter_single``
(FSDP2) and ``_functional_collectives.all_gather_single`` (DTensor).  They are
attributed to ``lm_head`` by where they happen: DTensor gathers come from
upstream's ``lm_head.weight.full_tensor()`` (nothing else redistributes
here), FSDP collectives count while ``lm_head``'s own unit unshards or runs
its post-backward.  The size of the weight that reaches ``FusedLinearForPPO`` is
recorded too.  Prints per-rank numbers and the patch/upstream ratios, from one
run.  Upstream under bf16 gathers the fp32 master and then fails in the
kernel (fp32 weight x bf16 activations); its bytes are counted up to there.

    python benchmarks/lm_head_gather.py

The measuring code is ``tests/support/rank_jobs.py``'s ``lm_head_traffic``
(importable by the rank processes; tests assert its byte counts).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def main():
    from fsdp2_compat.core import guards
    from fsdp2_compat_harness.ranks import run_ranks
    from support.rank_jobs import lm_head_traffic

    verl = guards.installed_version("verl")
    if verl is None or not guards.in_range(verl, ">=0.9.0"):
        print("needs verl >= 0.9 (plain full_tensor() in the Qwen3-VL fused forward); found %s" % verl)
        return 0
    upstream = run_ranks(lm_head_traffic, 2, None)[0]
    patched = run_ranks(lm_head_traffic, 2, "qwen3vl")[0]
    print("verl %s, tiny Qwen3-VL, 2 ranks, bf16 param_dtype, fp32 reduce; lm_head.weight %d elements" % (verl, upstream["lm_head_numel"]))
    print("%-28s %14s %14s %8s" % ("per rank, one step", "upstream", "patched", "ratio"))
    for key in ("all_gather_bytes", "kernel_weight_bytes", "reduce_scatter_bytes"):
        u, p = upstream[key], patched[key]
        ratio = "%.2f" % (p / u) if u else "n/a"
        print("%-28s %14d %14d %8s" % (key, u, p, ratio))
    print("upstream: %s" % (upstream["error"] or "ok"))
    print("patched:  %s (kernel weight %s)" % (patched["error"] or "ok", patched.get("kernel_weight_dtype")))
    print("(upstream reduce-scatters nothing for lm_head: that is the unaveraged gradient)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
