"""``check`` rows "fused forward" and "fused, 2 ranks": verl's fused-kernel forwards read ``lm_head.weight``.

For every family whose patch carries a verl fused-forward target (where the
tiny harness has it), verl's own monkey patch installs its fused forward
(``scenarios.train_fused``) and one step runs on one rank, unpatched and
patched.  GLM-4.1V gets verl's own glm4v forward, which the ``glm4v`` patch
also makes run on the transformers verl admits.  One rank cannot show the
gradient-averaging bug (it needs different data on two ranks): a case whose
unpatched run is "ok" while ``lm_head`` has an FSDP unit of its own is run
again on two gloo ranks ("fused, 2 ranks"), where "fixed" means the lm_head
gradient matches the data-parallel average.
"""

from .scenario import TWO_RANKS_NOTE, Case, Result, Scenario, quiet, run_here

KIND = "fused forward"
TWO_RANKS = "fused, 2 ranks"
VERL_FUSED_PREFIX = "verl.models.transformers."


def fused_cases(families=None):
    """``[(family, patch)]``: model types whose patch carries a verl fused-forward target, in the tiny harness."""
    from fsdp2_compat import registry

    from .. import tiny

    out = []
    for p in registry.PATCHES:
        if not any(t.dist == "verl" and t.module.startswith(VERL_FUSED_PREFIX) for t in p.targets):
            continue
        for mt in p.model_types:
            if families is not None and mt not in families:
                continue
            if mt not in tiny.FAMILIES or tiny.unwrappable(mt) is not None:
                continue
            out.append((mt, p.name))
    return out


class Fused(Scenario):
    KINDS = (KIND, TWO_RANKS)
    ORDER = 20  # verl's monkey patch rewrites model classes for the whole process: after every selection case
    NOTE = TWO_RANKS_NOTE

    def cases(self, stack):
        from fsdp2_compat.core import guards

        verl = guards.installed_version("verl")
        if not (verl and guards.in_range(verl, ">=0.6.0")):
            return []
        return [Case("verl", verl, family, patch, KIND) for family, patch in fused_cases(stack.families)]

    def run(self, case, patched, scratch):
        from .. import scenarios
        from ..rank_cases import two_ranks

        patch = case.patch if patched else None
        if case.kind == TWO_RANKS:
            return Result.of(two_ranks(quiet, scenarios.train_fused, case.family, patch))
        return run_here(scenarios.train_fused, case.family, patch, steps=1)

    def follow_up(self, case, unpatched):
        if case.kind == KIND and unpatched.error is None and "lm_head" in unpatched.wrapped:
            # Runs on one rank with lm_head sharded apart: only two ranks can tell.
            return [case._replace(kind=TWO_RANKS)]
        return []

    def notes(self, rows):
        return [self.NOTE] if any(r["kind"] == TWO_RANKS for r in rows) else []


SCENARIO = Fused()
