"""``check`` row "fp32 routers, 2 ranks": transformers >= 5.24.0 keeps MoE routers fp32 in a bf16 model.

Only where the installed transformers keeps them (5.24.0+): a tiny GLM-4.5 (glm4_moe) saved in bf16 and loaded
back by ``from_pretrained(dtype=torch.bfloat16)`` on two gloo ranks with different data, sharded by torch's
per-layer recipe (bf16 params / fp32 reduce; ``dtype_scenarios``), against the unsharded data-parallel
reference: unpatched torch's "FSDP expects uniform original parameter dtype" at the first forward, patched
(``moe``) each router in a unit of its own, exact.  The tests run DeepSeek-V3 and accelerate's preparation too
(tests/integrations/test_mixed_dtypes.py).
"""

from .scenario import TWO_RANKS_NOTE, Case, Result, Scenario

KIND = "fp32 routers, 2 ranks"
FAMILY = "glm4_moe"
KEEPS_FP32 = ">=5.24.0"  # transformers' _keep_in_fp32_modules_strict lists the routers' gate.weight


class MixedDtypes(Scenario):
    KINDS = (KIND,)
    ORDER = 46
    NOTE = TWO_RANKS_NOTE

    def cases(self, stack):
        from fsdp2_compat import registry
        from fsdp2_compat.core import guards

        version = guards.installed_version("transformers")
        if not (version and guards.in_range(version, KEEPS_FP32)):
            return []
        if stack.families is not None and FAMILY not in stack.families:
            return []
        return [Case("torch", guards.installed_version("torch"), FAMILY, registry.for_model_type(FAMILY).name, KIND)]

    def run(self, case, patched, scratch):
        from ..dtype_scenarios import collect
        from ..rank_cases import worst_rank

        per_case, error = collect([dict(family=case.family, wrap="per-layer",
                                         patches=[case.patch] if patched else None)], pg_timeout=20, timeout=200)
        if per_case[0] is None:
            return Result.failed(error or "a rank reported nothing")
        return Result.of(worst_rank(per_case[0]))


SCENARIO = MixedDtypes()
