"""``check`` rows "mixed ranks, 2 ranks": rank 0 trains on an image, rank 1 on text only.

Qwen2.5-VL through each installed framework's own wrapping
(``fsdp2_compat_harness.mixed.train_mixed``), and through a trainer's own
forwards that replace transformers' (lmms-engine's ``use_rmpad``: "mixed
ranks, its own forward").  Unpatched, gloo aborts on the mismatched
collectives (the row shows its message, read from the ranks' stderr);
patched, every gradient matches the data-parallel average.
"""

from .scenario import Case, Result, Scenario, quiet

KIND = "mixed ranks, 2 ranks"
OWN_KIND = "mixed ranks, its own forward, 2 ranks"
FAMILY = "qwen2_5_vl"  # the family; the tests run more (tests/integrations/test_mixed_ranks.py)


def mixed_cases(frameworks, families=None):
    """``[(framework, family, patch)]``: ``FAMILY`` through each of ``frameworks``."""
    from fsdp2_compat import registry

    from .. import tiny

    p = registry.for_model_type(FAMILY)
    if (families is not None and FAMILY not in families) or tiny.unwrappable(FAMILY) is not None:
        return []
    if p is None or not any(t in registry.MIXED_MEDIA for t in p.targets):
        return []
    return [(framework, FAMILY, p.name) for framework in frameworks]


def own_forward_cases(frameworks, families=None):
    """``[(framework, family, patch)]``: ``mixed.OWN_FORWARDS`` of the installed ``frameworks`` that can run here."""
    from fsdp2_compat import registry

    from ..engines import lmms_forwards
    from ..mixed import OWN_FORWARDS

    out = []
    for framework, family in OWN_FORWARDS.items():
        p = registry.for_model_type(family)
        if framework in frameworks and (families is None or family in families) and p is not None \
                and lmms_forwards.unavailable() is None:
            out.append((framework, family, p.name))
    return out


def run_case(framework, family, patch, own_forwards=False):
    """One side on 2 ranks (``rank_cases.two_ranks``); unpatched, gloo's abort is read from the ranks' stderr."""
    import tempfile

    from ..mixed import PG_TIMEOUT, gloo_verdict, train_mixed
    from ..rank_cases import two_ranks

    with tempfile.TemporaryDirectory(prefix="fsdp2_compat_mixed_") as tmp:
        result = two_ranks(quiet, train_mixed, framework, family, patch, tmp, own_forwards, retries=0,
                           pg_timeout=PG_TIMEOUT, timeout=PG_TIMEOUT + 120)
        return gloo_verdict(result, tmp)


class MixedRanks(Scenario):
    KINDS = (KIND, OWN_KIND)
    ORDER = 60

    def cases(self, stack):
        versions = stack.importable
        return ([Case(fw, versions[fw], family, patch, KIND)
                 for fw, family, patch in mixed_cases(versions, stack.families)]
                + [Case(fw, versions[fw], family, patch, OWN_KIND)
                   for fw, family, patch in own_forward_cases(versions, stack.families)])

    def run(self, case, patched, scratch):
        return Result.of(run_case(case.framework, case.family, case.patch if patched else None,
                                  case.kind == OWN_KIND))


SCENARIO = MixedRanks()
