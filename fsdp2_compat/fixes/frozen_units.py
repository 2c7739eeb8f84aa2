"""A unit whose first forward ran with every parameter frozen keeps its dtypes (pytorch #186998).

FSDP2 sets a unit's ``_orig_dtype`` / ``_reduce_dtype`` once, at lazy init (``FSDPParamGroup._init_mp_dtypes``),
from its trainable parameters only (torch 2.8.0-2.13.0).  A unit with none (a LoRA warm-up whose base, the vision
tower included, is frozen; staged training that unfreezes the tower later) gets ``None`` for both, and keeps it:
once unfrozen, its first backward with bf16 parameters and an fp32 reduce raises ``RuntimeError: attempting to
assign a gradient with dtype 'c10::BFloat16' to a tensor with grad_dtype 'Float'``.  torch 2.14.0 takes a
frozen unit's dtypes from its floating parameters instead; ``mp_dtypes_seam`` applies that rule after torch's
own method, to a group with no trainable parameter only, and only when those dtypes are uniform (2.14's test).

Fails safe: a group with a trainable parameter, or with mixed floating dtypes, keeps torch's answer; installed
only on the fingerprinted method (``integrations.torch_fsdp``).  Delete when every torch you run is >= 2.14.0.
"""

STATS = {"frozen_groups": 0}  # groups given their floating parameters' dtypes (tests read it)


def frozen_group_dtypes(group):
    """After torch's ``_init_mp_dtypes``: a group without trainable parameters takes torch 2.14's dtypes."""
    if any(p.sharded_param.requires_grad for p in group.fsdp_params):
        return
    floating = [p for p in group.fsdp_params if p.orig_dtype.is_floating_point]
    orig = {p.orig_dtype for p in floating}
    reduce = {p.reduce_dtype for p in floating}
    if len(orig) == 1 and len(reduce) == 1:
        group._orig_dtype, group._reduce_dtype = orig.pop(), reduce.pop()
        STATS["frozen_groups"] += 1


def mp_dtypes_seam(module, attr):
    """``{"FSDPParamGroup._init_mp_dtypes": wrapper}``: torch's method, then 2.14's rule for a frozen group."""
    from ..core import calls

    return calls.after_each_call(module, attr, "its FSDPParamGroup (self)", frozen_group_dtypes)
