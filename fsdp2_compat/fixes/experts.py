"""MoE experts that one rank's tokens never reach: every rank reduce-scatters every expert.

The bug (pytorch issue #171355, SkyRL issue #1297 / PR #1370): transformers 4.x keeps a MoE layer's routed experts
as an ``nn.ModuleList`` and runs only the experts some token of this micro-batch reaches
(``Qwen3MoeSparseMoeBlock.forward``: ``for expert_idx in expert_hit``; ``Glm4vMoeTextMoE.moe``: ``if
token_indices.numel() > 0``), so an unreached expert has no gradient here.  FSDP2's
``FSDPParamGroup.post_backward`` reduce-scatters only the parameters that have a gradient, so two ranks whose
tokens reached different experts issue reduce-scatters of different sizes inside the same unit: gloo aborts
("Received data size doesn't match expected size"), NCCL hangs or completes with gradients summed across the wrong
parameters.  transformers 5.x stores 3-D experts: every rank has every gradient, nothing is wrong there.

The fix, at FSDP2's unit (one fix for every trainer): the units that hold a skipping MoE block's experts
reduce-scatter every parameter of their all-gather, an exact zero for one without a gradient on this rank:
torch's own ``FSDPModule.set_reduce_scatter_unused_params(True)`` (2.13+) set on exactly those units; on
2.6-2.12 the group's ``post_backward`` first gives each such parameter the zero torch 2.13 would reduce.  The
reduced gradient is the data-parallel average of the real micro-batches, as in the unsharded reference.  Cost:
a unit's reduce-scatter is as large as when every expert is hit, plus one zero tensor per unreached expert
parameter (``benchmarks/moe_experts.py``).  It holds with gradient checkpointing on, reentrant or not
(``tests/integrations/test_moe_checkpointing.py``); torch 2.6-2.12's recompute without FSDP2's input cast is
another bug (``integrations.torch_fsdp.RECOMPUTE_CAST``).

Why not the model: a zero contribution of every expert to the block's output would also work (and on DDP), but adds
a gradient to accumulate for every expert on every micro-batch; the flag adds work only for the experts not
reached, and touches no tensor of the forward.

Where the units are found: the targets (``integrations.transformers_moe``) wrap the method that holds the skipping
loop; before it runs, the wrapper finds the units that manage the block's expert parameters (once per block; a
block found in no unit is looked for again on its next call, since a model may run a forward before it is sharded)
and sets the flag.  Every rank runs every MoE block's forward, so every rank marks the same units, before their
first backward.

Side effect, by design (as torch's flag and 5.x's 3-D experts): an expert no token on *any* rank reached gets an
exactly-zero gradient instead of none, so AdamW steps it as on a step where it was reached. Not covered, said once
per block class in a warning: experts sharded as units of their own (an unreached expert's unit skips its
all-gather on this rank, a forward collective no flag can align).

Fails safe: the targets are fingerprinted per transformers release; a block whose experts FSDP2 does not
manage is left alone.  Revert restores transformers' methods; units already marked keep the flag, as a model
wrapped while a patch was on keeps its wrapping.
Delete when: every transformers you train MoE models with stores experts as 3-D parameters (5.0+), or torch
FSDP2 reduces unused parameters by default.
"""

import weakref

# Units marked in this process, MoE block calls seen, zero gradients given on a torch without the flag
# (tests and benchmarks read them).
STATS = {"units_marked": 0, "blocks_seen": 0, "zero_grads_given": 0}

_COVERED = weakref.WeakKeyDictionary()  # block -> tuple of weak references to the groups it marked
_WARNED = set()


def expert_modules(block):
    """The modules of ``block``'s routed experts (``block.experts`` and everything under it)."""
    experts = getattr(block, "experts", None)
    return [] if experts is None else list(experts.modules())


