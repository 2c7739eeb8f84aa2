"""Rank jobs for tests/integrations/test_lora_vlm.py: the four FSDP2 bug classes with PEFT LoRA adapters attached.

``peft.get_peft_model`` (LoRA r=4, Gaussian ``lora_B``: the adapters train from the first step) freezes every
base parameter, the vision tower's included.  Each job runs the harness's own scenario for its class, with the
tiny model it builds turned into that LoRA model in this rank process (``_lora_builds``): the frameworks' own
wrapping, 2 gloo ranks with different data, the unsharded reference a deep copy of the same LoRA model.
"""

EXPERT_TARGETS = ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj")


def _lora_builds(targets):
    """The harness's builders return the LoRA model (a fresh rank process: nothing to restore)."""
    from fsdp2_compat_harness import lora, moe_scenarios, tiny

    build, moe_build = tiny.build, moe_scenarios.build
    tiny.build = lambda family, *args, **kwargs: lora.lora(build(family, *args, **kwargs), targets)
    moe_scenarios.build = lambda family: lora.lora(moe_build(family), targets)


def selection(rank, world, framework, patches):
    """Class 1: GLM-4.1V's frozen tower still reads its ``position_embedding`` raw (``scenarios.train(lora=True)``)."""
    from fsdp2_compat_harness import scenarios

    return scenarios.train(rank, world, framework, "glm4v", patches, lora=True)


def mixed(rank, world, framework, patches, stderr_dir):
    """Class 3: rank 0 an image, rank 1 text only, 2 steps (rank 1's second text-only micro-batch walks the
    dummy's units, ``fixes.unit_walk``); the tower frozen."""
    from fsdp2_compat.fixes import mixed_media, unit_walk
    from fsdp2_compat_harness import mixed as mixed_scenario

    _lora_builds(("q_proj", "v_proj"))
    result = mixed_scenario.train_mixed(rank, world, framework, "qwen2_5_vl", patches, stderr_dir, steps=2)
    result.update(dummy_forwards=mixed_media.STATS["dummy_forwards"], walks=unit_walk.STATS["walks"])
    return mixed_scenario.gloo_verdict(result, stderr_dir, world)


def moe(rank, world, framework, family, patches, *args, **kwargs):
    """Class 4: ``moe_scenarios.train_moe`` (its arguments) with LoRA on the attention and every expert's
    projections; the ranks' tokens reach different experts (transformers 4.x runs only the experts a token
    reaches).  ``tests/support/moe_jobs.run(..., fn=moe)``."""
    from fsdp2_compat_harness import moe_scenarios

    _lora_builds(EXPERT_TARGETS)
    return moe_scenarios.train_moe(rank, world, framework, family, patches, *args, **kwargs)


def fused(rank, world, family, patches):
    """Class 2: verl's fused forward reads ``lm_head.weight`` raw (``scenarios.train_fused``), with LoRA injected
    in place after verl's monkey patch (verl's own order: ``apply_monkey_patch``, then ``get_peft_model``);
    ``lm_head`` frozen with the rest of the base."""
    import peft
    import torch
    import verl.models.transformers.monkey_patch as monkey_patch

    from fsdp2_compat_harness import lora
    from fsdp2_compat_harness.scenarios import train_fused

    original = monkey_patch.apply_monkey_patch

    def apply_then_lora(model, *args, **kwargs):
        original(model, *args, **kwargs)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            peft.inject_adapter_in_model(lora.config(("q_proj", "v_proj")), model)
        for name, param in model.named_parameters():
            param.requires_grad_("lora_" in name)

    monkey_patch.apply_monkey_patch = apply_then_lora  # train_fused imports it at its call
    result = train_fused(rank, world, family, patches)
    result.pop("kernel_weights", None)
    return result
