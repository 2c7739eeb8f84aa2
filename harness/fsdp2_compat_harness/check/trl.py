"""``check`` rows "TRL SFT, 2 ranks": TRL's fused LM head reads ``lm_head.weight`` outside its unit's forward.

Where TRL >= 1.16.0 is installed (1.15.0's fused head needs Triton: it cannot
run on CPU), its SFT loss (``SFTTrainer.compute_loss`` through the fused LM
head) runs on a model prepared by accelerate's own FSDP2 preparation, on two
gloo ranks with different data (``trl_scenarios.train_trl``), for ``FAMILIES``:
unpatched the ``lm_head`` gradient misses the data-parallel average, patched
it matches.
"""

from .scenario import TWO_RANKS_NOTE, Case, Result, Scenario, quiet

KIND = "TRL SFT, 2 ranks"
# TRL's check runs on these families only (each costs two 2-rank runs); the tests cover more.
FAMILIES = ("qwen3_vl", "qwen2_5_vl")


def trl_cases(families=None):
    """``[(family, patch)]`` for TRL: ``FAMILIES`` whose patch carries a TRL target (and in ``families``)."""
    from fsdp2_compat import registry

    from .. import tiny

    out = []
    for mt in FAMILIES:
        p = registry.for_model_type(mt)
        if (families is None or mt in families) and p is not None and any(t.dist == "trl" for t in p.targets):
            if tiny.unavailable(mt) is None:
                out.append((mt, p.name))
    return out


class Trl(Scenario):
    KINDS = (KIND,)
    ORDER = 30
    NOTE = TWO_RANKS_NOTE

    def cases(self, stack):
        from fsdp2_compat.core import guards

        trl = guards.installed_version("trl")
        if not (trl and guards.in_range(trl, ">=1.16.0")):
            return []
        return [Case("trl", trl, family, patch, KIND) for family, patch in trl_cases(stack.families)]

    def run(self, case, patched, scratch):
        from ..rank_cases import two_ranks
        from ..trl_scenarios import train_trl

        return Result.of(two_ranks(quiet, train_trl, case.family, "sft", case.patch if patched else None))


SCENARIO = Trl()
