"""verl's fused forwards under Ulysses sequence parallelism, through verl's own actor and engine, on CPU gloo ranks.

``train_sp(rank, world, family, patches)``: verl 0.6.0-0.7.1's SP callers compute the labels rolled over the
whole packed sequence but never pass them to the fused forward, which rolls ``labels or input_ids`` on what
it gets (a VLM: the full padded sequence, its hidden states sliced after the embedding, so every SP rank uses
SP rank 0's labels; a text model: its shard, so each shard's last label is wrong).  What runs is verl's own
code: ``apply_monkey_patch(ulysses_sp_size=2, use_remove_padding=True, use_fused_kernels=True,
fused_kernels_backend="torch")``, ``apply_fsdp2`` over the ``world`` ranks (one SP group of ``world`` ranks, FSDP
over the same ranks, as verl builds its meshes for sp = world), and ``DataParallelPPOActor._forward_micro_batch``
(its remove-padding, ``ulysses_pad`` / ``ulysses_pad_and_slice_inputs``, fused forward and
``gather_outputs_and_unpad``) on one micro-batch of two samples of different lengths; the ranks of one SP
group share it by construction, each holding a different shard of the sequence.  fp32: the actor's
``fsdp_config.dtype`` is ``float32`` (CPU autocast to fp32 is off).

Reference: an unsharded copy through a second ``DataParallelPPOActor`` with ``ulysses_sequence_parallel_size=1``
and no SP group (its roll is the global one), the same loss (a fixed random weighting of every response
log-prob).  A spy on ``FusedLinearForPPO.forward`` records the labels the kernel used on this rank;
``labels_wrong`` counts those that differ from this rank's slice of the global roll (the packed sequence's
last position, the wrap-around every caller discards, and verl's SP padding excluded).

Stand-ins (CPU only, named; nothing the bug or the fix touches): flash-attn's dense and varlen kernels ->
``flash_attention`` / ``flash_varlen`` (exact causal SDPA per packed segment, fp32; its fp32->bf16 input cast
skipped), installed where verl and its Ulysses attention look them up; flash-attn's ``bert_padding``
helpers that verl's ``attention_utils`` dispatches to -> pure-torch ``unpad_input`` / ``pad_input`` /
``index_first_axis`` / ``rearrange`` (the two patterns the actor uses).  Written after the research script
of issue #42 (scratch ``item3_sp_labels.py``).
"""

import copy
import functools
import importlib

SP = 2
# tiny family -> the verl module whose fused forward serves it
FORWARD = {"qwen2_5_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl", "qwen2": "dense_common"}


def _segments(position_ids, total):
    import torch

    pos = position_ids.reshape(-1)[:total]
    starts = (pos == 0).nonzero().view(-1).tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    return torch.tensor(starts + [total])


def _causal(q, k, v, scale):
    """(s, h, d) x (s, hk, d) -> (s, h, d): causal SDPA, GQA by repetition."""
    import torch.nn.functional as F

    rep = q.size(1) // k.size(1)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                         scale=scale)
    return out.transpose(0, 1)


def flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                 softmax_scale=None, causal=True, **_):
    """Stand-in for flash-attn's varlen kernel: exact causal attention per packed segment."""
    import torch

    assert causal and dropout_p == 0.0
    cu = cu_seqlens_q.tolist()
    return torch.cat([_causal(q[a:b], k[a:b], v[a:b], softmax_scale) for a, b in zip(cu[:-1], cu[1:])], 0)


def flash_attention(query_states, key_states, value_states, attention_mask, query_length, is_causal=True,
                    dropout=0.0, position_ids=None, softmax_scale=None, **_):
    """Stand-in for transformers' ``_flash_attention_forward`` ((b, s, h, d)): packed segments from position ids."""
    import torch

    assert is_causal and not dropout
    outs = []
    for i in range(query_states.size(0)):
        s = query_states.size(1)
        if position_ids is not None:
            cu = _segments(position_ids[i] if position_ids.dim() > 1 else position_ids, s)
        else:
            cu = torch.tensor([0, s])
        outs.append(flash_varlen(query_states[i], key_states[i], value_states[i], cu, cu, softmax_scale=softmax_scale))
    return torch.stack(outs, 0)


