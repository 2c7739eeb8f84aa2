"""Output heads read outside their unit's forward by TRL's and axolotl's losses: unshard the unit first.

The mechanism is ``fsdp2_compat.fixes.gather``'s (FSDP's own unsharded parameter, ``param_dtype``, its gradient
averaged by the unit's post-backward); the targets (where, which releases) are in ``integrations.trl`` and
``integrations.axolotl``.

TRL (``TRL_HEAD_READS``):
- ``fused_lm_head_seam``: ``trl.trainer.utils:add_fused_lm_head`` (1.15.0+)
  builds a closure per model and installs it on the *instance*
  (``model.forward = types.MethodType(_fused_forward, model)``); nothing at
  module or class level holds that closure, so the seam wraps the installer and
  re-binds what it installed as ``MethodType(FunctionWrapper(_fused_forward,
  ...), model)``.  That stays a real bound method: accelerate's mixed-precision
  wrapping reads ``model.forward.__func__``.  The wrapper gathers the head only
  for ``fused_lm_head=True`` calls; the plain forward is untouched.
- ``student_head_seam``: ``DistillationTrainer._compute_loss`` (1.10.0+) and
  ``AsyncDistillationTrainer._compute_loss`` (1.11.0+) receive the unwrapped
  student first and read ``get_output_embeddings().weight`` into the chunked
  divergence; the wrapper gathers the student's head around the call.  The
  student is the parameter of that name however the method is called
  (``fsdp2_compat.core.calls``: a subclass override calling
  ``DistillationTrainer._compute_loss(self, student, ...)``, ``super()``, a
  re-bound class attribute, keywords).  A call without a student that has an
  output embedding is reported (a WARNING; an error under strict mode), never
  run unfixed in silence.  The teacher is left alone: accelerate prepares it
  without sharding, and its read has no gradient.

axolotl's KD trainer (``KD_HEAD``): ``resolved_head_seam`` wraps ``_resolve_lm_head`` (called right after the
forward, as a module global of ``compute_loss``): the head it returns has its weight unsharded through the FSDP2
unit that manages it (``gather.gather_enclosed``: the root there, or the head's own unit); the root's post-backward
then reduce-scatters (averages) its gradient.  Before the first forward (no unit initialised) the head is left as
it is; under ``no_grad`` the unit stays unsharded until its next forward reshards it (the seam returns a module;
there is no exit to reshard at).

Fails safe: a head whose weight is a plain tensor (no FSDP, or already
unsharded by an enclosing unit's forward) is left as it is; a sharded head that
is not an FSDP2 unit raises ``GatherError`` with the reason.  Models TRL fused
while the patch was on keep the gathering wrapper after a revert (it is correct
on any release).  wrapt and torch are imported when a seam runs, never here.
"""




def _output_head(model):
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if head is not None and hasattr(head, "weight") else None


def _call_with_head_gathered(where, model, role, call):
    """``call()`` with ``model``'s output embedding unsharded through FSDP; ``calls.missing`` when there is none."""
    from ..core import calls
    from .gather import gathered

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


def resolved_head_seam(module, attr):
    """Seam for ``axolotl.integrations.kd.trainer:_resolve_lm_head(model)``: the head it returns has its weight
    unsharded through the FSDP2 unit that manages it (its own, or the root's) before the caller reads it."""
    import wrapt

    from ..core import calls
    from .gather import gather_enclosed

    where = "%s.%s" % (module.__name__, attr)

    def _resolve_then_gather(wrapped, instance, args, kwargs):
        head = wrapped(*args, **kwargs)
        if hasattr(head, "weight"):
            gather_enclosed(head, "weight")
        else:
            calls.missing(where, "an lm_head with a weight (got %s)" % type(head).__name__)
        return head

    return {attr: wrapt.FunctionWrapper(calls.lookup(module, attr), _resolve_then_gather)}
