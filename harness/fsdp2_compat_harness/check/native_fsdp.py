"""``check`` rows "native FSDP2 ..., 2 ranks": transformers' own FSDP2 (``from_pretrained(..., distributed_config)``).

Only where the installed transformers shards natively (5.15.0+): a tiny checkpoint loaded with
``DistributedConfig(fsdp_size=2)`` on two gloo ranks with different data (``native_scenarios``), against the
unsharded data-parallel reference:

- "native FSDP2 lm_head reader": Phi (its final norm is not called ``norm``: the head is a unit alone) with a
  Liger-style reader of ``lm_head.weight`` inside the forward; unpatched the mixed Tensor/DTensor crash, patched
  (``textlm``) the head shares its final norm's unit;
- "native FSDP2 mixed ranks": Qwen2.5-VL, rank 0 an image, rank 1 text only (the tower in the root unit);
  unpatched gloo aborts (its message, read from the ranks' stderr), patched (``qwen2vl``) exact.
"""

from .scenario import TWO_RANKS_NOTE, Case, Result, Scenario

READER = "native FSDP2 lm_head reader, 2 ranks"
MIXED = "native FSDP2 mixed ranks, 2 ranks"
NATIVE = ">=5.15.0"
# kind -> (family shown, the catalogue model type whose patch fixes it, the native_scenarios case)
CASES = {READER: ("phi", "qwen2", dict(family="phi", read="raw", kinds=(("image", "image"),))),
         MIXED: ("qwen2_5_vl", "qwen2_5_vl", dict(family="qwen2_5_vl", kinds=(("image", "text"),)))}


def summary(per_case, gloo, error):
    """One side's result dict from ``native_scenarios.collect`` of one case (``rank_cases.worst_rank``)."""
    from ..rank_cases import worst_rank

    if per_case[0] is None:
        return {"error": "gloo: " + gloo.split("] ", 1)[-1] if gloo else (error or "a rank reported nothing"),
                "loss_err": None}
    return worst_rank(per_case[0])


class NativeFsdp(Scenario):
    KINDS = (READER, MIXED)
    ORDER = 45
    NOTE = TWO_RANKS_NOTE

    def cases(self, stack):
        from fsdp2_compat import registry
        from fsdp2_compat.core import guards

        version = guards.installed_version("transformers")
        if not (version and guards.in_range(version, NATIVE)):
            return []
        out = []
        for kind, (family, model_type, _) in CASES.items():
            p = registry.for_model_type(model_type)
            if stack.families is None or family in stack.families or model_type in stack.families:
                out.append(Case("transformers", version, family, p.name, kind))
        return out

    def run(self, case, patched, scratch):
        from ..native_scenarios import collect

        spec = dict(CASES[case.kind][2], patches=case.patch if patched else None)
        return Result.of(summary(*collect([spec], pg_timeout=20, timeout=200)))


SCENARIO = NativeFsdp()
