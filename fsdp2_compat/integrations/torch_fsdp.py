"""torch: FSDP2 gradient accumulation when micro-batches use different parts of the model; the recompute cast.

Two seams in ``torch.distributed.fsdp._fully_shard`` (torch 2.7.0-2.14.1), code in ``fixes.accumulation``:

1. ``FSDPParam.to_accumulated_grad_if_needed`` reads ``self._unsharded_param`` unguarded; it exists only after
   the parameter's first all-gather.  With sync deferred (``set_requires_gradient_sync(False)``) and
   ``reduce_dtype != param_dtype`` (verl's and SkyRL's bf16 / fp32 default), the root post-backward callback
   runs every group's ``post_backward``, whose deferred branch calls it for every parameter, and a unit that
   never ran (a vision tower during a text-only first micro-batch; an ``lm_head`` read with ``full_tensor()``)
   raises ``AttributeError: 'FSDPParam' object has no attribute '_unsharded_param'``.  The seam returns early
   for such a parameter (no gradient can exist to upcast), as torch's synchronising branch already does.
2. Behind it, ``FSDPParamGroup.post_backward``: a unit used only partly in a deferred micro-batch (a VLM's root
   holds the vision ``patch_embed`` / ``merger`` next to the text norm) reaches the synchronising
   post-backward with fp32 accumulated gradients for some parameters and fresh bf16 ones for others:
   ``AssertionError: FSDP reduce-scatter expects uniform gradient dtype but got {torch.bfloat16,
   torch.float32}``.  The seam first brings the fresh-only gradients to the accumulated dtype with torch's own
   ``to_accumulated_grad_if_needed``; ``foreach_reduce`` copies every gradient into a ``reduce_dtype`` buffer
   anyway, so the reduce-scatter input is the same values.  Nothing happens with sync deferred, or when no
   parameter of the group has an accumulated gradient (every ordinary step).

Releases (every published wheel read; see ``declared``): (1) is the same code 2.4.0-2.14.1 (in this module
from 2.6.0), but before 2.7.0 the root callback post-backwards only unsharded groups, so a never-gathered unit
is not reached in practice; (2) is reachable from 2.6.0.  torch 2.15.0 removed (1) and rewrote (2) around
``Parameter.grad_dtype`` with ``getattr(fsdp_param, "_unsharded_param", None)`` guards: nothing to patch.

``RECOMPUTE_CAST`` (no seam, issue #42): torch 2.6-2.12 skip FSDP2's mixed-precision cast in a checkpoint
recompute (``_pre_forward`` returns early in ``PRE_BACKWARD``; pytorch #159359, fixed in 2.13.0 by PR
#182580): declared "not covered" there, so a requested MoE patch says so; not needed from 2.13.0.

Upstream: pytorch PR #194058 (the guard of (1), closed unmerged), pytorch issue #196996 (the assertion of
(2)), verl PR #7475 (an open shim of (1)), verl issue #7520 (fused kernels, untied ``lm_head``, deferred sync:
there the guard alone turns the crash into a silently un-averaged ``lm_head`` gradient; ``fixes.gather``'s
patches fix both).
Fails safe: each seam is installed only where the method's fingerprint is a recorded one (a wrapt proxy of
someone else is unknown code and refused); revert restores torch's methods.
Delete when: every torch you run is >= 2.15.0, or carries both fixes.
"""

from ..core.records import Integration, Target
from ..fixes import FROZEN_FIRST_FORWARD, GRAD_ACCUMULATION as FIX, MIXED_DTYPES, MOE_EXPERTS

FULLY_SHARD = "torch.distributed.fsdp._fully_shard"

# torch is FSDP2 itself: it wraps nothing (no ``apply_fsdp2``) and no caller
# imports the patched methods by name.
INTEGRATION = Integration(dist="torch", package="torch", wrap_module=None)

_NO_MODULE = (
    "no torch.distributed.fsdp._fully_shard: FSDP2 lived in torch.distributed._composable.fsdp (2.4.0-2.5.1, "
    "where the same code is not covered by this target) or did not exist yet"
)
_REWORKED = "accumulation rewritten around Parameter.grad_dtype, guarded with getattr(..., '_unsharded_param', None)"


GRAD_ACCUM_GUARD = Target(
    dist="torch",
    module=FULLY_SHARD + "._fsdp_param",
    attr="FSDPParam.to_accumulated_grad_if_needed",
    versions=">=2.13.0,<=2.14.1",
    # The same code in every release of this module.  2.6.0's root callback
    # post-backwards a sharded group only under set_unshard_in_backward(False),
    # so the crash needs 2.7.0+ in practice; the guard is harmless either way.
    fingerprints={"2.6.0-2.14.1": "9b118be51f352e31"},
    fix=FIX,
    via="guard",
    what="FSDP2 gradient accumulation (deferred upcast of a never-gathered parameter)",
    diff="fsdp-param-accumulation",
    declared={"<2.6.0": _NO_MODULE, ">=2.15.0": "method removed: " + _REWORKED},
)

