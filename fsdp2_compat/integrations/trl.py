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

Both are fixed, at two seams: accelerate's grouping (``fsdp2_compat.integrations.accelerate``:
the VLM tail unit gets its decoder's final norm, accelerate 1.14.0-1.15.0) and
TRL's reads (here).  With the grouping fixed, the norm's forward unshards the
tail before TRL reads the head, so TRL's ``isinstance(weight, DTensor)`` test is
false and its read is exact without the targets below (measured: one
``SFTTrainer.train()`` step, untied Qwen2.5-VL, accelerate 1.14.0 and 1.15.0,
``tests/integrations/test_accelerate.py``).  The reader targets stay: they are
right under any grouping (a user's own ``fully_shard(model.lm_head)``, an
accelerate release whose norm search the accelerate target does not know, a
model whose decoder exposes no norm), and they cost nothing when the head is
already unsharded (a plain tensor is left as it is).

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
  The student is the parameter of that name however the method is called
  (``fsdp2_compat.core.calls``): a subclass override calling
  ``DistillationTrainer._compute_loss(self, student, ...)``, ``super()``, a
  re-bound class attribute, keywords.  A call without a student that has an
  output embedding is reported (a WARNING; an error under strict mode), never
  run unfixed in silence.
  (``_chunked_divergence_loss`` gets tensors only, no owner to unshard;
  ``compute_loss`` is decorated, so not fingerprintable.)  The teacher is left
  alone: accelerate prepares it without sharding, and its read has no gradient.

Fails safe: a head whose weight is a plain tensor (no FSDP, the tail already
unsharded, or ``lm_head`` in the root unit as with accelerate <= 1.13) is left
as it is; a sharded head that is not an FSDP2 unit raises ``GatherError`` with
the reason.  Models TRL fused while the patch was on keep the gathering
wrapper after a revert (it is correct on any release).  TRL 1.1.0-1.14.2 read
the head through other functions: recorded below as ``unsupported`` (a
requested patch refuses this target there with a warning, never silently "not
needed").  What the accelerate targets of the same patches do for them: the
forwards TRL installs on the model, ``sft_trainer._patch_chunked_ce_lm_head``
(1.4.0+, ``loss_type="chunked_nll"``) and ``utils.patch_chunked_lm_head``
(async GRPO), run the base model inside the model's forward and then read
``self.lm_head.weight``: with the tail unit fixed they read FSDP's unsharded
parameter and are exact (proven on 1.14.2 with accelerate 1.15.0, set
``trl114``).  Not proven, so still refused: readers that run the backbone
outside the model's forward (1.14.x ``GRPOTrainer._chunked_logps``, the DPO /
KTO ``_get_per_token_logps_and_entropies``) and the 1.1.0-1.13.x GRPO / DPO /
KTO / reward-trainer readers, which were not read one by one.

Upstream: no TRL or accelerate issue yet.  Delete when TRL reads the head
through FSDP (e.g. ``lm_head.unshard()`` before the read) in every release you
run, or every grouping you train under (accelerate's included) unshards the
head before TRL reads it.
"""

from ..core.records import Integration, Target

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
SYMPTOM = ("TRL (accelerate >= 1.14 FSDP2, untied VLM): silently **unaveraged `lm_head` gradient** in the fused "
           "LM head (SFT, GRPO, RLOO, DPO, KTO) and distillation losses")
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
    seam="fsdp2_compat.integrations.trl:fused_lm_head_seam",
    what=_WHAT % "fused LM head: SFT, GRPO, RLOO, DPO, KTO",
    diff="utils-lm-head",
    declared={"<1.1.0": "no add_fused_lm_head and no chunked lm_head reader in trl.trainer.utils"},
    unsupported={">=1.1.0,<1.15.0": _OLDER_READERS},
    symptom=SYMPTOM,
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
    symptom=SYMPTOM,
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
    symptom=SYMPTOM,
)

TARGETS = (FUSED_LM_HEAD, DISTILLATION, ASYNC_DISTILLATION)


# ---------------------------------------------------------------------------
# seams (wrapt and torch are imported when a target module is imported, never here)


def _output_head(model):
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if head is not None and hasattr(head, "weight") else None


def _call_with_head_gathered(where, model, role, call):
    """``call()`` with ``model``'s output embedding unsharded through FSDP; ``calls.missing`` when there is none."""
    from ..core import calls
    from ..fixes.gather import gathered

    head = _output_head(model) if model is not None else None
    if head is None:
        calls.missing(where, "%s with an output embedding (got %s)" % (role, type(model).__name__))
        return call()
    with gathered(head):
        return call()


def wrap_installed_forward(model):
    """Wrap the ``_fused_forward`` that ``add_fused_lm_head`` just bound to ``model``; True when done."""
    import types

    import wrapt

    from ..core.calls import Signature

    bound = model.__dict__.get("forward")
    if not isinstance(bound, types.MethodType) or bound.__self__ is not model:
        return False  # not what TRL installs: leave it
    if isinstance(bound.__func__, wrapt.FunctionWrapper):
        return True
    # named after the target that installed it, so a strict request of that target covers it
    signature = Signature(bound.__func__, "trl.trainer.utils.add_fused_lm_head")

    def _fused_call(wrapped, instance, args, kwargs):
        """Around ``_fused_forward(self, *args, fused_lm_head=False, ...)`` (bound by MethodType)."""
        if not signature.argument("fused_lm_head", instance, args, kwargs):
            return wrapped(*args, **kwargs)  # the model's own forward: lm_head runs as a module
        this = signature.receiver(instance, args, kwargs)
        return _call_with_head_gathered(signature.where, this, "a model (in its fused forward)",
                                        lambda: wrapped(*args, **kwargs))

    model.forward = types.MethodType(wrapt.FunctionWrapper(bound.__func__, _fused_call), model)
    return True


def fused_lm_head_seam(module, attr):
    """Seam for ``trl.trainer.utils:add_fused_lm_head``."""
    import wrapt

    from ..core import calls

    signature = calls.signature_of(module, attr)

    def _install_then_wrap(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        model = signature.argument("model", instance, args, kwargs)
        if model is None or not wrap_installed_forward(model):
            calls.missing(signature.where, "a model whose forward it installed (got %s)" % type(model).__name__)
        return result

    return {attr: wrapt.FunctionWrapper(module.__dict__[attr], _install_then_wrap)}


# The student's parameter of ``_compute_loss``: DistillationTrainer, AsyncDistillationTrainer.
_STUDENT = ("unwrapped_student", "unwrapped_model")


def student_head_seam(module, attr):
    """Seam for ``<distillation module>:<Trainer>._compute_loss`` (``attr`` is ``"Class.method"``).

    Around ``_compute_loss(self, unwrapped_student, ...)``: the student's head is
    gathered however the method was called (``calls``: instance, the class with
    an explicit self, ``super()``, a re-bound descriptor, keywords).
    """
    import wrapt

    from ..core import calls, guards

    signature = calls.signature_of(module, attr)
    names = [n for n in _STUDENT if n in signature.names]
    if not names:
        raise guards.Drift("%s takes no %s" % (signature.where, " or ".join(_STUDENT)))
    student_name = names[0]

    def _student_call(wrapped, instance, args, kwargs):
        student = signature.argument(student_name, instance, args, kwargs)
        return _call_with_head_gathered(signature.where, student, "a student (%s)" % student_name,
                                        lambda: wrapped(*args, **kwargs))

    return {attr: wrapt.FunctionWrapper(calls.lookup(module, attr), _student_call)}
