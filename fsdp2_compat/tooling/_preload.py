"""Heavy imports done once in the rank forkserver; failures are ignored here
(the scenario that needs a module will raise its own, readable error)."""

import importlib

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
):
    try:
        importlib.import_module(_name)
    except Exception:
        pass
