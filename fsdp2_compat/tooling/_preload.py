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
    "fsdp2_compat.tooling.trl_scenarios",
    "trl.trainer.sft_trainer",
    "trl.trainer.grpo_trainer",
    "trl.trainer.distillation_trainer",
):
    try:
        importlib.import_module(_name)
    except Exception:
        pass
