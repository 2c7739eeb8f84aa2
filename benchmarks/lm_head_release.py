"""When the gathered lm_head unit is released in backward: before vs after the early release.

Two CPU gloo ranks, tiny untied Qwen3-VL through verl's own fused forward
(``use_fused_kernels=True``, torch backend) with the ``qwen3vl`` patch and a
bf16 ``MixedPrecisionPolicy`` (fp32 reduce); a ``no_grad`` rollout forward,
then one optimizer step of two micro-batches with images, the first with
gradient sync deferred.  "before" is the same run with the early release
switched off (FSDP's root post-backward callback releases the unit after the
whole backward, as fsdp2-compat did before); "after" is the package as it is.
Measured in one run of each (``tests/support/release_jobs.py``'s
``lm_head_release``; a test asserts its counts):

- how many decoder layers (and vision blocks) start their backward while the
  lm_head unit is still unsharded;
- the order of the synchronising micro-batch's reduce-scatters (lm_head's
  against the first decoder layer's);
- the lm_head bytes a rank holds while they run (unsharded weight, its
  gradient, the fp32 accumulated gradient), per parameter; then the same per
  parameter rule for the real-size Qwen3-VL-8B and GLM-4.1V-9B lm_heads
  (meta device): the whole lm_head is unsharded on every rank, so this does
  not depend on the number of ranks.

    python benchmarks/lm_head_release.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

GIB = 1024 ** 3


def measure():
    """``{"before": rank-0 result, "after": rank-0 result}`` of ``release_jobs.lm_head_release``."""
    from fsdp2_compat_harness.ranks import run_ranks
    from support.release_jobs import lm_head_release

    return {"before": run_ranks(lm_head_release, 2, False)[0], "after": run_ranks(lm_head_release, 2, True)[0]}


def reduce_scatter_order(mb):
    """Units in the order of their reduce-scatters in one micro-batch's backward."""
    return [unit for op, unit in mb["events"] if op == "reduce_scatter_single"]


def main():
    import numpy as np

    from fsdp2_compat.core import guards
    from support.release_jobs import real_size

    verl = guards.installed_version("verl")
    if verl is None or not guards.in_range(verl, ">=0.7.1"):
        print("needs verl >= 0.7.1 (lm_head in its own FSDP2 unit, fused Qwen3-VL forward); found %s" % verl)
        return 0
    runs = measure()
    numel = runs["after"]["lm_head_numel"]
    n_layers, n_blocks = len(runs["after"]["layers"]), len(runs["after"]["blocks"])
    print("verl %s, torch %s, tiny Qwen3-VL (%d decoder layers, %d vision blocks), 2 ranks, bf16 params / fp32 "
          "reduce; micro-batch 0 deferred, 1 synchronising" % (verl, guards.installed_version("torch"), n_layers,
                                                               n_blocks))
    print("units starting their backward while the lm_head unit is unsharded, and the lm_head bytes held then:")
    print("%-50s %-36s %-22s" % ("", "before", "after"))
    per_param = {}
    for i, label in enumerate(("micro-batch 0 (deferred)", "micro-batch 1 (sync, after a deferred one)")):
        b, a = runs["before"]["micro_batches"][i], runs["after"]["micro_batches"][i]
        print("%-50s %-36s %-22s" % (label + ": decoder layers",
                                     "%d of %d" % (len(b["layers_while_unsharded"]), n_layers),
                                     "%d of %d" % (len(a["layers_while_unsharded"]), n_layers)))
        print("%-50s %-36s %-22s" % ("  vision blocks", "%d of %d" % (len(b["blocks_while_unsharded"]), n_blocks),
                                     "%d of %d" % (len(a["blocks_while_unsharded"]), n_blocks)))
        for side, mb in (("before", b), ("after", a)):
            per_param[(i, side)] = sum(mb["held"].values()) / numel
        print("%-50s %-36s %-22s" % ("  lm_head bytes held per parameter",
                                     "%g (%s)" % (per_param[(i, "before")], _parts(b["held"], numel)),
                                     "%g (%s)" % (per_param[(i, "after")], _parts(a["held"], numel))))
    for side in ("before", "after"):
        order = reduce_scatter_order(runs[side]["micro_batches"][1])
        print("reduce-scatter order, sync micro-batch, %s: %s" % (side, " -> ".join(_short(u) for u in order)))
    same = all(np.array_equal(runs["before"]["grads"][k], runs["after"]["grads"][k]) for k in runs["after"]["grads"])
    print("final gradients before vs after: %s" % ("bit-identical" if same else "DIFFERENT"))
    print("early releases (one per backward): before %d, after %d; lm_head sharded after the no_grad rollout: %s"
          % (runs["before"]["early_releases"], runs["after"]["early_releases"], runs["after"]["resharded_after_no_grad"]))
    print()
    print("real size, per rank (meta device; bytes per lm_head parameter as measured above):")
    print("%-13s %-22s %-10s %-34s %-34s" % ("model", "lm_head", "params", "micro-batch 0: before / after",
                                            "micro-batch 1: before / after"))
    for family, label in (("qwen3_vl", "Qwen3-VL-8B"), ("glm4v", "GLM-4.1V-9B")):
        real = real_size(family)
        cells = []
        for i in (0, 1):
            before, after = (per_param[(i, s)] * real["numel"] / GIB for s in ("before", "after"))
            cells.append("%.2f / %.2f GiB" % (before, after))
        print("%-13s %-22s %-10s %-34s %-34s" % (label, "%d x %d" % real["lm_head"], "%.1f M" % (real["numel"] / 1e6),
                                                cells[0], cells[1]))
        print("%-13s held through the backward of %d decoder layers and %d vision blocks before; of none after"
              % ("", real["layers"], real["blocks"]))
    print("(after, micro-batch 0 keeps the fp32 accumulated gradient: deferred sync keeps one for every unit)")
    return 0


def _parts(held, numel):
    return ", ".join("%s %g" % (k.replace("accumulated_grad", "fp32 accum"), v / numel) for k, v in held.items() if v)\
        or "nothing"


def _short(unit):
    return unit.replace("model.language_model.", "").replace("model.visual.", "visual.")


if __name__ == "__main__":
    sys.exit(main())
