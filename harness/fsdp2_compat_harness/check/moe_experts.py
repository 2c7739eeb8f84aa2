"""``check`` rows "MoE experts, 2 ranks": the ranks' tokens reach different MoE experts (transformers 4.x).

GLM-4.5V and Qwen3-MoE through the first installed framework's wrapping
(``moe_scenarios.train_moe``), on the transformers releases that skip
unreached experts (4.x): unpatched, gloo aborts on the reduce-scatters of
different sizes (or the experts' gradients mix silently); patched, every
gradient matches the data-parallel average.  On 5.x (3-D experts) the "audit
divergence" rows show that nothing diverges.
"""

from .scenario import Case, Result, Scenario, quiet

KIND = "MoE experts, 2 ranks"
# The family and the most trained text MoE; the tests run every family (tests/integrations/test_moe_experts.py).
FAMILIES = ("glm4v_moe", "qwen3_moe")
PG_TIMEOUT = 20  # seconds: the surviving rank's wait in a collective its peer never joins


def moe_cases(versions, families=None):
    """``[(framework, family, patch)]``: each of ``FAMILIES`` (within ``families``) through the first of
    ``versions`` (installed wrapping frameworks) that wraps it, with the catalogue's patch for it, where the
    installed transformers keeps that family's experts in the loop that skips them (the code of a MoE
    target: 4.x)."""
    from fsdp2_compat import registry
    from fsdp2_compat.cli.doctor import classify
    from fsdp2_compat.core import guards
    from fsdp2_compat.integrations import transformers_moe

    from .. import tiny

    framework = next((fw for fw in ("verl", "skyrl", "skyrl-train", "areal", "llamafactory") if fw in versions), None)
    version = guards.installed_version("transformers")
    out = []
    for family in FAMILIES:
        p = registry.for_model_type(family)
        if framework is None or (families is not None and family not in families) or p is None:
            continue
        target = next(t for t in transformers_moe.TARGETS if t.module.endswith("modeling_" + family))
        if classify(target, version).kind == "fixes" and tiny.unavailable(family) is None:
            out.append((framework, family, p.name))
    return out


def train(rank, world, stderr_dir, *args, **kwargs):
    """``moe_scenarios.train_moe`` with its ranks' stderr (gloo's abort, the experts reached) to ``stderr_dir``."""
    from ..moe_scenarios import train_moe

    return train_moe(rank, world, *args, stderr_dir=stderr_dir, **kwargs)


def run_case(framework, family, patch, unpatched=False):
    """One side on 2 ranks: ``patch``, or (``unpatched``) that patch without its MoE targets, so the row shows
    this bug and not another the patch fixes (GLM-4.5V's wrap selection).  gloo's abort is read from the ranks'
    stderr (``fsdp2_compat_harness.mixed``); a run where the ranks reached the same experts says so."""
    import tempfile

    from fsdp2_compat.integrations import transformers_moe

    from ..mixed import gloo_error
    from ..moe_scenarios import differing_experts, read_hits
    from ..rank_cases import two_ranks

    patches = [patch] + (["-" + t.key for t in transformers_moe.TARGETS] if unpatched else [])
    with tempfile.TemporaryDirectory(prefix="fsdp2_compat_moe_") as tmp:
        result = two_ranks(quiet, train, tmp, framework, family, patches, None, 1, retries=0, pg_timeout=PG_TIMEOUT,
                           timeout=PG_TIMEOUT + 120)
        gloo = gloo_error(tmp, 2)
        differ = differing_experts(read_hits(tmp, 2))
    if result.get("error") is not None and gloo is not None:
        result["error"] = "gloo: " + gloo.split("] ", 1)[-1]
    if not differ:
        result["error"] = result.get("error") or "the ranks' tokens reached the same experts: nothing shown"
    return result


class MoeExperts(Scenario):
    KINDS = (KIND,)
    ORDER = 70

    def cases(self, stack):
        versions = stack.importable
        return [Case(fw, versions[fw], family, patch, KIND) for fw, family, patch in moe_cases(versions, stack.families)]

    def run(self, case, patched, scratch):
        return Result.of(run_case(case.framework, case.family, case.patch, unpatched=not patched))


SCENARIO = MoeExperts()
