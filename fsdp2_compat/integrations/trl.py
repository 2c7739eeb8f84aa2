"""TRL: its loss paths read the output embedding's weight outside ``lm_head``'s forward.

The bug (TRL 1.16.0 + accelerate >= 1.14 + an untied vision-language model):
accelerate's ``fsdp2_prepare_model`` gives the output embedding a tail FSDP2
unit ``[final_norm, lm_head]``, with the norm that ``_find_final_norm`` finds
among the base model's *direct* children.  A VLM's base model
(``Qwen3VLModel``: ``visual``, ``language_model``) has no such child, so the
tail is ``[lm_head]`` alone and its forward never runs.  TRL's fused LM head
(``add_fused_lm_head``, used by SFT, GRPO, RLOO, DPO, KTO and async GRPO) and
its distillation losses then read ``lm_head.weight`` while it is still a
sharded ``DTensor`` and call ``full_tensor()``, whose backward only slices:
each rank trains ``lm_head`` on its own micro-batch gradient, never the
data-parallel average (every other parameter is averaged).  Nothing crashes.
Text models are right: their tail holds the norm, whose forward unshards the
group before TRL reads the head.

The fix (``fsdp2_compat.fixes.gather``): unshard the head's owning FSDP unit
before TRL reads it.  TRL's ``isinstance(weight, DTensor)`` test is then
false, TRL uses FSDP's unsharded ``param_dtype`` parameter, and FSDP's own
post-backward reduce-scatters (averages) its gradient.  TRL's math is not
touched.

Why the seam is TRL's read, not accelerate's grouping: the project's rule is
that a raw read of a sharded parameter goes through the unit that owns it.
accelerate's grouping is a legitimate memory plan (a head alone in its unit
is what any user ``fully_shard(model.lm_head)`` gives too), and a fix at the
reader is right under any grouping and any accelerate release.  The
alternative, ``accelerate.utils.fsdp_utils._find_final_norm`` also searching
``model.get_decoder()`` so a VLM's tail becomes ``[language_model.norm,
lm_head]`` (one small function, accelerate 1.14.0-1.15.0), also makes TRL's
reads exact, but it changes the FSDP grouping of every accelerate FSDP2 VLM
user, relies on the norm's forward running before every read, and leaves any
other grouping broken; it is not what we change.

Seams:
- ``trl.trainer.utils:add_fused_lm_head`` (1.15.0+).  It builds a closure per
  model and installs it on the *instance* (``model.forward =
  types.MethodType(_fused_forward, model)``); nothing at module or class level
  holds that closure, so the seam wraps the installer and re-binds what it
  installed as ``MethodType(FunctionWrapper(_fused_forward, ...), model)``.
  That stays a real bound method: accelerate's mixed-precision wrapping reads
  ``model.forward.__func__``.  The wrapper gathers the head only for
  ``fused_lm_head=True`` calls; the plain forward is untouched.  Callers import
  the installer by name (``INTEGRATION.callers``): the engine rebinds them.
- ``DistillationTrainer._compute_loss`` (1.10.0+) and
  ``AsyncDistillationTrainer._compute_loss`` (1.11.0+): both receive the
  unwrapped student first and read ``get_output_embeddings().weight`` into the
  chunked divergence; the wrapper gathers the student's head around the call.
  (``_chunked_divergence_loss`` gets tensors only, no owner to unshard;
  ``compute_loss`` is decorated, so not fingerprintable.)  The teacher is left
  alone: accelerate prepares it without sharding, and its read has no gradient.

Fails safe: a head whose weight is a plain tensor (no FSDP, the tail already
unsharded, or ``lm_head`` in the root unit as with accelerate <= 1.13) is left
as it is; a sharded head that is not an FSDP2 unit raises ``GatherError`` with
the reason.  Models TRL fused while the patch was on keep the gathering
wrapper after a revert (it is correct on any release).  TRL 1.1.0-1.14.2 read
the head through other functions (``_patch_chunked_ce_lm_head``,
``patch_chunked_lm_head``, in 1.14.x also GRPO/DPO/KTO's chunked log-probs):
recorded below as ``unsupported``: a requested patch is refused there with a
warning that says so, never silently "not needed".

Upstream: no TRL or accelerate issue yet.  Delete when TRL reads the head
through FSDP (e.g. ``lm_head.unshard()`` before the read) in every release you
run, or accelerate never leaves a head alone in a unit whose forward does not
run.
"""

