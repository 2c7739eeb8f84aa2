"""lm_head per training step: verl 0.9.1's plain ``full_tensor()`` vs the patch, in bytes and in time.

Bytes: two CPU gloo ranks, tiny Qwen3-VL through verl's own fused forward
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

Time, at real size (``head_time``; no framework needed): a real-size untied
head (default Qwen2.5-VL-7B's ``lm_head``, 152064 x 3584, fp32) in an FSDP2
unit of its own after one hidden-size ``Linear`` unit (standing in for the
decoder), read by a fused-style loss outside its forward: verl's
``FusedLinearForPPO`` (torch backend) where verl is installed, else a chunked
log-softmax of the same shape.  Upstream reads ``lm_head.weight.full_tensor()``
(verl 0.9.1's Qwen3-VL / Qwen3.5 fused forwards); patched,
``fsdp2_compat.gather_param(lm_head)``, the call the fix's wrapper makes
(the unit unshards through FSDP, its gradient is reduce-scattered, averaged, as
soon as it is complete).  Both read the same sharded model in the same
process, alternating step by step; it prints the median step (forward +
backward) of each, the time ratio and the aten operators dispatched, one
process (``--ranks 1``: the gather is a local copy, what is left is the fix's
own work) and two gloo ranks (``--ranks 2``: its collectives; a quarter of
the rows by default, ``--vocab2``: two real-size heads do not fit this
machine's memory).  Upstream's
step is the cheaper one by construction: it skips the reduce-scatter, which is
the unaveraged gradient.

    python benchmarks/lm_head_gather.py                   # bytes (verl >= 0.9), then time at 1 and 2 ranks
    python benchmarks/lm_head_gather.py --vocab 4096 --tokens 16 --runs 1   # a quick run

The measuring code is ``tests/support/rank_jobs.py``'s ``lm_head_traffic``
(importable by the rank processes; tests assert its byte counts).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HEADS = {"qwen2_5_vl": ("Qwen2.5-VL-7B", 152064, 3584), "qwen3_vl": ("Qwen3-VL-8B", 151936, 4096)}


def _fused_loss():
    """``(name, loss(hidden, weight, labels))``: verl's ``FusedLinearForPPO`` (torch backend) where verl is
    installed, else a chunked log-softmax (512-token chunks, as verl's); the loss is the mean negative
    log-probability."""
    try:
        from verl.utils.experimental.torch_functional import FusedLinearForPPO
    except ImportError:
        FusedLinearForPPO = None
    if FusedLinearForPPO is not None:
        kernel = FusedLinearForPPO(impl_backend="torch")

        def verl_loss(hidden, weight, labels):
            log_probs, _entropy = kernel(hidden, weight, labels)
            return -log_probs.mean()

        return "verl's FusedLinearForPPO (torch backend)", verl_loss

    def chunked(hidden, weight, labels, chunk=512):
        import torch

        total = 0
        flat, flat_labels = hidden.flatten(0, 1), labels.flatten()
        for start in range(0, flat.shape[0], chunk):
            logits = flat[start:start + chunk] @ weight.t()
            total = total + torch.log_softmax(logits.float(), -1).gather(
                -1, flat_labels[start:start + chunk, None]).sum()
        return -total / flat.shape[0]

    return "a chunked log-softmax (verl not installed)", chunked


def head_time(rank, world, vocab, hidden, tokens, runs):
    """``{"kernel": name, "rows": {label: (median s, aten ops)}}``: one step of a real-size head read outside
    its forward, ``full_tensor()`` vs ``gather_param``, alternating (``_cost.alternate``)."""
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh

    import _cost
    import fsdp2_compat

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(hidden, hidden)  # the decoder's stand-in: a unit whose backward follows the head's
            self.lm_head = nn.Linear(hidden, vocab, bias=False)

        def forward(self, x):
            return self.body(x)

    torch.manual_seed(0)
    model = Head()
    _cost.shard(model, init_device_mesh("cpu", (world,)), units=[model.body, model.lm_head])
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(1, tokens, hidden, generator=gen)
    labels = torch.randint(0, vocab, (1, tokens), generator=gen)
    kernel, loss = _fused_loss()

    def step(read):
        def run():
            h = model(x)
            loss(h, read(model.lm_head), labels).backward()
            model.zero_grad(set_to_none=True)

        return run

    rows = _cost.alternate({
        "upstream: weight.full_tensor()": (None, None, step(lambda head: head.weight.full_tensor())),
        "patched: gather_param (unit unshard)": (None, None, step(fsdp2_compat.gather_param)),
    }, runs)
    return {"kernel": kernel, "rows": rows}


def print_time(family, world, vocab, hidden, tokens, runs):
    import _cost
    from fsdp2_compat_harness.ranks import run_ranks

    results = run_ranks(head_time, world, vocab, hidden, tokens, runs, timeout=3600, pg_timeout=900)
    rows = {k: max(tuple(r["rows"][k]) for r in results) for k in results[0]["rows"]}  # the slowest rank's
    _cost.print_rows(rows, "lm_head %d x %d (%s), fp32, %d tokens, %s, %d rank(s), %s; median of %d (slowest rank)"
                     % (vocab, hidden, HEADS[family][0] if (vocab, hidden) == HEADS[family][1:] else "%s's, fewer rows" % HEADS[family][0],
                        tokens, results[0]["kernel"], world, _cost.stack(), runs))


def bytes_table():
    from fsdp2_compat.core import guards
    from fsdp2_compat_harness.ranks import run_ranks
    from support.rank_jobs import lm_head_traffic

    verl = guards.installed_version("verl")
    if verl is None or not guards.in_range(verl, ">=0.9.0"):
        print("bytes: needs verl >= 0.9 (plain full_tensor() in the Qwen3-VL fused forward); found %s" % verl)
        return
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen2_5_vl", choices=sorted(HEADS), help="whose lm_head (time)")
    parser.add_argument("--vocab", type=int, default=None, help="rows of the head (default: the family's)")
    parser.add_argument("--vocab2", type=int, default=None,
                        help="rows of the head at 2 ranks (default: a quarter of the family's: two processes holding "
                             "a real-size fp32 head, its full copy, gradient and reduce buffers, ~8 GiB each, do not "
                             "fit this shared 23 GiB machine)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--no-bytes", action="store_true", help="only the time rows")
    args = parser.parse_args()
    if not args.no_bytes:
        bytes_table()
    _name, vocab, hidden = HEADS[args.family]
    for world in args.ranks:
        rows = args.vocab or vocab if world == 1 else args.vocab2 or args.vocab or vocab // 4
        print_time(args.family, world, rows, hidden, args.tokens, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
