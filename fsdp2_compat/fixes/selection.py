"""Which submodules get their own FSDP2 group: the corrected rule.

Upstream (verl, SkyRL) shards every untied ``nn.Embedding`` in a group of its
own.  That is right for the token embedding, which is only ever *called*, but
wrong for auxiliary tables such as GLM4V's vision ``position_embedding``,
whose ``weight`` is read directly by the parent module's forward; FSDP2 has
not unsharded it there, so the read sees a sharded ``DTensor``:

    RuntimeError: aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor

The corrected rule (SkyRL PR #2088, issue #2087): a module gets its own group
if its class name is a configured layer class, or it is
``model.get_input_embeddings()`` and the embeddings are untied.  Every other
parameter, auxiliary embeddings included, stays in the root group, which is
unsharded for the whole root forward, so raw reads are safe.

Tying is decided by parameter identity, never by config flags (transformers
versions disagree on which flag counts; see UPSTREAM.md "Tied embeddings").

Seams here: ``verl_seam`` (verl 0.7.1+'s ``_select_fsdp2_wrap_targets``, replaced
by ``select_verl``) and ``layer_class_seam`` (LLaMA-Factory's
``get_transformer_layer_cls`` with a set ``_no_split_modules``: upstream's
list rule, ``first_listed_class``).  The inline loops (verl 0.4.0-0.7.0,
SkyRL, AReaL, LLaMA-Factory's engine, lmms-engine) take the same rule through
``inline_selection``.

Fails safe: the rule only computes a list; the seams that install it are
gated on the fingerprint of the upstream function they replace (the
integrations' targets; ``core.policy``), and refused with a reason otherwise.

Delete when: every verl / SkyRL release you run selects its FSDP2 units this
way (SkyRL PR #2088 merged and released; verl has no fix yet).

torch is imported lazily; nothing here runs at import.
"""


def layer_class_names(layer_classes):
    """Normalise a layer-class selection (str, list, tuple, set, None) to a frozenset."""
    if layer_classes is None:
        return frozenset()
    if isinstance(layer_classes, str):
        return frozenset([layer_classes])
    names = set()
    for item in layer_classes:
        if item is None:
            continue
        names.add(item if isinstance(item, str) else getattr(item, "__name__", str(item)))
    return frozenset(names)


def base_module(module):
    """Look through PEFT wrappers to the module that owns the weight.

    ``ModulesToSaveWrapper`` keeps the original in ``original_module``;
    LoRA layers (``BaseTunerLayer``) expose ``get_base_layer()``.
    """
    seen = 0
    while module is not None and seen < 8:
        seen += 1
        if hasattr(module, "get_base_layer"):
            inner = module.get_base_layer()
        else:
            inner = getattr(module, "original_module", None)
        if inner is None or inner is module:
            return module
        module = inner
    return module


def _weight(module):
    import torch

    if module is None:
        return None
    for candidate in (module, base_module(module)):
        weight = getattr(candidate, "weight", None)
        if isinstance(weight, torch.Tensor):
            return weight
    return None


def _call_optional(model, method):
    getter = getattr(model, method, None)
    if getter is None:
        return None
    try:
        return getter()
    except (NotImplementedError, AttributeError):
        return None


def input_embedding(model):
    """``model.get_input_embeddings()``, or ``None`` if the model has none."""
    return _call_optional(model, "get_input_embeddings")


def embeddings_tied(model):
    """True when the input and output embeddings share one weight tensor.

    Models without either embedding are untied.  A tensor shared through a
    PEFT wrapper counts as tied.
    """
    w_in = _weight(input_embedding(model))
    w_out = _weight(_call_optional(model, "get_output_embeddings"))
    if w_in is None or w_out is None:
        return False
    if w_in is w_out:
        return True
    # Same storage under two Parameter objects (rare, but e.g. after manual tying).
    try:
        return w_in.data_ptr() == w_out.data_ptr() and w_in.data_ptr() != 0 and w_in.shape == w_out.shape
    except RuntimeError:  # meta tensors / DTensors have no data pointer
        return False


