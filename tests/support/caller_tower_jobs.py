"""Rank functions for ``tests/integrations/test_caller_ran_tower.py``: a caller that runs the tower itself.

``swift_inputs_embeds`` restates ms-swift 4.6.0's ``Template._get_inputs_embeds_hf``
(``swift/template/base.py``, used by its Qwen2-VL / Qwen2.5-VL templates' ``_post_encode``) on a tiny model:
the token embedding, then the vision tower on the micro-batch's images, or, for a text-only one, on a dummy
image whose features join ``0 *`` their mean; the model is then called with ``inputs_embeds`` only.  ms-swift's
image processor (a 32x32 black image) is replaced by a zero patch grid of the tiny tower's size; nothing of
fsdp2-compat or of the code it patches is replaced.
"""


def swift_inputs_embeds(model, batch):
    """ms-swift's ``_post_encode`` for Qwen2-VL / Qwen2.5-VL: ``{"inputs_embeds", ...}`` without media."""
    import torch

    inner = model.model
    input_ids = batch["input_ids"]
    inputs_embeds = inner.get_input_embeddings()(input_ids)
    visual = inner.visual
    pixel_values = batch.get("pixel_values")
    if pixel_values is None:  # plain text: a dummy image, 0 * its features' mean
        cfg = visual.config
        m = getattr(cfg, "spatial_merge_size", 2)
        grid = torch.tensor([[1, m, m]], device=input_ids.device)
        width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        dummy = torch.zeros(m * m, width, dtype=visual.dtype, device=input_ids.device)
        embeds = visual(dummy, grid_thw=grid)
        embeds = getattr(embeds, "pooler_output", embeds)
        inputs_embeds = inputs_embeds + embeds.mean().to(inputs_embeds.device) * 0.0
    else:
        embeds = visual(pixel_values.type(visual.dtype), grid_thw=batch["image_grid_thw"])
        embeds = getattr(embeds, "pooler_output", embeds)
        mask = (input_ids == model.config.image_token_id).unsqueeze(-1).expand_as(inputs_embeds)
        inputs_embeds = inputs_embeds.masked_scatter(mask, embeds.to(inputs_embeds.dtype))
    out = {k: v for k, v in batch.items() if k not in ("input_ids", "pixel_values", "image_grid_thw")}
    out["inputs_embeds"] = inputs_embeds
    return out


def caller_ran_tower(rank, world, directory, family, patches, steps=3):
    """2+ ranks, per-layer-class ``fully_shard`` (accelerate's TRANSFORMER_BASED_WRAP units, as ms-swift's
    ``--fsdp fsdp2`` gets them): step s gives rank (s % world) an image, the others text only; every rank's
    micro-batch goes through ``swift_inputs_embeds``.  Returns the DP-reference result plus ``tower_calls``:
    this rank's tower calls (outside backward) per micro-batch."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fsdp2_compat
    from fsdp2_compat.fixes import mixed_media
    from fsdp2_compat_harness import tiny
    from fsdp2_compat_harness.mixed import stderr_to_file
    from fsdp2_compat_harness.scenarios import train_against_reference
    from fsdp2_compat_harness.tiny.text import count_forwards, counted_loss, one_rank_with_media

    stderr_to_file(directory, rank)
    if patches:
        fsdp2_compat.apply(patches)
    model = tiny.build(family, tie=False, seed=0)
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    layers = set(model._no_split_modules)
    for module in list(model.modules()):
        if type(module).__name__ in layers:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    calls = count_forwards(model.model.visual)
    result = {"error": None, "losses": [], "loss_err": 0.0, "grad_err": 0.0, "worst_grad": None, "param_err": 0.0,
              "grads_checked": 0, "tower_calls": calls}
    before = dict(mixed_media.STATS)

    def batches_for(step):
        return one_rank_with_media(lambda seed: tiny.make_batch(family, reference, seed=seed), step, world)

    def post_encode(module, args, kwargs):  # ms-swift registers _post_encode as a forward pre-hook
        return args, swift_inputs_embeds(module, kwargs)

    for m in (model, reference):  # FSDP2 prepends its own pre-hook: the root unit is unsharded before this one
        m.register_forward_pre_hook(post_encode, with_kwargs=True)

    torch.manual_seed(0)
    train_against_reference(model, reference, rank, world, result, batches_for, counted_loss(model, calls), steps=steps)
    result["stats"] = {k: mixed_media.STATS[k] - before.get(k, 0) for k in mixed_media.STATS}
    return result