def _padding_helpers():
    """Pure-torch stand-ins of the four ``bert_padding`` helpers verl's ``attention_utils`` dispatches to."""
    import torch

    def unpad_input(hidden_states, attention_mask, unused_mask=None):
        seqlens = attention_mask.sum(-1, dtype=torch.int32)
        indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
        cu = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
        flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
        return flat[indices], indices, cu, int(seqlens.max()), seqlens

    def pad_input(hidden_states, indices, batch, seqlen):
        out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
        out[indices] = hidden_states
        return out.reshape(batch, seqlen, *hidden_states.shape[1:])

    def index_first_axis(x, indices):
        return x[indices]

    def rearrange(x, pattern):
        if pattern == "b s ... -> (b s) ...":
            return x.reshape(-1, *x.shape[2:])
        if pattern == "c b s ... -> (b s) c ...":
            return x.permute(1, 2, 0, *range(3, x.dim())).reshape(-1, x.size(0), *x.shape[3:])
        raise NotImplementedError(pattern)

    return index_first_axis, pad_input, rearrange, unpad_input


def install_standins(family):
    """The stand-ins above, where verl looks them up (module globals of verl's own modules)."""
    attention_utils = importlib.import_module("verl.utils.attention_utils")
    attention_utils._get_attention_functions = _padding_helpers
    if FORWARD[family] == "qwen2_vl":  # verl's own attention forward (qwen2_vl_attn_forward)
        mod = importlib.import_module("verl.models.transformers.qwen2_vl")
        mod._flash_attention_forward, mod.flash_attn_varlen_func = flash_attention, flash_varlen
        mod.fa_peft_integration_check = lambda q, k, v, target_dtype=None: (q, k, v)
        for name in ("_flash_supports_window_size", "_flash_supports_deterministic", "_flash_use_top_left_mask"):
            mod.__dict__.setdefault(name, False)
    else:  # transformers' flash integration -> verl's _ulysses_flash_attention_forward -> the kernel
        importlib.import_module("verl.models.transformers.monkey_patch")._flash_attention_forward = flash_attention


def micro_batch(family, model, seeds):
    """verl's actor layout: two right-padded samples, per-sample ``multi_modal_inputs``, verl's position ids
    (Qwen2.5-VL: the text row on the 3-D rope index; Qwen3-VL: the rope index; text: arange)."""
    import inspect

    import torch

    from fsdp2_compat_harness import tiny

    samples = []
    for seed in seeds:
        b = tiny.make_batch(family, model, seed=seed, batch_size=1)
        ids = b["input_ids"][b["attention_mask"].bool()].view(1, -1)
        n = ids.size(1)
        if "pixel_values" in b:
            inner = getattr(model, "model", model)
            kw = {"input_ids": ids, "image_grid_thw": b["image_grid_thw"], "attention_mask": torch.ones_like(ids)}
            rope, _ = inner.get_rope_index(**{k: v for k, v in kw.items()
                                              if k in inspect.signature(inner.get_rope_index).parameters})
            pos = rope[:, 0] if family == "qwen3_vl" else torch.cat([torch.arange(n).view(1, n), rope[:, 0]], 0)
            media = {"pixel_values": b["pixel_values"], "image_grid_thw": b["image_grid_thw"]}
        else:  # the first sample 3 tokens short: an SP shard boundary falls inside a sample, not between two
            n -= 3 * (not samples)
            ids, pos, media = ids[:, :n], torch.arange(n), None
        samples.append((ids[0], pos, media))
    seqlen = max(ids.numel() for ids, _, _ in samples)
    input_ids = torch.zeros(len(samples), seqlen, dtype=torch.long)
    mask = torch.zeros(len(samples), seqlen, dtype=torch.long)
    rows = samples[0][1].size(0) if samples[0][1].dim() == 2 else None
    position_ids = torch.zeros(len(samples), *((rows,) if rows else ()), seqlen, dtype=torch.long)
    for i, (ids, pos, _) in enumerate(samples):
        input_ids[i, :ids.numel()], mask[i, :ids.numel()] = ids, 1
        position_ids[i, ..., :ids.numel()] = pos
    batch = {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids,
             "responses": input_ids[:, 1:]}  # every position but the first is a "response" position
    if samples[0][2] is not None:
        batch["multi_modal_inputs"] = [media for _, _, media in samples]
    return batch


def _actor(model, sp):
    from omegaconf import OmegaConf
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    config = OmegaConf.create({
        "use_remove_padding": True, "use_fused_kernels": True, "ulysses_sequence_parallel_size": sp,
        "entropy_from_logits_with_chunking": False, "entropy_checkpointing": False, "use_torch_compile": False,
        "fsdp_config": {"dtype": "float32"},
    })
    return DataParallelPPOActor(config, model)


