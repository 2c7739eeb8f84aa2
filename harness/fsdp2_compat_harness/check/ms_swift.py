"""``check`` rows "ms-swift Qwen3-VL forward, 2 ranks" and "ms-swift GRPO Liger, 2 ranks": ms-swift's own code.

Where ms-swift is installed with the code its proven paths record
(``integrations.ms_swift.PATHS``, ``core.covered``), its own loader's Qwen3-VL
forward runs a text-only rank against an image rank (unpatched: gloo's abort)
and GRPO's Liger loss reads a VLM's head (unpatched: ``aten.mm`` mixed
Tensor/DTensor), on accelerate's FSDP2 (``fsdp2_compat_harness.engines.ms_swift``).  One step of each,
unpatched then with the family's patch, where ms-swift (and for GRPO its trl and liger-kernel) is importable
and the installed code of the row's path is the proven code (``unavailable``).  A gloo abort (the text-only
rank skipping the tower's collectives) shows as gloo's message, read from the ranks' stderr.
"""

from .scenario import OwnPaths, quiet

FORWARD_KIND = "ms-swift Qwen3-VL forward, 2 ranks"
GRPO_KIND = "ms-swift GRPO Liger, 2 ranks"
# kind -> (family, the integrations.ms_swift.PATHS attribute its case runs, the modules it imports besides swift)
KINDS = {FORWARD_KIND: ("qwen3_vl", "_compat_qwen3_vl_mixed_data", ()),
         GRPO_KIND: ("qwen2_5_vl", "GRPOTrainer.compute_liger_loss", ("trl", "liger_kernel"))}
ACCELERATE_TAIL = ">=1.14.0,<=1.15.0"  # accelerate's lm_head tail unit, where GRPO's head read breaks (proven)
NOTE = ("note: 'ms-swift ...' rows train through ms-swift's own code on accelerate's FSDP2 (its loader's Qwen3-VL "
        "forward with a text-only rank; GRPO's Liger loss) on 2 gloo ranks with different data and compare every "
        "gradient with the data-parallel reference.")


def _carries_fix(kind, patch):
    """Whether ``patch`` carries the targets that fix ``kind``'s path (``integrations.ms_swift``)."""
    from fsdp2_compat import registry

    if kind == FORWARD_KIND:
        return any(t in registry.MIXED_MEDIA for t in patch.targets)
    return any(t.dist == "accelerate" for t in patch.targets)


def unavailable(kind):
    """Why the check's ``kind`` row cannot run here (ms-swift or a module the case imports missing, the path's
    installed code not the code proven, accelerate without the tail unit), or None."""
    import importlib.util

    from fsdp2_compat.core import covered, guards
    from fsdp2_compat.integrations import ms_swift as integration

    _, attr, modules = KINDS[kind]
    version = guards.installed_version("ms-swift")
    if version is None:
        return "ms-swift is not installed"
    missing = [m for m in ("swift", "accelerate") + modules if importlib.util.find_spec(m) is None]
    if missing:
        return "needs %s" % ", ".join(missing)
    [path] = [p for p in integration.PATHS if p.attr == attr]
    outcome, detail = covered.verdict("ms-swift", path)
    if outcome != "proven":
        return "ms-swift %s: %s.%s is %s (%s)" % (version, path.module, attr, outcome, detail)
    accelerate = guards.installed_version("accelerate")
    if kind == GRPO_KIND and not guards.in_range(accelerate, ACCELERATE_TAIL):
        return "accelerate %s: no lm_head tail unit (%s)" % (accelerate, ACCELERATE_TAIL)
    return None


def cases(families=None):
    """``[(kind, family, patch)]``: the check's ms-swift rows that run here, each with its family's patch where
    that patch carries the fix of the row's path."""
    from fsdp2_compat import registry

    from .. import tiny

    out = []
    for kind, (family, _, _) in KINDS.items():
        patch = registry.for_model_type(family)
        if (families is None or family in families) and patch is not None and _carries_fix(kind, patch) \
                and unavailable(kind) is None and tiny.unavailable(family) is None:
            out.append((kind, family, patch.name))
    return out


def check_steps(rank, world, kind, family, patches, directory, steps=1):
    """The check's ``kind`` case in a rank process: its fds 1 and 2 to ``directory``/rank<N>.err (gloo's abort
    message), its Python-level prints captured into ``result["output"]``."""
    import os

    from ..engines.ms_swift import grpo_liger, swift_case
    from ..mixed import stderr_to_file

    stderr_to_file(directory, rank)
    if kind == FORWARD_KIND:
        return swift_case(rank, world, os.path.join(directory, "model"), family, patches, steps=steps)
    return grpo_liger(rank, world, family, patches, steps=steps)


def run_case(kind, family, patch):
    """One check row's side on 2 ranks (``rank_cases.two_ranks``); a gloo abort is read from the ranks' stderr."""
    import tempfile

    from ..mixed import PG_TIMEOUT, gloo_verdict
    from ..rank_cases import two_ranks

    with tempfile.TemporaryDirectory(prefix="fsdp2_compat_swift_") as tmp:  # the checkpoint, the ranks' stderr
        result = two_ranks(quiet, check_steps, kind, family, patch, tmp, retries=0, pg_timeout=PG_TIMEOUT,
                           timeout=PG_TIMEOUT + 240)
        return gloo_verdict(result, tmp)


SCENARIO = OwnPaths("ms-swift", KINDS, 90, NOTE, cases, run_case)
