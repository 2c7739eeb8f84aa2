"""PEFT LoRA on the harness's tiny models, and the run that shows pytorch #186998 (a unit first run frozen).

``lora(model, targets)``: ``peft.get_peft_model`` with LoRA r=4 and a Gaussian ``lora_B`` (the adapters train from
the first step); every base parameter, the vision tower's included, is frozen.  ``unfreeze``: a LoRA warm-up step
with the tower frozen, then the tower unfrozen (staged training), bf16 parameters / fp32 reduce, against the
unsharded fp32 model's gradients of the data-parallel average (``check`` row "LoRA tower unfrozen, 2 ranks";
``tests/integrations/test_lora_vlm.py``).
"""


def config(targets):
    """The one LoRA configuration of the harness: r=4 on ``targets``, a Gaussian ``lora_B``."""
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights="gaussian")


def lora(model, targets):
    """``peft.get_peft_model(model, config(targets))``, its adapters drawn from seed 0 (every base parameter frozen)."""
    import peft
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return peft.get_peft_model(model, config(targets))


def unfreeze(rank, world, framework, patches, family="qwen2_5_vl", steps=None):
    """One rank: step 0 trains the adapters with the tower frozen (its units' first forward frozen), step 1 with
    the tower unfrozen; no optimizer step (the parameters stay step 0's).  Returns ``error`` (step 1's on torch
    2.8-2.13 unpatched), the vision gradients' dtypes and ``vision_rel_to_max``: their worst error relative to the
    largest, against the unsharded fp32 model's gradients of the mean of every rank's step-1 loss (FSDP2's
    average).  ``steps`` is ignored (``rank_cases.two_ranks`` passes it)."""
    import copy

    import fsdp2_compat

    from . import moe_scenarios, tiny
    from .scenarios import first_line

    if patches:
        fsdp2_compat.apply(patches)
    model = lora(tiny.build(family), ("q_proj", "v_proj"))
    reference = copy.deepcopy(model)
    moe_scenarios.shard(framework, model, world, "bf16")
    out = {"error": None, "vision_grad_dtypes": [], "vision_rel_to_max": None, "loss_err": None, "tol": 6e-2}
    for step in range(2):
        if step == 1:
            for name, param in model.named_parameters():
                param.requires_grad_(param.requires_grad or ".visual." in name)
        try:
            model(**tiny.make_batch(family, model, seed=1 + step * world + rank)).loss.backward()
        except Exception as exc:  # noqa: BLE001 - the upstream error, reported
            out["error"] = "step %d: %s: %s" % (step, type(exc).__name__, first_line(exc))
            return out
    for name, param in reference.named_parameters():
        param.requires_grad_(".visual." in name)
    for r in range(world):  # FSDP2 averages the ranks' gradients: the reference's is the mean of theirs
        (reference(**tiny.make_batch(family, reference, seed=1 + world + r)).loss / world).backward()
    want = {n: p.grad for n, p in reference.named_parameters() if ".visual." in n}
    got = {n: p.grad for n, p in model.named_parameters() if ".visual." in n and p.grad is not None}
    out["vision_grad_dtypes"] = sorted({str(g.dtype) for g in got.values()})
    if not got or set(got) != set(want):
        out["error"] = "the unfrozen tower's gradients: %d of %d parameters" % (len(got), len(want))
        return out
    worst = max(want[n].abs().max().item() for n in want)
    out["vision_rel_to_max"] = max((got[n].full_tensor().float() - want[n]).abs().max().item() for n in got) / worst
    out["loss_err"] = out["vision_rel_to_max"]  # what check's row compares with ``tol`` (bf16 compute)
    return out
