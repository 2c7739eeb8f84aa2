"""What the MoE-experts fix costs a step, in time, aten operators and reduce-scatter bytes, at real expert geometry.

On 2 CPU gloo ranks, Qwen3-30B-A3B's MoE decoder layer (``tests/support/real_size.MOE``:
hidden 2048, experts of 768, 8 routed experts per token, its attention),
reduced to what this CPU steps on two ranks: ``--layers`` decoder layers
(default 1 of 48), ``--experts`` routed experts per layer (default 64 of
128; ``--experts 128`` is the real count, ~9 GiB per rank), a
``--vocab``-token vocabulary (default 4096); fp32, sharded per decoder layer
(``fully_shard``), transformers 4.x's per-expert ``nn.ModuleList`` (the loop
that runs only the experts some token reached; a forward without backward
first checks that every rank reaches every expert).  One step is forward +
backward + SGD on 2 rows of ``--tokens`` tokens per rank.  Three variants of
the step, alternating run after run in the same rank processes
(``_cost.alternate``; the fix is requested and reverted between them, and the
units it marked unmarked):

  unpatched, every expert reached          each rank's tokens reach every expert
  patched, every expert reached            the same, with the ``moe`` patch
  patched, ranks reach different experts   each rank's router never picks ``--masked`` experts of its own
                                           (rank r: experts r*k .. r*k+k-1, by a forward hook on the gate):
                                           as many token-expert assignments, over fewer experts
                                           per rank, and different ones on each rank

Unpatched, the third cannot be measured at all: gloo aborts (``Received data
size doesn't match expected size``); so the fix's cost is what the third adds
to the first.  Printed, measured in one run: median step ms, the time ratios
to the first row, the aten operators each dispatches (forward + backward +
SGD) and the reduce-scatter bytes per step (every ``reduce_scatter_single`` /
``reduce_scatter_tensor`` input, counted in this benchmark's ranks only): the
fix makes a unit reduce what it reduces on a step where every expert is
reached, so the bytes ratio is 1.000.

    python benchmarks/moe_experts.py            # the default geometry above (a few minutes)
    python benchmarks/moe_experts.py --smoke    # tiny sizes, one run: the smoke test

transformers 5.x keeps experts as 3-D parameters (every rank has every
gradient): the fix installs nothing there, and this says so and times nothing.
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROWS = ("unpatched, every expert reached", "patched, every expert reached", "patched, ranks reach different experts")
SMOKE = dict(hidden=64, moe_intermediate=32, experts=16, top_k=2, layers=1, vocab=512, tokens=32, masked=2, runs=1)


def _config(args):
    from support.real_size import real_size_moe_config

    return real_size_moe_config("qwen3_moe", num_hidden_layers=args["layers"], vocab_size=args["vocab"],
                                num_experts=args["experts"], num_experts_per_tok=args["top_k"],
                                **({} if args["hidden"] is None else {
                                    "hidden_size": args["hidden"], "moe_intermediate_size": args["moe_intermediate"],
                                    "intermediate_size": 4 * args["hidden"], "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "head_dim": 16}))


def _rank(rank, world, args):
    import torch
    import torch.distributed as dist
    import transformers

    import _cost
    import fsdp2_compat
    from fsdp2_compat.fixes import experts
    from fsdp2_compat.fixes.units import live_units
    from fsdp2_compat_harness import moe_scenarios
    from fsdp2_compat_harness.tiny import moe

    sent = {"bytes": 0}

    def counting(original):
        def call(*a, **k):
            tensor = k.get("input", k.get("input_tensor", a[1] if len(a) > 1 else None))
            sent["bytes"] += tensor.numel() * tensor.element_size()
            return original(*a, **k)

        return call

    # FSDP2 calls one of them through the module attribute (2.13: reduce_scatter_single, by keyword)
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            setattr(dist, name, counting(getattr(dist, name)))

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(_config(args)).train()
    model = moe_scenarios.shard("fully_shard", model, world)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    masked = set(range(rank * args["masked"], (rank + 1) * args["masked"]))
    mask = torch.zeros(args["experts"])
    mask[sorted(masked)] = -1e4
    routing = {"masked": False}
    for _, block in moe.moe_blocks(model):
        block.gate.register_forward_hook(lambda _m, _i, out: out + mask if routing["masked"] else out)
    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(3, args["vocab"], (2, args["tokens"]), generator=gen)
    # Unpatched, a rank that leaves an expert unreached aborts the run: check first, in a forward without backward.
    with torch.no_grad(), moe.hits(model) as hits:
        model(input_ids=ids)
    fewest = torch.tensor([min(len(seen) for seen in hits.values())])
    dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
    if int(fewest) < args["experts"]:
        raise RuntimeError("with these tokens some rank reaches only %d of the %d experts of a block: not the "
                           "every-expert case the unpatched rows need (more --tokens)" % (int(fewest), args["experts"]))
    record = {label: {"bytes": [], "reached": []} for label in ROWS}

    def step(label):
        def run():
            before = sent["bytes"]
            with moe.hits(model) as hits:
                model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            record[label]["bytes"].append(sent["bytes"] - before)
            record[label]["reached"].append({name: sorted(seen) for name, seen in hits.items()})

        return run

    def patched(masked_routing):
        def on():
            fsdp2_compat.apply(["moe"])
            routing["masked"] = masked_routing

        return on

    def unpatched():
        fsdp2_compat.revert()
        routing["masked"] = False
        for _, state in live_units():  # units the fix marked keep the flag after a revert: unmark them
            group = getattr(state, "_fsdp_param_group", None)
            if group is not None and getattr(group, "reduce_scatter_unused_params", False):
                group.reduce_scatter_unused_params = False
            if group is not None and "post_backward" in vars(group):  # a torch without the flag
                del group.post_backward
        experts._COVERED.clear()

    rows = _cost.alternate({
        ROWS[0]: (None, None, step(ROWS[0])),
        ROWS[1]: (patched(False), unpatched, step(ROWS[1])),
        ROWS[2]: (patched(True), unpatched, step(ROWS[2])),
    }, args["runs"])
    return {"rows": rows, "bytes": {label: statistics.median(r["bytes"]) for label, r in record.items()},
            "reached": {label: r["reached"] for label, r in record.items()}, "masked": sorted(masked),
            "params": sum(p.numel() for p in model.parameters()) * world}


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one run (%s)" % SMOKE)
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (default: the checkpoint's 2048)")
    parser.add_argument("--moe-intermediate", type=int, default=None)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=128, help="per row; two rows per rank")
    parser.add_argument("--masked", type=int, default=8, help="experts each rank's router never picks (row 3)")
    parser.add_argument("--runs", type=int, default=3)
    args = vars(parser.parse_args(argv))
    if args.pop("smoke"):
        args.update(SMOKE)
    args["moe_intermediate"] = args["moe_intermediate"] or (None if args["hidden"] is None else args["hidden"] // 2)

    import torch
    import transformers

    import _cost
    from fsdp2_compat_harness.ranks import run_ranks

    with torch.device("meta"):
        probe = transformers.Qwen3MoeForCausalLM(_config(dict(args, layers=1)))
    if not isinstance(probe.model.layers[0].mlp.experts, torch.nn.ModuleList):
        print("transformers %s keeps a MoE layer's experts as 3-D parameters (every rank has every gradient): "
              "the MoE experts fix installs nothing here, nothing to time" % transformers.__version__)
        return 0
    config = probe.config
    results = run_ranks(_rank, 2, args, timeout=3600, retries=0, pg_timeout=900)
    rows = {label: max(tuple(r["rows"][label]) for r in results) for label in ROWS}  # the slowest rank's
    _cost.print_rows(rows, "MoE experts fix, Qwen3-30B-A3B geometry reduced: %d decoder layer(s), hidden %d, %d "
                           "experts of %d (top %d), vocabulary %d, %.1fM parameters; fp32, 2 gloo ranks, 2x%d "
                           "tokens per rank; %s; median of %d (slowest rank)"
                     % (args["layers"], config.hidden_size, args["experts"], config.moe_intermediate_size,
                        args["top_k"], args["vocab"], results[0]["params"] / 1e6, args["tokens"], _cost.stack(),
                        args["runs"]))
    base = results[0]["bytes"][ROWS[0]]
    for label in ROWS[1:]:
        b = results[0]["bytes"][label]
        print("  reduce-scatter bytes per step (rank 0), %s / %s: %d / %d = %.3f" % (
            label, ROWS[0], b, base, b / base if base else float("nan")))
    for label in ROWS:
        fewest = [min(min(len(v) for v in step.values()) for step in r["reached"][label]) for r in results]
        print("  %s: fewest experts reached in a block, per rank: %s of %d" % (label, fewest, args["experts"]))
        if label != ROWS[2] and min(fewest) < args["experts"]:
            raise SystemExit("a rank left an expert unreached in row %r: not the every-expert case (more --tokens)"
                             % label)
    differ = results[0]["reached"][ROWS[2]][-1] != results[1]["reached"][ROWS[2]][-1]
    print("  row 3: the ranks' expert sets differ: %s (rank r's router never picks %s)"
          % (differ, " / ".join(str(r["masked"]) for r in results)))
    print("  unpatched with different experts: not measurable (gloo aborts: Received data size doesn't match)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
