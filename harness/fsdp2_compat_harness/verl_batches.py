"""Batches shaped as verl's data pipeline feeds its fused forwards.

verl's Qwen2-VL and GLM4V fused forwards take (4, batch, seq) position ids:
the text positions stacked on the 3D rope index, as verl's dataset builds
them.  Used by ``audit --fused``, the check and the tests; never by a patch.
"""


def add_verl_position_ids(model, batch):
    """verl's Qwen2-VL / GLM4V fused forwards require (4, batch, seq) position ids: text
    positions stacked on the 3D rope index, as verl's dataset builds them."""
    import inspect

    import torch

    fwd = type(model).__dict__.get("forward")
    if "position_ids" in batch or getattr(fwd, "__module__", "") not in (
            "verl.models.transformers.qwen2_vl", "verl.models.transformers.glm4v"):
        return
    get_rope_index = getattr(getattr(model, "model", model), "get_rope_index", None)
    if get_rope_index is None:
        return
    accepted = inspect.signature(get_rope_index).parameters
    rope, _ = get_rope_index(**{k: v for k, v in batch.items() if k in accepted})
    b, n = batch["input_ids"].shape
    batch["position_ids"] = torch.cat([torch.arange(n).expand(1, b, n), rope], 0)


def glm4v_verl_batch(model, batch):
    """``batch`` as verl's data pipeline feeds GLM4V: (4, batch, seq) position ids, no labels."""
    batch = {k: v for k, v in batch.items() if k != "labels"}
    add_verl_position_ids(model, batch)
    return batch
