"""``check`` rows "verl engine" / "skyrl strategy": GLM-4.1V through the frameworks' own training engines.

The whole path users run: GLM-4.1V through each installed training engine that
runs on CPU here (verl's FSDP engine, SkyRL's FSDPStrategy; see
``fsdp2_compat_harness.engines``), on two gloo ranks with different data,
unpatched and patched; "fixed" means every loss, gradient and parameter
matches the data-parallel reference (within 1e-5, or bf16 tolerance where the
engine computes in bf16 whatever the policy: verl 0.7.0).
"""

from .scenario import TOL, Case, Result, Scenario, quiet

# kind -> (framework, harness module in fsdp2_compat_harness.engines, its rank function)
ENGINES = {
    "verl engine": ("verl", "verl_engine", "train_verl_engine"),
    "skyrl strategy": ("skyrl", "skyrl_strategy", "train_skyrl_strategy"),
}
FAMILY = "glm4v"


def _harness(name):
    import importlib

    return importlib.import_module("fsdp2_compat_harness.engines." + name)


def engine_cases(families=None):
    """``[(framework, version, family, patch, kind)]``: GLM-4.1V once per training engine runnable here."""
    from fsdp2_compat import registry
    from fsdp2_compat.core import guards

    from .. import tiny

    if families is not None and FAMILY not in families or tiny.unwrappable(FAMILY) is not None:
        return []
    patch = registry.for_model_type(FAMILY).name
    return [(dist, guards.installed_version(dist), FAMILY, patch, kind)
            for kind, (dist, harness, _) in ENGINES.items() if _harness(harness).unrunnable() is None]


class Engines(Scenario):
    KINDS = tuple(ENGINES)
    ORDER = 50
    NOTE = ("note: 'verl engine' / 'skyrl strategy' rows train through the framework's own training engine "
            "(2 gloo ranks, different data; CPU stand-ins only for CUDA-only code) and compare every loss, "
            "gradient and parameter with the data-parallel reference.")
    BF16_NOTE = ("note: a row whose engine computes in bf16 whatever the policy (verl 0.7.0 autocasts its "
                 "forward to bf16) is held to bf16's bound, 1e-2, instead of 1e-5.")

    def cases(self, stack):
        return [Case(*c) for c in engine_cases(stack.families)]

    def run(self, case, patched, scratch):
        """One engine side on 2 gloo ranks: the merged result, a wrong-but-running patched run reported as an
        error."""
        from ..engines import common
        from ..ranks import run_ranks
        from ..scenarios import first_line

        framework, harness, fn = ENGINES[case.kind]
        try:
            path = common.model_dir(case.family, scratch, tokenizer=framework == "verl")
            results = run_ranks(quiet, 2, getattr(_harness(harness), fn), case.family, path,
                                case.patch if patched else None, timeout=600)
        except Exception as exc:  # the scenario itself broke: report, do not die
            return Result.failed("%s: %s" % (type(exc).__name__, first_line(exc)))
        merged = common.merge(results)
        merged["output"] = results[0].get("output", "")
        merged["tol"] = common.tolerance(merged)  # bf16 where the engine computes in bf16 whatever the policy
        worst = max([v for k, v in merged.items() if k.endswith("grad_err") or k.startswith("param_err")] or [0.0])
        if merged["error"] is None and worst >= merged["tol"]:
            merged["error"] = "runs, but gradients or parameters miss the data-parallel average by %.2g" % worst
        return Result.of(merged)

    def notes(self, rows):
        mine = [r for r in rows if r["kind"] in self.KINDS]
        if not mine:
            return []
        return [self.NOTE] + ([self.BF16_NOTE] if any(r.get("tol", TOL) > TOL for r in mine) else [])


SCENARIO = Engines()