def owning_groups(modules):
    """The FSDP2 parameter groups (``FSDPParamGroup``) that manage a parameter of any of ``modules``."""
    from .units import live_units

    wanted = {id(m) for m in modules}
    found = []
    for _, state in live_units():
        group = getattr(state, "_fsdp_param_group", None)
        if group is None or any(g is group for g in found):
            continue
        if any(id(fsdp_param._module_info.module) in wanted for fsdp_param in group.fsdp_params):
            found.append(group)
    return found


def reduce_unused(group):
    """Make ``group`` reduce-scatter every parameter it all-gathered, an exact zero for one without a gradient.

    torch 2.13+: its own ``reduce_scatter_unused_params`` flag (what
    ``FSDPModule.set_reduce_scatter_unused_params(True, recurse=False)`` sets).
    Older torch: ``zero_grads_first``.  Idempotent.
    """
    if not hasattr(group, "reduce_scatter_unused_params"):
        return zero_grads_first(group)
    if not group.reduce_scatter_unused_params:
        group.reduce_scatter_unused_params = True
        STATS["units_marked"] += 1


def zero_grads_first(group):
    """A torch without the flag (2.6-2.12): ``group``'s ``post_backward`` (this instance's) first gives
    every all-gathered parameter without a gradient the zero torch 2.13 would reduce.  Idempotent."""
    if "post_backward" not in vars(group):
        group.post_backward = _zeroing_post_backward(group)
        STATS["units_marked"] += 1


def _zeroing_post_backward(group):
    """``group.post_backward`` for a torch without ``reduce_scatter_unused_params`` (2.6-2.12).

    Looked up on the class at each call, so a seam installed on
    ``FSDPParamGroup.post_backward`` later (``fixes.accumulation``) still runs.
    """
    ref = weakref.ref(group)

    def post_backward(*args, **kwargs):
        g = ref()
        if g.reduce_grads:
            STATS["zero_grads_given"] += give_unused_zero_grads(g)
        return type(g).post_backward(g, *args, **kwargs)

    return post_backward


def give_unused_zero_grads(group):
    """Each all-gathered, trainable parameter of ``group`` without a gradient gets a zero one (torch
    2.13's ``unsharded_zero_grad_data``: ``param_dtype``, the unsharded shape).  Returns how many."""
    import torch

    given = 0
    for fsdp_param in group.fsdp_params:
        if not hasattr(fsdp_param, "_unsharded_param"):  # never all-gathered: torch skips it too
            continue
        param = fsdp_param.unsharded_param
        if fsdp_param.unsharded_accumulated_grad is None and param.grad is None and param.requires_grad:
            param.grad = torch.zeros_like(param)
            given += 1
    return given


def cover(block):
    """Mark the FSDP2 units that manage ``block``'s experts (``reduce_unused``); returns them.

    Cached per block while those units live; a block found in no unit is
    looked for again on its next call.
    """
    refs = _COVERED.get(block)
    if refs is not None:
        groups = [r() for r in refs]
        if all(g is not None for g in groups):
            return groups
    modules = expert_modules(block)
    groups = owning_groups(modules)
    if not groups:
        return []
    expert_ids = {id(m) for m in modules}
    for group in groups:
        if all(id(m) in expert_ids for m in group.modules):
            _warn_once(block, "its experts are FSDP2 units of their own: a rank whose tokens reach no expert of a "
                              "unit skips that unit's all-gather, which no reduce-scatter flag can align; shard the "
                              "MoE block or its decoder layer as one unit")
        reduce_unused(group)
    _COVERED[block] = tuple(weakref.ref(g) for g in groups)
    return groups


def _warn_once(block, why):
    from .media_merge import warn_once

    warn_once(_WARNED, block, "fsdp2-compat: MoE experts: %%s is not fully covered (%s)" % why.replace("%", "%%"))


def block_seam(module, attr):
    """``{attr: wrapper}`` for the method of a MoE block class that runs only the experts tokens reach."""
    from ..core import calls

    return calls.before_each_call(module, attr, "its MoE block (self)", _seen)


def _seen(block):
    STATS["blocks_seen"] += 1
    cover(block)
