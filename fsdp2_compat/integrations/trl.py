"""TRL: its loss paths read the output embedding's weight outside ``lm_head``'s forward.

The bug (TRL 1.16.0 + accelerate >= 1.14 + an untied vision-language model): accelerate's ``fsdp2_prepare_model``
gives the output embedding a tail FSDP2 unit ``[final_norm, lm_head]``, with the norm that ``_find_final_norm``
finds among the base model's *direct* children.  A VLM's base model (``Qwen3VLModel``: ``visual``,
``language_model``) has no such child, so the tail is ``[lm_head]`` alone and its forward never runs.  TRL's fused
LM head (``add_fused_lm_head``, used by SFT, GRPO, RLOO, DPO, KTO and async GRPO) and its distillation losses then
read ``lm_head.weight`` while it is still a sharded ``DTensor`` and call ``full_tensor()``, whose backward only
slices: each rank trains ``lm_head`` on its own micro-batch gradient, never the data-parallel average (every other
parameter is averaged).  Nothing crashes. Text models are right: their tail holds the norm, whose forward unshards
the group before TRL reads the head.

The fix (``fsdp2_compat.fixes.gather``): unshard the head's owning FSDP unit before TRL reads it.  TRL's
``isinstance(weight, DTensor)`` test is then false, TRL uses FSDP's unsharded ``param_dtype`` parameter, and FSDP's
own post-backward reduce-scatters (averages) its gradient.  TRL's math is not touched.

Both are fixed, at two seams: accelerate's grouping (``fsdp2_compat.integrations.accelerate``: the VLM tail unit
gets its decoder's final norm, accelerate 1.14.0-1.15.0) and TRL's reads (here).  With the grouping fixed, the
norm's forward unshards the tail before TRL reads the head, so TRL's ``isinstance(weight, DTensor)`` test is false
and its read is exact without the targets below (measured: one ``SFTTrainer.train()`` step, untied Qwen2.5-VL,
accelerate 1.14.0 and 1.15.0, ``tests/integrations/test_accelerate.py``).  The reader targets stay: they are right
under any grouping (a user's own ``fully_shard(model.lm_head)``, an accelerate release whose norm search the
accelerate target does not know, a model whose decoder exposes no norm), and they cost nothing when the head is
already unsharded (a plain tensor is left as it is).

Seams (``fsdp2_compat.fixes.head_reads``): ``trl.trainer.utils:add_fused_lm_head`` (1.15.0+: the forward it
installs on the instance is re-bound through a gathering wrapper), ``DistillationTrainer._compute_loss`` (1.10.0+)
and ``AsyncDistillationTrainer._compute_loss`` (1.11.0+): the student's head is gathered around the call.
(``_chunked_divergence_loss`` gets tensors only, no owner to unshard; ``compute_loss`` is decorated, so not
fingerprintable.) Callers import the installer by name (``INTEGRATION.callers``): the engine rebinds them.

Fails safe (``fixes.head_reads``): a head whose weight is a plain tensor (no FSDP, the tail already unsharded, or
``lm_head`` in the root unit as with accelerate <= 1.13) is left as it is.  TRL 1.1.0-1.14.2 read the head through
other functions: recorded below as ``unsupported`` (a requested patch refuses this target there with a warning,
never silently "not needed").  What the accelerate targets of the same patches do for them: the forwards TRL
installs on the model, ``sft_trainer._patch_chunked_ce_lm_head`` (1.4.0+, ``loss_type="chunked_nll"``) and
``utils.patch_chunked_lm_head`` (async GRPO), run the base model inside the model's forward and then read
``self.lm_head.weight``: with the tail unit fixed they read FSDP's unsharded parameter and are exact (proven on
1.14.2 with accelerate 1.15.0, set ``trl114``).  Not proven, so still refused: readers that run the backbone
outside the model's forward (1.14.x ``GRPOTrainer._chunked_logps``, the DPO / KTO
``_get_per_token_logps_and_entropies``) and the 1.1.0-1.13.x GRPO / DPO / KTO / reward-trainer readers, which were
not read one by one.

Upstream: no TRL or accelerate issue yet.  Delete when TRL reads the head
through FSDP (e.g. ``lm_head.unshard()`` before the read) in every release you
run, or every grouping you train under (accelerate's included) unshards the
head before TRL reads it.
"""