def _log_probs(actor, batch):
    out = actor._forward_micro_batch(batch, temperature=1.0, calculate_entropy=False)
    return out["log_probs"] if isinstance(out, dict) else out[1]  # 0.7.1 returns a dict, 0.6.x / 0.7.0 a tuple


def train_sp(rank, world, family, patches, steps=2, lr=0.05):
    """One SP group of ``world`` ranks (sp = world) against the unsharded reference; see the module docstring."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_compat_harness import subset, tiny
    from fsdp2_compat_harness.scenarios import _compare_grads, _param_err, first_line, rel_err, wrapped_module_names

    subset.apply(patches)
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils import fsdp_utils, ulysses
    from verl.utils.experimental import torch_functional

    install_standins(family)
    model = tiny.build(family, tie=False, seed=0)
    text = model.config.text_config if hasattr(model.config, "text_config") else model.config
    text._attn_implementation = "flash_attention_2"  # the decoder on verl's flash path (the tower: as built)
    apply_monkey_patch(model, ulysses_sp_size=world, use_remove_padding=True, use_fused_kernels=True,
                       fused_kernels_backend="torch")
    reference = copy.deepcopy(model)
    fsdp_utils.apply_fsdp2(model, {"mesh": init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))}, {})
    sp_group = dist.new_group(list(range(world)))
    actor, ref_actor = _actor(model, world), _actor(reference, 1)

    used, recording = [], [False]
    original = torch_functional.FusedLinearForPPO.forward

    def spy(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
        if recording[0]:
            used.append(input_ids.detach().reshape(-1)[: hidden_states.reshape(-1, hidden_states.size(-1)).size(0)])
        return original(self, hidden_states, vocab_weights, input_ids, temperature)

    torch_functional.FusedLinearForPPO.forward = spy
    result = {"wrapped": wrapped_module_names(model), "forward": type(model).forward.__module__, "error": None,
              "labels_wrong": [], "local_len": 0, "logprob_err": 0.0, "loss_err": 0.0, "grad_err": 0.0,
              "worst_grad": None, "lm_head_grad_err": 0.0, "param_err": 0.0, "losses": []}
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    try:
        for step in range(steps):
            batch = micro_batch(family, reference, seeds=(11 + 2 * step, 12 + 2 * step))
            mask = batch["attention_mask"][:, 1:].float()
            weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(100 + step)) * mask
            ulysses.set_ulysses_sequence_parallel_group(sp_group)
            recording[0], used[:] = True, []
            try:
                log_probs = _log_probs(actor, batch)
                loss = (weights * log_probs).sum() / mask.sum()
                loss.backward()
            except Exception as exc:
                result["error"] = "step %d: %s: %s" % (step, type(exc).__name__, first_line(exc))
                return result
            finally:
                recording[0] = False
                ulysses.set_ulysses_sequence_parallel_group(None)
            ref_log_probs = _log_probs(ref_actor, batch)
            ref_loss = (weights * ref_log_probs).sum() / mask.sum()
            ref_loss.backward()
            result["labels_wrong"].append(_wrong(batch, used[-1], rank, world))
            result["local_len"] = used[-1].numel()
            result["losses"].append(loss.item())
            result["loss_err"] = max(result["loss_err"], rel_err(loss, ref_loss))
            result["logprob_err"] = max(result["logprob_err"], rel_err(log_probs, ref_log_probs))
            _compare_grads(model, reference, result)
            for o in (optimizer, ref_optimizer):
                o.step()
                o.zero_grad()
        result["param_err"] = _param_err(model, reference)
        from fsdp2_compat.core import engine

        result["sp_caller"] = sorted({row.outcome.kind for row in engine.outcomes(engine.requested())
                                      if row.outcome.target.key.endswith("._forward_micro_batch")})
        return result
    finally:
        torch_functional.FusedLinearForPPO.forward = original


def _wrong(batch, used, rank, world):
    """How many labels the kernel used on this rank differ from this rank's slice of the global roll."""
    import torch

    ids = batch["input_ids"][batch["attention_mask"].bool()]
    nnz = ids.numel()
    rolled = torch.roll(ids, -1)
    padded = torch.cat([rolled, rolled.new_zeros(-nnz % world)])
    local = padded.size(0) // world
    start = rank * local
    expected = padded[start:start + local]
    keep = torch.arange(start, start + local) < nnz - 1  # the wrap-around and verl's SP padding: discarded
    return int(((used[:local] != expected) & keep).sum())



