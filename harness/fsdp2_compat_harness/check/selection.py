"""``check`` rows "selection": each covered family through each installed framework's own wrapping, one rank.

For every installed framework that wraps models itself (``apply_fsdp2``;
AReaL's ``parallelize_model``, LLaMA-Factory's ``FSDP2Engine.prepare_model``)
and every model type whose patch corrects the wrap selection (where the tiny
harness has the family), a tiny model is wrapped through the framework's own
entry point on a one-rank CPU gloo group and trained one step, unpatched and
with the family's patch (``scenarios.train``).  A framework that cannot take
the family's config at all (Step-3.7's under SkyRL) says so in its row.
"""

from .scenario import Case, Scenario, run_here

KIND = "selection"


def selection_cases(families=None):
    """``[(family, patch)]``: model types whose patch corrects the wrap selection, that the tiny harness has."""
    from fsdp2_compat import registry

    from .. import tiny

    return [(mt, name) for mt, name in registry.selection_model_types().items()
            if (families is None or mt in families) and mt in tiny.FAMILIES and tiny.unwrappable(mt) is None]


class Selection(Scenario):
    KINDS = (KIND,)
    ORDER = 10

    def cases(self, stack):
        pairs = selection_cases(stack.families)
        return [Case(fw, version, family, patch, KIND) for fw, version in stack.importable.items()
                for family, patch in pairs]

    def refusal(self, case):
        from .. import scenarios, tiny

        return scenarios.tie_flag_refusal(case.framework, tiny.quiet(tiny.tiny_config, case.family, False))

    def run(self, case, patched, scratch):
        from .. import scenarios

        return run_here(scenarios.train, case.framework, case.family, case.patch if patched else None, steps=1)


SCENARIO = Selection()
