"""``check`` rows "accelerate ..., 2 ranks": accelerate's FSDP2 tail unit (1.14.0-1.15.0).

Where its tail unit exists, accelerate's own FSDP2 preparation
(``accelerate_scenarios.reader_steps``) runs a Liger-style reader of
``lm_head.weight`` inside the forward of an untied Qwen2.5-VL (the head alone
in its unit: a mixed Tensor/DTensor crash unpatched), and a tied text model
(1.14.0 leaves the tied head in the root unit: torch refuses the shared
parameter), each on two gloo ranks with different data.
"""

from .scenario import TWO_RANKS_NOTE, Case, Result, Scenario, quiet

READER = "accelerate lm_head reader, 2 ranks"
TIED = "accelerate tied, 2 ranks"
# (family, tied, kind): each two 2-rank runs.
CASES = (("qwen2_5_vl", False, READER), ("qwen2", True, TIED))
TAIL_UNIT = ">=1.14.0,<=1.15.0"


def accelerate_cases(families=None):
    """``[(family, patch, kind)]`` for accelerate's tail unit, where a patch of the family carries its targets."""
    from fsdp2_compat import registry

    from .. import tiny

    out = []
    for mt, _, kind in CASES:
        p = registry.for_model_type(mt)
        if (families is None or mt in families) and p is not None and any(t.dist == "accelerate" for t in p.targets):
            if tiny.unavailable(mt) is None:
                out.append((mt, p.name, kind))
    return out


class Accelerate(Scenario):
    KINDS = (READER, TIED)
    ORDER = 40
    NOTE = TWO_RANKS_NOTE

    def cases(self, stack):
        from fsdp2_compat.core import guards

        acc = guards.installed_version("accelerate")
        if not (acc and guards.in_range(acc, TAIL_UNIT)):
            return []
        return [Case("accelerate", acc, family, patch, kind) for family, patch, kind in accelerate_cases(stack.families)]

    def run(self, case, patched, scratch):
        from ..accelerate_scenarios import reader_steps
        from ..rank_cases import two_ranks

        tied = {kind: tie for _, tie, kind in CASES}[case.kind]
        return Result.of(two_ranks(quiet, reader_steps, case.family, tied, None if tied else "raw",
                                   case.patch if patched else None))


SCENARIO = Accelerate()
