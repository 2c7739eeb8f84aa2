"""What the MoE-experts fix costs where it changes nothing: a step on which every rank's tokens reach every expert.

On 2 CPU gloo ranks, a tiny Qwen3-MoE (``tiny.moe``: 16 experts, one per
token) sharded per decoder layer (``fully_shard``), trained on micro-batches
long enough that every rank reaches every expert (asserted: on a batch that
leaves some expert unreached, the unpatched run cannot be measured at all,
it aborts).  Unpatched, then with the ``moe`` patch, in the same rank
processes, ``STEPS`` steps each:

- reduce-scatter bytes per step (every ``reduce_scatter_single`` /
  ``reduce_scatter_tensor`` input, counted by a wrapper on
  ``torch.distributed`` in this benchmark's ranks only): the
  fix marks the units, and a unit reduces exactly what it reduced before
  when every expert has a gradient, so the ratio is 1.0;
- step time (forward + backward + SGD), the median of the steps: the fix's
  per-call cost is one dictionary lookup per MoE block call.

On a step where some expert is unreached, the fix reduces a zero for it: the
bytes of that unit are then those of a step where every expert is reached,
the size upstream sends on its ordinary steps.  Printed as ratios measured
in one run (machines here are noisy).

    python benchmarks/moe_experts.py [--smoke]
"""

import os
import statistics
import sys
import time

STEPS = 6
TOKENS = 256  # per row: every one of the 16 experts is reached on every rank


def _rank(rank, world, steps, tokens):
    import torch
    import torch.distributed as dist

    import fsdp2_compat
    from fsdp2_compat_harness import moe_scenarios
    from fsdp2_compat_harness.tiny import moe
    from fsdp2_compat_harness.tiny.text import text_ids

    sent = {"bytes": 0}

    def counting(original):
        def call(*args, **kwargs):
            tensor = kwargs.get("input", kwargs.get("input_tensor", args[1] if len(args) > 1 else None))
            sent["bytes"] += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)

        return call

    # FSDP2 calls one of them through the module attribute (2.13: reduce_scatter_single, by keyword)
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            setattr(dist, name, counting(getattr(dist, name)))
    out = {}
    for label, patches in (("unpatched", None), ("patched", ["moe"])):
        if patches:
            fsdp2_compat.apply(patches)
        model = moe_scenarios.shard("fully_shard", moe_scenarios.build("qwen3_moe"), world)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(100 + rank)
        times, per_step, reached = [], [], set()
        for _ in range(steps):
            ids = torch.stack([text_ids(gen, tokens) for _ in range(2)])
            before = sent["bytes"]
            start = time.perf_counter()
            with moe.hits(model) as hits:
                model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
            per_step.append(sent["bytes"] - before)
            reached.add(min(len(v) for v in hits.values()))
        out[label] = {"seconds": statistics.median(times), "bytes": statistics.median(per_step),
                      "fewest_experts_reached": min(reached)}
        fsdp2_compat.revert()
    return out


def main(argv):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from fsdp2_compat_harness.ranks import run_ranks
    from fsdp2_compat_harness.tiny import moe

    smoke = "--smoke" in argv
    steps, tokens = (1, TOKENS) if smoke else (STEPS, TOKENS)  # fewer tokens could leave an expert unreached
    results = run_ranks(_rank, 2, steps, tokens, timeout=600, retries=0, pg_timeout=60)
    r = results[0]
    fewest = min(res[label]["fewest_experts_reached"] for res in results for label in res)
    if fewest < moe.EXPERTS:
        raise SystemExit("a rank reached only %d of %d experts in some block: not the every-expert case" % (
            fewest, moe.EXPERTS))
    print("MoE experts fix, tiny Qwen3-MoE, 2 gloo ranks, %d steps of 2x%d tokens (fewest experts reached in a "
          "block: %d of %d)" % (steps, tokens, fewest, moe.EXPERTS))
    for key, what in (("bytes", "reduce-scatter bytes per step"), ("seconds", "step time (median)")):
        a, b = r["unpatched"][key], r["patched"][key]
        print("  %-32s unpatched %-12.6g patched %-12.6g ratio %.3f" % (what, a, b, b / a if a else float("nan")))


if __name__ == "__main__":
    main(sys.argv[1:])