from ..core.records import Integration, Target
from ..fixes import TRL_HEAD_READS

INTEGRATION = Integration(
    dist="trl",
    package="trl",
    # TRL does not wrap the training model itself: accelerate's
    # ``accelerate.utils.fsdp_utils.fsdp2_prepare_model`` does (Trainer -> Accelerator.prepare),
    # patched in ``fsdp2_compat.integrations.accelerate``.  No ``apply_fsdp2`` here, hence None.
    wrap_module=None,
    callers=(  # modules that import ``add_fused_lm_head`` by name (1.15.0-1.16.0)
        "trl.trainer",
        "trl.trainer.sft_trainer",
        "trl.trainer.grpo_trainer",
        "trl.trainer.rloo_trainer",
        "trl.trainer.dpo_trainer",
        "trl.trainer.kto_trainer",
        "trl.experimental.async_grpo.async_grpo_trainer",
    ),
)

_PROVEN = "==1.16.0"
_WHAT = "TRL reads lm_head.weight outside its forward (%s)"
_OLDER_READERS = (
    "no add_fused_lm_head; this release reads lm_head.weight through patch_chunked_lm_head (from 1.4.0 also "
    "sft_trainer._patch_chunked_ce_lm_head; in 1.14.x also GRPOTrainer._chunked_logps and the DPO/KTO "
    "_get_per_token_logps_and_entropies): not covered by fsdp2-compat yet (the two chunked forwards are exact "
    "under accelerate 1.14.0-1.15.0 with the same patch's accelerate targets; the other readers are not proven)"
)

FUSED_LM_HEAD = Target(
    dist="trl",
    module="trl.trainer.utils",
    attr="add_fused_lm_head",
    versions=_PROVEN,
    fingerprints={"1.15.0": "e99a1161fdc09cb5", "1.16.0": "27301e73e4ace4f2"},
    fix=TRL_HEAD_READS,
    via="fused LM head",
    what=_WHAT % "fused LM head: SFT, GRPO, RLOO, DPO, KTO",
    diff="utils-lm-head",
    declared={"<1.1.0": "no add_fused_lm_head and no chunked lm_head reader in trl.trainer.utils"},
    unsupported={">=1.1.0,<1.15.0": _OLDER_READERS},
)

DISTILLATION = Target(
    dist="trl",
    module="trl.trainer.distillation_trainer",
    attr="DistillationTrainer._compute_loss",
    versions=_PROVEN,
    fingerprints={
        "1.10.0": "32d259b364cf1ae8",
        "1.11.0-1.12.0": "6e92ad8036497c6d",
        "1.13.0-1.14.2": "e42ab5fb5269a2f1",
        "1.15.0": "b6d093abddd09d57",
        "1.16.0": "0f672cd3581e18e4",
    },
    fix=TRL_HEAD_READS,
    via="student",
    what=_WHAT % "distillation loss",
    diff="distillation_trainer-lm-head",
    declared={"<1.10.0": "no DistillationTrainer in trl.trainer.distillation_trainer"},
)

ASYNC_DISTILLATION = Target(
    dist="trl",
    module="trl.experimental.async_distillation.async_distillation_trainer",
    attr="AsyncDistillationTrainer._compute_loss",
    versions=_PROVEN,
    fingerprints={
        "1.11.0-1.12.0": "c379d2a8deaac833",
        "1.13.0-1.14.2": "2867d9cab669712d",
        "1.15.0-1.16.0": "ce732824c63683ef",
    },
    fix=TRL_HEAD_READS,
    via="student",
    what=_WHAT % "async distillation loss",
    diff="async_distillation_trainer-lm-head",
    declared={"<1.11.0": "no trl.experimental.async_distillation"},
)

TARGETS = (FUSED_LM_HEAD, DISTILLATION, ASYNC_DISTILLATION)
