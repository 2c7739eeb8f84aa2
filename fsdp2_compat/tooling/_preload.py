"""Heavy imports done once in the rank forkserver; failures are ignored here
(the scenario that needs a module will raise its own, readable error)."""

import importlib
import sys

for _name in (
    "torch",
    "torch.distributed.fsdp",
    "transformers",
    "fsdp2_compat.tooling.tiny",
    "fsdp2_compat.tooling.scenarios",
    "verl.utils.fsdp_utils",
    "skyrl_train.distributed.fsdp_utils",
    "areal.engine.fsdp_utils.parallel",  # import areal: ~3.5 s (areal.infra) per rank otherwise
    "llamafactory.v1.plugins.trainer_plugins.distributed.fsdp2",
    "fsdp2_compat.tooling.trl_scenarios",
    "trl.trainer.sft_trainer",
    "trl.trainer.grpo_trainer",
    "trl.trainer.distillation_trainer",
    # The platform-neutral part of verl's training engine (datasets alone is ~1.5 s a process);
    # verl.workers.engine itself resolves verl's platform when imported, so tooling.engines
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
# registers the package itself (tooling.frameworks.ensure_skyrl_backends_package).
if sys.version_info >= (3, 12):
    try:
        importlib.import_module("skyrl.backends.skyrl_train.distributed.fsdp_utils")
    except Exception:
        pass

# What the server imported lives as long as every rank: out of the collector's reach, a rank's collections
# (verl's engine calls gc.collect() itself) walk only what the rank made, and fork's copy-on-write pages stay shared.
import gc  # noqa: E402

gc.freeze()
