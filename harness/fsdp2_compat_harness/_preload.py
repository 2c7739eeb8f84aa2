"""Heavy imports done once in the rank forkserver; failures are ignored here
(the scenario that needs a module will raise its own, readable error)."""

import importlib
import importlib.util
import sys

for _name in (
    "torch",
    "torch.distributed.fsdp",
    "transformers",
    "fsdp2_compat_harness.tiny",
    "fsdp2_compat_harness.scenarios",
    "verl.utils.fsdp_utils",
    "skyrl_train.distributed.fsdp_utils",
    "areal.engine.fsdp_utils.parallel",  # import areal: ~3.5 s (areal.infra) per rank otherwise
    "llamafactory.v1.plugins.trainer_plugins.distributed.fsdp2",
    "fsdp2_compat_harness.trl_scenarios",
    "trl.trainer.sft_trainer",
    "trl.trainer.grpo_trainer",
    "trl.trainer.distillation_trainer",
    # The platform-neutral part of verl's training engine (datasets alone is ~1.5 s a process);
    # verl.workers.engine itself resolves verl's platform when imported, so fsdp2_compat_harness.engines
    # imports it in the rank, after selecting the CPU platform.
    "datasets",
    "verl.utils.dataset.dataset_utils",
    "verl.workers.config",
    "verl.workers.utils.losses",
):
    try:
        importlib.import_module(_name)
    except Exception:
        pass

# skyrl 0.2.0+ (set skyrl040: ~2.6 s a rank otherwise).  Only on Python 3.12+, where it is a plain
# import: below, a failed attempt would leave half-imported skyrl modules behind for every rank, which
# registers the package itself (fsdp2_compat_harness.frameworks.ensure_skyrl_backends_package).
if sys.version_info >= (3, 12):
    try:
        importlib.import_module("skyrl.backends.skyrl_train.distributed.fsdp_utils")
    except Exception:
        pass

# What apply() imports in every rank: the fixes its seams are built from.
for _name in ("accumulation", "gather", "glm4v_forward", "inline_selection", "media_merge", "media_towers",
              "mixed_media", "selection", "tail_unit"):
    try:
        importlib.import_module("fsdp2_compat.fixes." + _name)
    except Exception:
        pass
# verl's training engine imports torch's distributed checkpointing (platform-neutral; the engine is not: see below).
if importlib.util.find_spec("verl") is not None:
    for _name in ("torch.distributed.checkpoint", "torch.distributed.elastic.agent.server.local_elastic_agent"):
        try:
            importlib.import_module(_name)
        except Exception:
            pass

# What every rank imports again otherwise: the tiny families' model classes (transformers imports each modeling
# module on first use), verl's fused forwards (its monkey patch imports them per model), packaging's version
# ranges (guards).  A patch still applies to them: the engine patches a module that is already imported.
for _name in ("packaging.version", "packaging.specifiers", "wrapt", "fsdp2_compat.core.policy", "fsdp2_compat.core.aliases",
              "fsdp2_compat_harness.subset", "fsdp2_compat_harness.engines.common", "verl.models.transformers.monkey_patch",
              "verl.models.transformers.dense_common", "verl.models.transformers.qwen2_vl",
              "verl.models.transformers.qwen3_vl", "verl.models.transformers.glm4v", "verl.models.transformers.llama",
              "verl.models.transformers.qwen2", "verl.models.transformers.qwen3_5"):
    try:
        importlib.import_module(_name)
    except Exception:
        pass
# verl < 0.9 names its device itself (cpu on this host): its training engine can be imported here.  verl >= 0.9
# resolves a platform at that import, which fsdp2_compat_harness.engines selects in the rank first (engines/cpu.py).
try:
    from fsdp2_compat_harness.engines.cpu import has_platform_registry as _has_platform_registry

    if importlib.util.find_spec("verl") is not None and not _has_platform_registry():
        importlib.import_module("verl.workers.engine.fsdp.transformer_impl")
except Exception:
    pass
try:
    import transformers as _transformers

    from fsdp2_compat_harness.tiny.configs import CLASSES as _CLASSES

    for _classes in _CLASSES.values():
        for _cls in _classes:
            try:
                getattr(_transformers, _cls)
            except Exception:
                pass
except Exception:
    pass

# verl's engine picks its auto class by looking the config up in transformers' image-text-to-text mapping
# (verl.utils.model.get_hf_auto_model_class), which imports the configuration module of every model type there:
# ~1 s a rank otherwise.
if importlib.util.find_spec("verl") is not None:
    try:
        import transformers as _transformers

        _transformers.AutoModelForImageTextToText._model_mapping.keys()
    except Exception:
        pass

# What apply() reads in every rank: the installed release of each target's distribution and the fingerprint
# of each loaded target's code (core.guards memoizes both; a forked rank inherits the memo).
try:
    from fsdp2_compat import registry as _registry
    from fsdp2_compat.core import calls as _calls, guards as _guards

    for _target in _registry.targets():
        _module = sys.modules.get(_target.module)
        if _guards.installed_version(_target.dist) is None or _module is None:
            continue
        try:
            _guards.fingerprint(_calls.lookup(_module, _target.attr))
        except Exception:  # absent, unreadable: the rank's apply() says so itself
            pass
except Exception:
    pass

# What the server imported lives as long as every rank: out of the collector's reach, a rank's collections
# (verl's engine calls gc.collect() itself) walk only what the rank made, and fork's copy-on-write pages stay shared.
import gc  # noqa: E402

gc.freeze()
