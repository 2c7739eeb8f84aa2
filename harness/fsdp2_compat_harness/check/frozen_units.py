"""``check`` row "LoRA tower unfrozen, 2 ranks": pytorch #186998 on torch 2.8.0-2.13.x.

A PEFT LoRA Qwen2.5-VL (``fsdp2_compat_harness.lora.unfreeze``), per-layer ``fully_shard`` with bf16 parameters /
fp32 reduce on 2 gloo ranks with different data: a warm-up step with the vision tower frozen, then the tower
unfrozen.  Unpatched the tower's units kept no dtypes from their frozen first forward and the step fails;
patched, the vision gradients are compared with the unsharded fp32 model's on the data-parallel average (bf16
bound, relative to the largest).  Cases only where torch has the bug and peft is installed.
"""

from .scenario import Case, Result, Scenario, quiet

KIND = "LoRA tower unfrozen, 2 ranks"
FAMILY = "qwen2_5_vl"


class FrozenUnits(Scenario):
    KINDS = (KIND,)
    ORDER = 42
    NOTE = ("note: 'LoRA tower unfrozen' compares the unfrozen tower's gradients with the unsharded fp32 model's "
            "(bf16 compute: the column is the worst error relative to the largest gradient, bound 6e-2).")

    def cases(self, stack):
        from fsdp2_compat import registry
        from fsdp2_compat.core import guards

        from .. import tiny

        torch = guards.installed_version("torch")
        if not (torch and guards.in_range(torch, ">=2.8.0,<2.14.0") and guards.installed_version("peft")):
            return []
        if (stack.families is not None and FAMILY not in stack.families) or tiny.unavailable(FAMILY) is not None:
            return []
        return [Case("torch", torch, FAMILY, registry.for_model_type(FAMILY).name, KIND)]

    def run(self, case, patched, scratch):
        from ..lora import unfreeze
        from ..ranks import run_ranks
        from ..scenarios import first_line

        try:
            results = run_ranks(quiet, 2, unfreeze, "fully_shard", case.patch if patched else None, pg_timeout=60)
        except Exception as exc:  # the scenario itself broke: report, do not die
            return Result.failed("%s: %s" % (type(exc).__name__, first_line(exc)))
        failed = [r for r in results if r["error"] is not None]
        return Result.of(failed[0] if failed else max(results, key=lambda r: r["loss_err"]))


SCENARIO = FrozenUnits()
