"""Rank functions for the towers of transformers 5.24.0's new families (``tests/integrations/test_recent_towers.py``).

The tower alone (no tiny family exists for the whole model: no framework release admits transformers 5.24.0, see
docs/audit-sweep.md), sharded on every rank by one of two rules, then one forward and backward on different data
per rank:

- ``"embeddings"``: every ``nn.Embedding`` plus the layer classes, in module order, then the root: the selection
  rule verl <= 0.7.0, SkyRL, skyrl-train, AReaL and LLaMA-Factory apply to an untied model (a tower holds no
  input embedding, so the tie flag does not matter here);
- ``"fixed"``: ``fsdp2_compat.fixes.selection.select_wrap_targets`` (the corrected rule every selection patch installs).
"""

TOWERS = ("hy_v4_vl", "moss_transcribe_diarize")


def build_tower(name, seed=0):
    """``(tower, inputs(seed))`` with hidden 32, one layer."""
    import torch

    if name == "hy_v4_vl":
        from transformers.models.hy_v4_vl import configuration_hy_v4_vl as cfg, modeling_hy_v4_vl as mod

        config = cfg.HYV4VLVisionConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                        num_key_value_heads=2, num_hidden_layers=1, out_hidden_size=32, patch_size=4,
                                        max_image_size=16, spatial_merge_size=2)
        cls = mod.HYV4VLVisionModel

        def inputs(s):  # one 16x16 image: 4x4 patches of 3x4x4 pixels
            gen = torch.Generator().manual_seed(s)
            return (torch.randn(16, 3 * 4 * 4, generator=gen), torch.tensor([[1, 4, 4]]))
    else:
        from transformers.models.moss_transcribe_diarize import (configuration_moss_transcribe_diarize as cfg,
                                                                 modeling_moss_transcribe_diarize as mod)

        config = cfg.MossTranscribeDiarizeAudioConfig(d_model=32, encoder_attention_heads=2, encoder_ffn_dim=64,
                                                      encoder_layers=1, num_mel_bins=16, max_source_positions=16)
        cls = mod.MossTranscribeDiarizeAudioModel

        def inputs(s):  # 16 mel bins x 32 frames (two stride-2 convs -> the 16 source positions)
            gen = torch.Generator().manual_seed(s)
            return (torch.randn(1, 16, 32, generator=gen),)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tower = cls(config).float().train()
    return tower, inputs


def _units(tower, rule):
    import torch.nn as nn

    from fsdp2_compat.fixes.selection import select_wrap_targets
    from fsdp2_compat_harness.audit.plans import layer_classes_of

    if rule == "fixed":
        return list(select_wrap_targets(tower, layer_classes_of(tower)))
    layers = set(layer_classes_of(tower))
    return [m for m in tower.modules() if m is not tower and (isinstance(m, nn.Embedding) or type(m).__name__ in layers)]


def _loss(out):
    t = out.pooler_output if getattr(out, "pooler_output", None) is not None else out.last_hidden_state
    return t.float().pow(2).mean()


def tower_step(rank, world, name, rule):
    """One forward/backward of the sharded tower; the error, or every gradient against the DP-average reference."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdp2_compat_harness.scenarios import first_line, full_value, rel_err

    tower, inputs = build_tower(name)
    reference = copy.deepcopy(tower)
    mesh = init_device_mesh("cpu", (world,))
    units = _units(tower, rule)
    names = {id(m): n for n, m in tower.named_modules()}
    wrapped = [names[id(m)] for m in units]
    for module in units:
        fully_shard(module, mesh=mesh)
    fully_shard(tower, mesh=mesh)
    result = {"wrapped": wrapped, "error": None}
    try:
        loss = _loss(tower(*inputs(100 + rank)))
        loss.backward()
    except Exception as exc:  # noqa: BLE001 - the crash is the result
        result["error"] = "%s: %s" % (type(exc).__name__, first_line(exc))
        return result
    result["loss"] = float(loss)
    for r in range(world):
        (_loss(reference(*inputs(100 + r))) / world).backward()
    ref = dict(reference.named_parameters())
    errs = {n: rel_err(full_value(p.grad), ref[n].grad) for n, p in tower.named_parameters() if ref[n].grad is not None}
    result["grads_checked"] = len(errs)
    result["worst_grad"] = max(errs, key=errs.get)
    result["grad_err"] = errs[result["worst_grad"]]
    return result