def select_wrap_targets(model, layer_classes, extra=None):
    """Modules to ``fully_shard`` before the root, outermost first.

    ``layer_classes``: class names (str, list, tuple or set) or classes.
    Returns layer-class modules, plus the input embedding when untied.
    ``extra(name, module)`` may select more modules (verl's by-name groups).
    The root itself is never included, and a module inside an already
    selected one is left to it: ``_no_split_modules`` sometimes names a layer
    *and* its attention (Qwen2-Audio, AudioFlamingo3), and FSDP2 refuses to
    shard a parameter that an outer group already sharded.
    """
    names = layer_class_names(layer_classes)
    embedding = None if embeddings_tied(model) else input_embedding(model)
    chosen, seen = [], set()

    def visit(prefix, module, inside):
        for child_name, child in module.named_children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            name = prefix + child_name
            picked = not inside and (
                type(child).__name__ in names or child is embedding or (extra is not None and bool(extra(name, child)))
            )
            if picked:
                chosen.append(child)
            visit(name + ".", child, inside or picked)

    visit("", model, False)
    return chosen


def auxiliary_embeddings(model):
    """``nn.Embedding`` modules that are not the input embedding (they stay in root)."""
    import torch.nn as nn

    embedding = input_embedding(model)
    # Everything inside the input embedding (PEFT keeps copies there) is not auxiliary.
    keep = {id(m) for m in embedding.modules()} if embedding is not None else set()
    return [m for m in model.modules() if isinstance(m, nn.Embedding) and id(m) not in keep]


# verl 0.7.1+ also gives ``embed_tokens`` / ``lm_head`` their own groups by
# leaf name, because PEFT's ModulesToSaveWrapper hides the nn.Embedding type.
# That part of verl's memory plan is kept as is.
_VERL_NAMED = ("embed_tokens", "lm_head")


def select_verl(model, layer_classes):
    """verl's selection with auxiliary embeddings left in the root group.

    Same as ``select_wrap_targets`` plus verl's by-name ``embed_tokens`` /
    ``lm_head`` groups when the embeddings are untied (decided by identity).
    """

    def by_name(name, module):
        return name.rsplit(".", 1)[-1] in _VERL_NAMED and hasattr(module, "weight")

    return select_wrap_targets(model, layer_classes, extra=None if embeddings_tied(model) else by_name)


def verl_seam(module, attr):
    """Seam for verl 0.7.1+'s ``_select_fsdp2_wrap_targets(model, fsdp_transformer_layer_cls_to_wrap)``."""
    import wrapt

    from ..core import calls

    signature = calls.signature_of(module, attr)  # (model, fsdp_transformer_layer_cls_to_wrap), fingerprinted

    def _select_fsdp2_wrap_targets(wrapped, instance, args, kwargs):
        return select_verl(signature.argument("model", instance, args, kwargs),
                           signature.argument("fsdp_transformer_layer_cls_to_wrap", instance, args, kwargs))

    return {attr: wrapt.FunctionWrapper(module.__dict__[attr], _select_fsdp2_wrap_targets)}


def first_listed_class(model, names):
    """Upstream's list rule for any collection of names: the class of the first listed module met, or None."""
    wanted = layer_class_names(names)
    for _, sub in model.named_modules():
        if type(sub).__name__ in wanted:
            return type(sub)
    return None


def layer_class_seam(module, attr):
    """Seam for LLaMA-Factory's ``get_transformer_layer_cls(model)``: a set / frozenset ``_no_split_modules``
    follows upstream's list rule (transformers 5.x keeps a set; 0.9.5 indexes it like a list and finds nothing)."""
    import wrapt

    from ..core import calls

    signature = calls.signature_of(module, attr)

    def get_transformer_layer_cls(wrapped, instance, args, kwargs):
        model = signature.argument("model", instance, args, kwargs)
        names = getattr(model, "_no_split_modules", None)
        if isinstance(names, (set, frozenset)) and names:
            found = first_listed_class(model, names)
            if found is not None:
                return found
        return wrapped(*args, **kwargs)  # lists, tuples, None, no match: upstream's own code

    return {attr: wrapt.FunctionWrapper(module.__dict__[attr], get_transformer_layer_cls)}
