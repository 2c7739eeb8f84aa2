"""Correct the wrap selection of an upstream ``apply_fsdp2`` that has it inline.

verl 0.4.0-0.7.0 and every SkyRL / skyrl-train release select their FSDP2
groups in a loop inside ``apply_fsdp2`` and then call the module-global
``fully_shard`` once per selected module and once for the root.  There is no
function to swap for the selection alone, so the narrowest seam is the
``fully_shard`` name that loop calls:

- ``apply_fsdp2`` is wrapped only to publish the model being sharded (in a
  context variable, so concurrent calls on other threads are unaffected): its
  ``model`` argument, found by name however it is passed (``core.calls``; the
  same wrapper serves LLaMA-Factory's method ``FSDP2Engine.prepare_model(self,
  model)`` under every calling convention).  A call whose ``model`` is no
  ``nn.Module`` runs upstream's selection and is reported (a WARNING; an error
  under strict mode);
- ``fully_shard`` is wrapped to consult that plan: a call for an
  ``nn.Embedding`` the corrected rule does not select is skipped (its weights
  stay in the root group), and before the root call an untied input embedding
  that upstream skipped (config flag said "tied", weights say otherwise) gets
  its own group.  A module inside one that already got a group in this call
  is skipped too (``_no_split_modules`` that names a layer and its attention).  Every other call goes to torch unchanged, with upstream's own
  arguments, inside upstream's own code (``maybe_patch_fsdp_module`` etc.).

Outside an ``apply_fsdp2`` call the ``fully_shard`` wrapper is a pass-through.

Upstream: SkyRL issue #2087 / PR #2088 (the same selection rule for SkyRL).
Fails safe: installed only when ``apply_fsdp2``'s source fingerprint is one of
the released versions this seam was verified on and ``fully_shard`` is a
module global; both swaps and every alias change together or not at all, and
revert restores the original objects by identity.
Delete when: the release's ``apply_fsdp2`` selects only layer classes and the
untied input embedding (the fingerprint then changes and the seam skips itself).
"""

import contextvars

_plan = contextvars.ContextVar("fsdp2_compat_inline_plan", default=None)


class _Plan:
    __slots__ = ("model", "embedding", "embedding_done", "parents", "wrapped", "layer_classes")

    def __init__(self, model):
        from .selection import embeddings_tied, input_embedding, layer_class_names

        self.model = model
        self.embedding = None if embeddings_tied(model) else input_embedding(model)
        self.embedding_done = False
        self.parents = {}  # id(child) -> parent module
        for parent in model.modules():
            for child in parent.children():
                self.parents.setdefault(id(child), parent)
        self.wrapped = set()  # ids of modules given a group during this call
        # An embedding class named as a layer class is upstream's choice, not
        # the embedding rule: keep it (config overrides of the list are not
        # visible here; the model's default list is).
        self.layer_classes = layer_class_names(getattr(model, "_no_split_modules", None))

    def inside_wrapped(self, module):
        """True when an ancestor already got its own group in this call."""
        parent = self.parents.get(id(module))
        while parent is not None and parent is not self.model:
            if id(parent) in self.wrapped:
                return True
            parent = self.parents.get(id(parent))
        return False


def wrap_apply_fsdp2(original):
    """Wrap upstream ``apply_fsdp2(model, fsdp_kwargs, config)`` (or a method ``prepare_model(self, model)``).

    The model is the argument named ``model`` however the call passed it
    (``core.calls``); a call without an ``nn.Module`` there runs upstream's
    selection unchanged, and says so (``calls.missing``).
    """
    import torch.nn as nn
    import wrapt

    from ..core import calls

    signature = calls.Signature(original)

    def apply_fsdp2(wrapped, instance, args, kwargs):
        model = signature.argument("model", instance, args, kwargs)
        if not isinstance(model, nn.Module):
            calls.missing(signature.where, "an nn.Module as its model (got %s)" % type(model).__name__)
            return wrapped(*args, **kwargs)
        token = _plan.set(_Plan(model))
        try:
            return wrapped(*args, **kwargs)
        finally:
            _plan.reset(token)

    return wrapt.FunctionWrapper(original, apply_fsdp2)


def wrap_fully_shard(original):
    """Wrap the ``fully_shard`` global that upstream's loop calls."""
    import torch.nn as nn
    import wrapt

    from ..core import calls

    signature = calls.Signature(original)

    def fully_shard(wrapped, instance, args, kwargs):
        plan = _plan.get()
        if plan is None:
            return wrapped(*args, **kwargs)
        module = signature.argument("module", instance, args, kwargs)
        if not isinstance(module, nn.Module):
            return wrapped(*args, **kwargs)  # a list of modules: upstream's loops never pass one
        if module is plan.model:
            if plan.embedding is not None and not plan.embedding_done and not plan.inside_wrapped(plan.embedding):
                plan.embedding_done = True
                # the root call's own arguments, the module (by position or keyword) replaced
                rest = {k: v for k, v in kwargs.items() if k != "module"}
                wrapped(plan.embedding, *args[1:], **rest)
            return wrapped(*args, **kwargs)
        if plan.inside_wrapped(module):
            return module  # nested layer class: its ancestor's group already holds it
        if module is plan.embedding:
            plan.embedding_done = True
        elif isinstance(module, nn.Embedding) and type(module).__name__ not in plan.layer_classes:
            return module  # auxiliary (or tied) embedding: stays in the root group
        plan.wrapped.add(id(module))
        return wrapped(*args, **kwargs)

    return wrapt.FunctionWrapper(original, fully_shard)


def _replacements(module, attr, original, hint=""):
    """``{attr: wrapper of original, "fully_shard": filtered fully_shard}``; ``Drift`` without a module-global
    ``fully_shard``."""
    from ..core.guards import Drift

    fully_shard = module.__dict__.get("fully_shard")
    if fully_shard is None or not callable(fully_shard):
        raise Drift("%s has no module-global fully_shard%s" % (module.__name__, hint))
    return {attr: wrap_apply_fsdp2(original), "fully_shard": wrap_fully_shard(fully_shard)}


def seam(module, attr="apply_fsdp2"):
    """Replacements for a module that defines ``apply_fsdp2`` and imports ``fully_shard``."""
    return _replacements(module, attr, module.__dict__[attr], " (torch < 2.4?)")


def method_seam(module, attr):
    """The same for an inline loop in a method (LLaMA-Factory's ``FSDP2Engine.prepare_model``): the method
    (``attr`` is ``"Class.method"``, read from the class ``__dict__``) and the module-global ``fully_shard``."""
    owner, _, name = attr.rpartition(".")
    return _replacements(module, attr, module.__dict__[owner].__dict__[name])