def train_engine_sp(rank, world, family, model_dir, patches):
    """The same through verl's ``FSDPEngineWithLMHead`` (``EngineRegistry``, ``engines.cpu``'s CPU platform):
    ``ulysses_sequence_parallel_size=world``, remove-padding, fused kernels, fp32 policy; one
    ``forward_backward_batch`` (verl's ``sft_loss``) of the same three samples on every rank of the SP group
    (an SP shard boundary inside a sample), against the unsharded reference under the engine's own bf16 autocast
    (verl 0.7.x's ``forward_step`` autocasts whatever the policy: bf16 tolerance).  The engine loads the model
    eager; its decoder is switched to verl's flash path after ``initialize``, as ``train_sp`` does."""
    import torch
    from verl.utils import tensordict_utils as tu

    from fsdp2_compat_harness.engines import common, cpu, verl_engine
    from fsdp2_compat_harness.scenarios import first_line

    cpu.use_verl_cpu_platform()  # before verl.workers.engine is imported
    common.activate(patches)
    cpu.register_verl_engine_for_cpu()
    install_standins(family)
    from verl.trainer.config import CheckpointConfig
    from verl.utils.experimental import torch_functional
    from verl.utils.model import get_hf_auto_model_class
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import sft_loss

    model_config = HFModelConfig(path=model_dir, use_remove_padding=True, use_fused_kernels=True,
                                 fused_kernel_options={"impl_backend": "torch"}, enable_gradient_checkpointing=False,
                                 override_config={"attn_implementation": "eager"})
    engine_config = FSDPEngineConfig(
        strategy="fsdp2", forward_only=False, use_dynamic_bsz=False, micro_batch_size_per_gpu=3,
        use_remove_padding=True, use_fused_kernels=True, use_torch_compile=False, ulysses_sequence_parallel_size=world,
        mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"})
    engine = EngineRegistry.new("language_model", "fsdp2", model_config=model_config, engine_config=engine_config,
                                optimizer_config=FSDPOptimizerConfig(optimizer="SGD", lr=0.05, weight_decay=0.0,
                                                                     clip_grad=1e6, total_training_steps=10),
                                checkpoint_config=CheckpointConfig())
    result = {"error": None, "labels_wrong": [], "local_len": 0, "autocast": "bfloat16"}
    try:
        engine.initialize()
    except Exception as exc:
        result["error"] = "initialize: %s: %s" % (type(exc).__name__, first_line(exc))
        return result
    module = engine.module
    text = module.config.text_config if hasattr(module.config, "text_config") else module.config
    text._attn_implementation = "flash_attention_2"
    result["forward"] = type(module).forward.__module__
    reference = get_hf_auto_model_class(model_config.hf_config).from_pretrained(
        model_config.local_path, config=copy.deepcopy(model_config.hf_config), torch_dtype=torch.float32)
    reference.train()
    samples = verl_engine.make_samples(family, reference, seed=1000)[:3]
    total, _ = verl_engine.reference_loss(reference, samples, True, torch.bfloat16)  # before: no SP group here
    total.backward()
    data = verl_engine.to_tensordict(samples, True, model_config.tokenizer.pad_token_id)
    tu.assign_non_tensor(data, use_remove_padding=True, micro_batch_size_per_gpu=len(samples))  # one micro-batch
    used, original = [], torch_functional.FusedLinearForPPO.forward

    def spy(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
        used.append(input_ids.detach().reshape(-1)[: hidden_states.reshape(-1, hidden_states.size(-1)).size(0)])
        return original(self, hidden_states, vocab_weights, input_ids, temperature)

    torch_functional.FusedLinearForPPO.forward = spy
    try:
        with engine.train_mode(disable_auto_offload=True, zero_grad_on_exit=False):
            engine.optimizer_zero_grad()
            try:
                engine.forward_backward_batch(data, functools.partial(sft_loss, config=None), forward_only=False)
            except Exception as exc:
                result["error"] = "step 0: %s: %s" % (type(exc).__name__, first_line(exc))
                return result
            ids = torch.cat([s["input_ids"] for s in samples]).view(1, -1)
            result["labels_wrong"] = [_wrong({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, used[-1],
                                             rank, world)]
            result["local_len"] = used[-1].numel()
            common.compare(module, reference, result, "step0")  # inside: verl 0.7 zeroes gradients on exit
    finally:
        torch_functional.FusedLinearForPPO.forward = original
    from fsdp2_compat.core import engine as compat

    result["sp_caller"] = sorted({row.outcome.kind for row in compat.outcomes(compat.requested())
                                  if row.outcome.target.key.endswith(".forward_step")})
    return result
