"""``check`` rows "fused, Ulysses SP 2": verl 0.6.0-0.7.1's fused forwards under Ulysses SP use the wrong labels.

verl's own ``DataParallelPPOActor`` with ``ulysses_sequence_parallel_size=2`` and fused kernels on 2 gloo ranks
forming one SP group (``fsdp2_compat_harness.ulysses``), unpatched and with the family's patch, against the
unsharded reference.  Unpatched it runs, silently wrong: the row says how many labels the kernel took wrong on
the worse rank and how far the ``lm_head`` gradient is off.  Cases only where the installed verl has the bug
and the proof runs in fp32: the SP caller target knows the actor's code (0.6.0-0.7.1) and the release is
0.7.0-0.7.1 (0.6.x's actor autocasts to bf16 whatever the policy).
"""

from .scenario import Case, Result, Scenario, quiet

KIND = "fused, Ulysses SP 2"
RELEASES = ">=0.7.0,<0.8.0.dev0"


def sp_cases(families=None):
    """``[(family, patch)]`` on the installed verl (empty where it does not have the bug)."""
    from fsdp2_compat import registry
    from fsdp2_compat.cli.doctor import classify
    from fsdp2_compat.core import guards
    from fsdp2_compat.integrations import verl

    from .. import tiny
    from ..ulysses import FORWARD

    version = guards.installed_version("verl")
    if version is None or not guards.in_range(version, RELEASES) or classify(verl.SP_CALLERS[0], version).kind != "fixes":
        return []
    return [(f, registry.for_model_type(f).name) for f in sorted(FORWARD)
            if (families is None or f in families) and tiny.unavailable(f) is None]


def run_case(family, patch):
    """One side on 2 ranks; an unpatched run that is silently wrong is reported as the error it is."""
    from ..ranks import run_ranks
    from ..scenarios import first_line
    from ..ulysses import train_sp

    try:
        results = run_ranks(quiet, 2, train_sp, family, patch, kwargs={"steps": 1}, pg_timeout=60)
    except Exception as exc:  # the scenario itself broke: report, do not die
        return {"error": "%s: %s" % (type(exc).__name__, first_line(exc)), "loss_err": None, "output": ""}
    failed = [r for r in results if r["error"] is not None]
    if failed:
        return failed[0]
    worst = dict(max(results, key=lambda r: (sum(r["labels_wrong"]), r["grad_err"])))
    wrong = sum(worst["labels_wrong"])
    if wrong or worst["grad_err"] >= 1e-5:
        worst["error"] = "runs, wrong labels on an SP rank (%d of %d); lm_head gradient off by %.2g" % (
            wrong, worst["local_len"], worst["lm_head_grad_err"])
    return worst


class SpLabels(Scenario):
    KINDS = (KIND,)
    ORDER = 25  # after the one-rank fused rows
    NOTE = ("note: 'Ulysses SP 2' rows run verl's DataParallelPPOActor on 2 gloo ranks forming one SP group (each a "
            "different shard of one micro-batch; flash-attn's kernels: exact SDPA stand-ins) and compare every "
            "gradient with the unsharded reference.")

    def cases(self, stack):
        from fsdp2_compat.core import guards

        version = guards.installed_version("verl")
        return [Case("verl", version, family, patch, KIND) for family, patch in sp_cases(stack.families)]

    def run(self, case, patched, scratch):
        return Result.of(run_case(case.family, case.patch if patched else None))


SCENARIO = SpLabels()