from ..core.records import Integration, Target

INTEGRATION = Integration(
    dist="trl",
    package="trl",
    # TRL does not wrap the training model itself: accelerate's
    # ``accelerate.utils.fsdp_utils.fsdp2_prepare_model`` does (Trainer -> Accelerator.prepare),
    # and that is not patched.  No ``apply_fsdp2`` here, hence None.
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
    "_get_per_token_logps_and_entropies): not covered by fsdp2-compat yet"
)

FUSED_LM_HEAD = Target(
    dist="trl",
    module="trl.trainer.utils",
    attr="add_fused_lm_head",
    versions=_PROVEN,
    fingerprints={"1.15.0": "e99a1161fdc09cb5", "1.16.0": "27301e73e4ace4f2"},
    seam="fsdp2_compat.integrations.trl:fused_lm_head_seam",
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
    seam="fsdp2_compat.integrations.trl:student_head_seam",
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
    seam="fsdp2_compat.integrations.trl:student_head_seam",
    what=_WHAT % "async distillation loss",
    diff="async_distillation_trainer-lm-head",
    declared={"<1.11.0": "no trl.experimental.async_distillation"},
)

TARGETS = (FUSED_LM_HEAD, DISTILLATION, ASYNC_DISTILLATION)


# ---------------------------------------------------------------------------
# seams (wrapt and torch are imported when a target module is imported, never here)


def _output_head(model):
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if head is not None and hasattr(head, "weight") else None


def _call_with_head_gathered(model, call):
    from ..fixes.gather import gathered

    head = _output_head(model) if model is not None else None
    if head is None:
        return call()
    with gathered(head):
        return call()


def _fused_call(wrapped, instance, args, kwargs):
    """Around TRL's ``_fused_forward(self, *args, fused_lm_head=False, ...)`` (bound by MethodType: self is args[0])."""
    if not kwargs.get("fused_lm_head"):
        return wrapped(*args, **kwargs)  # the model's own forward: lm_head runs as a module
    model = instance if instance is not None else (args[0] if args else None)
    return _call_with_head_gathered(model, lambda: wrapped(*args, **kwargs))


def wrap_installed_forward(model):
    """Wrap the ``_fused_forward`` that ``add_fused_lm_head`` just bound to ``model``; True when done."""
    import types

    import wrapt

    bound = model.__dict__.get("forward")
    if not isinstance(bound, types.MethodType) or bound.__self__ is not model:
        return False  # not what TRL installs: leave it
    if isinstance(bound.__func__, wrapt.FunctionWrapper):
        return True
    model.forward = types.MethodType(wrapt.FunctionWrapper(bound.__func__, _fused_call), model)
    return True


def _install_then_wrap(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    model = args[0] if args else kwargs.get("model")
    if model is not None:
        wrap_installed_forward(model)
    return result


def fused_lm_head_seam(module, attr):
    """Seam for ``trl.trainer.utils:add_fused_lm_head``."""
    import wrapt

    return {attr: wrapt.FunctionWrapper(module.__dict__[attr], _install_then_wrap)}


def _student_call(wrapped, instance, args, kwargs):
    """Around ``_compute_loss(self, unwrapped_student, ...)``: gather the student's head."""
    student = args[0] if args else kwargs.get("unwrapped_student", kwargs.get("unwrapped_model"))
    return _call_with_head_gathered(student, lambda: wrapped(*args, **kwargs))


def student_head_seam(module, attr):
    """Seam for ``<distillation module>:<Trainer>._compute_loss`` (``attr`` is ``"Class.method"``)."""
    import wrapt

    cls_name, _, method = attr.partition(".")
    return {attr: wrapt.FunctionWrapper(module.__dict__[cls_name].__dict__[method], _student_call)}