GRAD_ACCUM_UNIFORM = Target(
    dist="torch",
    module=FULLY_SHARD + "._fsdp_param_group",
    attr="FSDPParamGroup.post_backward",
    versions=">=2.13.0,<=2.14.1",
    # The code of every release below was read: the gradient-collecting loop
    # the seam prepares for is the same in all of them (2.13.0 adds the
    # reduce_scatter_unused_params zero, handled; 2.6.0 lacks torch's own skip
    # of never-gathered parameters, which the seam does not need), and each foreach_reduce
    # copies the gradients into a reduce_dtype buffer after the uniform-dtype
    # assertion.
    fingerprints={
        "2.6.0": "5104529cbae3392f",
        "2.7.0-2.7.1": "fa57c260dac9f670",
        "2.8.0": "9dae58c7e0134d51",
        "2.9.0-2.9.1": "922ec7f91c892f1b",
        "2.10.0-2.11.0": "b633fef1d04c7df9",
        "2.12.0-2.12.1": "b0d870ede32d3a1b",
        "2.13.0": "22385c789e12917e",
        "2.14.0-2.14.1": "1d778f789473dc5b",
    },
    fix=FIX,
    via="uniform",
    what="FSDP2 gradient accumulation (uniform dtype after a partly-used deferred micro-batch)",
    diff="fsdp-param-group-accumulation",
    declared={"<2.6.0": _NO_MODULE, ">=2.15.0": "post_backward " + _REWORKED},
)

GRAD_ACCUMULATION = (GRAD_ACCUM_GUARD, GRAD_ACCUM_UNIFORM)

# torch 2.6-2.12: a checkpointed unit (outside FSDP's hooks, non-reentrant) whose floating input is not
# param_dtype recomputes in another dtype (measured on 2.12.0).  The fingerprints are the fixed code, never patched.
RECOMPUTE_CAST = Target(
    dist="torch", module=FULLY_SHARD + "._fsdp_state", attr="FSDPState._pre_forward", versions="==2.13.0",
    fingerprints={"2.13.0": "a35db4978e460f44", "2.15.0": "aa43e151b41dd487"}, fix=MOE_EXPERTS,
    what="FSDP2 checkpoint recompute skips the mixed-precision input cast", fixed_in=">=2.13.0",
    declared={"<2.6.0": _NO_MODULE}, unsupported={">=2.6.0,<2.13.0": "the recompute skips FSDP2's input cast "
              "(pytorch #159359, fixed in 2.13.0 by PR #182580); upgrade torch, use reentrant checkpointing, or "
              "feed checkpointed units param_dtype inputs (no output_dtype=fp32 policy)"},
    symptom="torch 2.6-2.12, non-reentrant gradient checkpointing with an input not in param_dtype (an "
            "output_dtype=fp32 policy under autocast): `CheckpointError: torch.utils.checkpoint: Recomputed values "
            "for the following tensors have different metadata than during the forward pass`")

# torch 2.8-2.13: a group with no trainable parameter at lazy init keeps no dtypes (pytorch #186998; 2.6-2.7 took
# them from every parameter, 2.14.0 from the floating ones).
FROZEN_DTYPES = Target(
    dist="torch", module=FULLY_SHARD + "._fsdp_param_group", attr="FSDPParamGroup._init_mp_dtypes",
    versions="==2.13.0", fingerprints={"2.8.0-2.9.1": "7b15e29670a6823f", "2.10.0-2.13.0": "09ca147e65651239"},
    fix=FROZEN_FIRST_FORWARD, what="FSDP2 unit first run frozen keeps no mixed-precision dtypes", fixed_in=">=2.14.0",
    declared={"<2.6.0": _NO_MODULE, ">=2.6.0,<2.8.0": "the dtypes come from every parameter, trainable or not"})

# Every release 2.6.0-2.15.0 read: fully_shard(module or list, *, mp_policy=..., ...) and _init_mp_dtypes' uniform
# dtype assertion (fixes.mixed_dtypes) in all; the fingerprints are fully_shard's own code.
MIXED_DTYPE_UNITS = Target(
    dist="torch", module=FULLY_SHARD + "._fully_shard", attr="fully_shard", versions="==2.15.0",
    fingerprints={"2.6.0": "1977f8945bd52dac", "2.7.0-2.7.1": "03ff99ef83ad34c9", "2.8.0-2.9.1": "14825c5fcbe61ca3",
                  "2.10.0": "9ee9d8cc70ef62c9", "2.11.0": "45d48eae9c5b15b9", "2.12.0-2.15.0": "e23014d5048ac974"},
    fix=MIXED_DTYPES, families=("glm4_moe", "glm4v_moe", "deepseek_v2", "deepseek_v3"),
    what="FSDP2 unit mixing fp32-kept routers with bf16 weights", declared={"<2.6.0": _NO_MODULE})

TARGETS = GRAD_ACCUMULATION + (RECOMPUTE_CAST, FROZEN_DTYPES, MIXED_DTYPE_UNITS)
