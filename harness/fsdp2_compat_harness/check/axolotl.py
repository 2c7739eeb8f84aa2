"""``check`` rows "axolotl DoRA kernels, 2 ranks" and "axolotl KD trainer, 2 ranks": axolotl's own FSDP2 path.

Where axolotl is installed at a release its targets cover, its own FSDP2
preparation runs its LoRA kernels on a DoRA model (unpatched: the magnitude
gradients off the data-parallel average, silently) and its KD trainer's
``compute_loss`` (unpatched: the resharded head read crashes) on a tiny Qwen2,
two gloo ranks with different data (``fsdp2_compat_harness.engines.axolotl``).
"""

from .scenario import OwnPaths, quiet

FAMILY = "qwen2"  # the tiny text model the tests train
DORA_KIND = "axolotl DoRA kernels, 2 ranks"
KD_KIND = "axolotl KD trainer, 2 ranks"
_IMPORTS = ("axolotl", "accelerate", "peft", "bitsandbytes", "triton")  # kernels.lora, monkeypatch.lora_kernels
# kind -> (the name of the fsdp2_compat.integrations.axolotl target it proves, the modules its case imports)
KINDS = {DORA_KIND: ("LORA_MAGNITUDE", _IMPORTS),
         KD_KIND: ("KD_LM_HEAD", _IMPORTS + ("trl", "liger_kernel", "datasets", "numba"))}  # core.trainers.base
NOTE = ("note: 'axolotl ...' rows train through axolotl's own FSDP2 preparation (its LoRA kernels on a DoRA model; "
        "its KD trainer's compute_loss) on 2 gloo ranks with different data and compare every gradient with the "
        "data-parallel reference.")


def unavailable(kind):
    """Why the check's ``kind`` row cannot run here (axolotl absent, a release its target's fingerprints do not
    cover, a module the case imports missing), or None."""
    import importlib.util

    from packaging.version import Version

    from fsdp2_compat.core import guards
    from fsdp2_compat.integrations import axolotl as integration

    target_name, modules = KINDS[kind]
    version = guards.installed_version("axolotl")
    if version is None:
        return "axolotl is not installed"
    if not any(first <= Version(version) <= last for first, last in guards.release_spans(getattr(integration,
                                                                                                 target_name))):
        return "axolotl %s: a release %s's fingerprints do not cover" % (version, target_name)
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return "needs %s" % ", ".join(missing) if missing else None


def cases(families=None):
    """``[(kind, family, patch)]``: the check's axolotl rows that run here, each with the patch of ``FAMILY``
    where that patch carries the row's target."""
    from fsdp2_compat import registry
    from fsdp2_compat.integrations import axolotl as integration

    patch = registry.for_model_type(FAMILY)
    if (families is not None and FAMILY not in families) or patch is None:
        return []
    keys = {t.key for t in patch.targets}
    return [(kind, FAMILY, patch.name) for kind, (target_name, _) in KINDS.items()
            if getattr(integration, target_name).key in keys and unavailable(kind) is None]


def check_steps(rank, world, kind, family, patches, steps=1):
    """The check's ``kind`` case in a rank process (the KD trainer on accelerate's default resharding)."""
    from ..engines.axolotl import dora_steps, kd_steps

    if kind == KD_KIND:
        return kd_steps(rank, world, family, "reshard", patches, steps=steps)
    return dora_steps(rank, world, family, patches, steps=steps)


def run_case(kind, family, patch):
    """One check row's side on 2 ranks: the first rank's error, or the worst gradient's verdict (``two_ranks``)."""
    from ..rank_cases import two_ranks

    return two_ranks(quiet, check_steps, kind, family, patch, timeout=300, pg_timeout=60)


SCENARIO = OwnPaths("axolotl", KINDS, 80, NOTE, cases, run_case)
