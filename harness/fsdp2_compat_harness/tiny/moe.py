"""Tiny MoE models whose ranks' tokens reach different experts, and a record of which experts ran.

The text MoE families of the ``moe`` patch (``FAMILIES``) are built here from
their config classes, like every tiny family, with ``EXPERTS`` routed experts
and one expert per token (``TOP_K``): a micro-batch of a few dozen tokens then
leaves some experts unreached, and two ranks with different tokens reach
different sets, as a real checkpoint's uneven routing does on small RL
micro-batches.  The catalogue's MoE VLMs (``glm4v_moe``, ``qwen3_vl_moe``) are
``tiny`` families already; ``build(family)`` gives them the same expert count.

``hits(model)`` is a context manager recording, per MoE block, which experts
ran on this process's micro-batches: in transformers 4.x by a forward hook on
each expert module (the loop calls only the reached ones), in 5.x from the
routing indices the 3-D experts module takes.  A test asserts with it that the
ranks' expert sets really differ.

These families are not in ``tiny.FAMILIES``: that tuple drives the
selection, fused-forward and mixed-ranks parametrisations, whose bugs these
text models do not have (``textlm``'s proofs cover their other targets).
"""

from __future__ import annotations

import contextlib

from .configs import _HEAD_DIM, _text, rope
from .text import text_ids

EXPERTS = 16
TOP_K = 1
_MOE_INTER = 16
TOKENS = 8  # per row; two rows: 16 tokens reach at most 16 of 16 experts, in practice far fewer

# family -> (model class, config class)
CLASSES = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig"),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig"),
    "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config"),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config"),
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig"),
}
FAMILIES = tuple(CLASSES)

# The expert-count keys of the VLM MoE families' text configs (``tiny.build(..., experts=True)``).
VLM_EXPERT_KEYS = {
    "glm4v_moe": ("n_routed_experts", "num_experts_per_tok"),
    "qwen3_vl_moe": ("num_experts", "num_experts_per_tok"),
}


def tiny_config(family: str, tie: bool):
    import transformers as T

    cfg_cls = getattr(T, CLASSES[family][1])
    moe = dict(moe_intermediate_size=_MOE_INTER, num_experts_per_tok=TOP_K)
    if family in ("qwen3_moe", "qwen2_moe"):
        moe.update(num_experts=EXPERTS, decoder_sparse_step=1, norm_topk_prob=True)
        if family == "qwen2_moe":
            moe.update(shared_expert_intermediate_size=_MOE_INTER)
        else:
            moe.update(head_dim=_HEAD_DIM)
        return cfg_cls(**_text(tie, **moe, **rope()))
    if family == "mixtral":
        return cfg_cls(**_text(tie, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, head_dim=_HEAD_DIM,
                               router_jitter_noise=0.0, **rope()))
    # DeepSeek-V2/V3 and GLM-4.5: routed + shared experts, group-limited routing over one group; layer 0 sparse
    moe.update(n_routed_experts=EXPERTS, n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1)
    if family == "glm4_moe":
        return cfg_cls(**_text(tie, head_dim=_HEAD_DIM, partial_rotary_factor=0.5, **moe, **rope()))
    mla = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=_HEAD_DIM,
               head_dim=8)
    if family == "deepseek_v2":
        moe.update(topk_method="greedy")
    return cfg_cls(**_text(tie, num_key_value_heads=2, **moe, **mla, **rope()))


def with_experts(config, family: str):
    """A VLM MoE config (``VLM_EXPERT_KEYS``) with ``EXPERTS`` routed experts, ``TOP_K`` per token."""
    count, top_k = VLM_EXPERT_KEYS[family]
    setattr(config.text_config, count, EXPERTS)
    setattr(config.text_config, top_k, TOP_K)
    return config


def make_batch(model, *, seed: int, batch_size: int = 2) -> dict:
    """Two rows of ``TOKENS`` text ids (labels = ids)."""
    import torch

    gen = torch.Generator().manual_seed(int(seed))
    ids = torch.stack([text_ids(gen, TOKENS) for _ in range(batch_size)])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def moe_blocks(model):
    """``[(name, block)]``: every module holding routed experts (an ``experts`` child)."""
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "experts") and name]


@contextlib.contextmanager
def hits(model):
    """Yield ``{block name: set of expert indices that ran}``, filled while the context is open."""
    import torch

    seen: dict = {name: set() for name, _ in moe_blocks(model)}
    handles = []
    for name, block in moe_blocks(model):
        experts = block.experts
        if isinstance(experts, torch.nn.ModuleList):  # transformers 4.x: the loop calls only reached experts
            for index, expert in enumerate(experts):
                handles.append(expert.register_forward_pre_hook(
                    lambda _m, _a, name=name, index=index: seen[name].add(index)))
        else:  # 3-D experts (4.57 Qwen3-VL-MoE, 5.x): the routing indices are an argument of the experts module
            handles.append(experts.register_forward_pre_hook(_routing_recorder(seen[name]), with_kwargs=True))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _routing_recorder(into):
    import torch

    def record(_module, args, kwargs):
        values = list(args[1:]) + list(kwargs.values())
        index = next((v for v in values if isinstance(v, torch.Tensor) and not v.is_floating_point()), None)
        if index is not None:
            into.update(int(i) for i in index.unique().tolist())

    return record
