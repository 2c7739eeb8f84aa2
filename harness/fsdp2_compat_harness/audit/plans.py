"""Wrap plans: which modules get their own FSDP2 unit under each framework's rule.

``plan_modules(model, plan)`` computes the units of ``verl``, ``areal`` and
``llamafactory`` (what the installed release selects, unpatched), ``skyrl``,
``fixed`` (fsdp2-compat's rule), ``fixed-verl``, ``hyperparallel`` or an
explicit list of module names.
"""

from .findings import AuditInputError

PLANS = ("verl", "skyrl", "areal", "llamafactory", "fixed", "fixed-verl", "hyperparallel")
SWEEP_PLANS = ("verl", "skyrl", "areal", "llamafactory", "fixed", "hyperparallel")
UPSTREAM_PLANS = ("verl", "skyrl", "areal", "llamafactory")  # the plans fsdp2-compat's selection patches change
INSTALLED_PLANS = ("verl", "areal", "llamafactory")  # computed from the installed release


def layer_classes_of(model):
    """``model._no_split_modules`` as a sorted list (a set in transformers 5.x, a list in 4.x)."""
    return sorted(n for n in (getattr(model, "_no_split_modules", None) or ()) if n)


def module_names(model):
    return {id(m): name for name, m in model.named_modules()}


def _unwrapped(fn):
    """The upstream function under any wrapt wrapper (fsdp2-compat's seams are wrapt wrappers)."""
    seen = 0
    # wrapt's C and Python proxies share the base class name ObjectProxy (wrapt 1.x and 2.x).
    while seen < 8 and hasattr(fn, "__wrapped__") and any(c.__name__ == "ObjectProxy" for c in type(fn).__mro__):
        fn = fn.__wrapped__
        seen += 1
    return fn


def _verl_selection(model, layer_classes):
    """What the installed verl's ``apply_fsdp2`` selects, unpatched: (modules, description)."""
    from fsdp2_compat.core import guards

    version = guards.installed_version("verl")
    if version is None:
        raise AuditInputError("plan 'verl' needs verl installed (it computes what the installed release selects)")
    fn = None
    if guards.in_range(version, ">=0.7.1"):
        from verl.utils import fsdp_utils

        fn = fsdp_utils.__dict__.get("_select_fsdp2_wrap_targets")
    if fn is not None:
        # verl 0.8.0+ turns a set into a list before the call; 0.7.1 passes the list.
        return list(_unwrapped(fn)(model, list(layer_classes))), "verl %s _select_fsdp2_wrap_targets" % version
    import torch.nn as nn

    # verl 0.4.0-0.7.0: the inline loop of apply_fsdp2, reproduced.
    tie = _tie_flag(model, "verl %s's apply_fsdp2" % version)
    chosen = [
        m for _, m in model.named_modules()
        if type(m).__name__ in layer_classes or (isinstance(m, nn.Embedding) and not tie)
    ]
    return chosen, "verl %s inline apply_fsdp2 rule" % version


def _tie_flag(model, who):
    """``model.config.tie_word_embeddings``, read as upstream reads it (no default)."""
    if not hasattr(model.config, "tie_word_embeddings"):
        raise AuditInputError(
            "%s reads model.config.tie_word_embeddings without a default, and this %s has no top-level "
            "tie_word_embeddings: upstream raises AttributeError before sharding anything (not an FSDP2 "
            "hazard; no patch changes it). A config.json that carries the key (--config-json) gets past it"
            % (who, type(model.config).__name__))
    return model.config.tie_word_embeddings


def _skyrl_selection(model, layer_classes):
    """SkyRL / skyrl-train (every release): layer classes, plus every nn.Embedding when untied by config."""
    import torch.nn as nn

    tie = _tie_flag(model, "SkyRL's apply_fsdp2")
    return [
        m for _, m in model.named_modules()
        if type(m).__name__ in layer_classes or (isinstance(m, nn.Embedding) and not tie)
    ]


def _known_code(dist, target):
    """The installed ``dist``'s version when its code at ``target`` is code this audit knows (else input error).

    Read from the installed file (no import): the rule reproduced or called below
    is the one of the releases with these fingerprints.
    """
    import importlib.util

    from fsdp2_compat.core import guards

    version = guards.installed_version(dist)
    if version is None:
        raise AuditInputError("plan %r needs %s installed (it computes what the installed release selects)"
                              % (dist, dist))
    spec = importlib.util.find_spec(target.module)
    try:
        with open(spec.origin, encoding="utf-8") as f:
            found = guards.fingerprint_source(f.read(), target.attr)
    except (AttributeError, TypeError, OSError, LookupError, SyntaxError) as exc:
        raise AuditInputError("plan %r: cannot read %s.%s of %s %s (%s)" % (dist, target.module, target.attr, dist,
                                                                            version, exc)) from None
    if found not in target.fingerprints.values():
        raise AuditInputError("plan %r: %s %s's %s has fingerprint %s, not the code of %s: unknown to this audit"
                              % (dist, dist, version, target.attr, found, ", ".join(target.fingerprints)))
    return version


def _areal_selection(model, layer_classes):
    """AReaL 1.0.4 ``apply_fsdp2`` (inline, from verl): layer classes by name, plus every nn.Embedding
    when ``model.config.tie_word_embeddings`` is false (read without a default)."""
    import torch.nn as nn

    from fsdp2_compat.integrations import areal

    _known_code("areal", areal.WRAP_SELECTION)
    tie = model.config.tie_word_embeddings
    return [
        m for _, m in model.named_modules()
        if type(m).__name__ in layer_classes or (isinstance(m, nn.Embedding) and not tie)
    ]


def llamafactory_layer_class(model):
    """The one layer class the installed LLaMA-Factory's ``get_transformer_layer_cls`` picks, unpatched."""
    from fsdp2_compat.integrations import llamafactory

    _known_code("llamafactory", llamafactory.LAYER_CLASS_LOOKUP)
    from llamafactory.v1.plugins.trainer_plugins.distributed import fsdp2

    return _unwrapped(fsdp2.get_transformer_layer_cls)(model)


def _llamafactory_selection(model):
    """LLaMA-Factory 0.9.5 ``FSDP2Engine.prepare_model``: with LoRA layers, every leaf with a trainable
    parameter first; then modules of exactly the one class ``get_transformer_layer_cls`` returns (none on
    transformers 5.x for VLMs: it ignores a set), plus every nn.Embedding unless
    ``getattr(model.config, "tie_word_embeddings", True)``.  ``--layer-classes`` does not apply."""
    import torch.nn as nn
    from peft.tuners.lora import LoraLayer  # LLaMA-Factory's fsdp2.py imports it: installed with it

    from fsdp2_compat.integrations import llamafactory

    _known_code("llamafactory", llamafactory.WRAP_SELECTION)
    layer_cls = llamafactory_layer_class(model)
    chosen = []
    if any(isinstance(m, LoraLayer) for m in model.modules()):
        chosen += [m for m in model.modules()
                   if not list(m.children()) and any(p.requires_grad for p in m.parameters(recurse=False))]
    untied_flag = not getattr(model.config, "tie_word_embeddings", True)
    chosen += [m for _, m in model.named_modules()
               if (layer_cls is not None and type(m) is layer_cls) or (isinstance(m, nn.Embedding) and untied_flag)]
    return chosen


def _hyperparallel_selection(model):
    """HyperParallel ``FSDP2Manager._find_transformer_block_modules``: every grandchild of a
    module that has a ``gradient_checkpointing`` attribute (a module already picked is not
    searched as a container again).  HyperParallel names a block ``<child>.<index>``; the
    real module names are returned here."""
    chosen, picked = [], set()
    for _, container in model.named_modules():
        if id(container) in picked or not hasattr(container, "gradient_checkpointing"):
            continue
        for _, child in container.named_children():
            for _, block in child.named_children():
                if id(block) not in picked:
                    picked.add(id(block))
                    chosen.append(block)
    return chosen


def plan_modules(model, plan, layer_classes=None):
    """Names of the modules that get their own FSDP unit under ``plan`` (root excluded).

    ``plan``: ``verl`` (what the installed verl selects: its real
    ``_select_fsdp2_wrap_targets`` on 0.7.1+, the inline rule of 0.4.0-0.7.0
    otherwise), ``skyrl``, ``areal`` (the inline rule of AReaL's
    ``apply_fsdp2``), ``llamafactory`` (``FSDP2Engine.prepare_model``'s rule
    around the installed, unpatched ``get_transformer_layer_cls``; both
    checked against the known fingerprints), ``fixed`` (``select_wrap_targets``),
    ``fixed-verl`` (``select_verl``: the fix plus verl's by-name
    ``embed_tokens`` / ``lm_head`` units), ``hyperparallel``, or a list /
    comma-separated string of module names.  The upstream plans are computed
    from the unpatched upstream functions even while fsdp2-compat patches
    are applied.  ``layer_classes`` defaults to ``model._no_split_modules``.
    Order is the order the framework calls ``fully_shard`` in.
    """
    if layer_classes is None:
        layer_classes = layer_classes_of(model)
    elif isinstance(layer_classes, str):
        layer_classes = [c for c in layer_classes.split(",") if c]
    layer_classes = list(layer_classes)
    names = module_names(model)
    if isinstance(plan, (list, tuple)) or (isinstance(plan, str) and plan not in PLANS):
        return _explicit_plan(model, plan, names)
    if plan == "verl":
        modules, _ = _verl_selection(model, layer_classes)
    elif plan == "skyrl":
        modules = _skyrl_selection(model, layer_classes)
    elif plan == "areal":
        modules = _areal_selection(model, layer_classes)
    elif plan == "llamafactory":
        modules = _llamafactory_selection(model)
    elif plan == "fixed":
        from fsdp2_compat.fixes.selection import select_wrap_targets

        modules = select_wrap_targets(model, layer_classes)
    elif plan == "fixed-verl":
        from fsdp2_compat.fixes.selection import select_verl

        modules = select_verl(model, layer_classes)
    else:
        # HyperParallel shards the deepest blocks first (stable sort by depth).
        modules = _hyperparallel_selection(model)
        depth = {id(m): names.get(id(m), "").count(".") for m in modules}
        modules = sorted(modules, key=lambda m: -depth[id(m)])
    out = []
    for m in modules:
        name = names.get(id(m))
        if name and name not in out:  # the root is never its own child unit
            out.append(name)
    return out


def describe_plan(plan):
    """One line on where a plan comes from (for the report)."""
    from fsdp2_compat.core import guards

    if plan == "verl":
        version = guards.installed_version("verl")
        if version is None:
            return "verl (not installed)"
        if guards.in_range(version, ">=0.7.1"):
            return "verl %s: verl.utils.fsdp_utils._select_fsdp2_wrap_targets (unpatched)" % version
        return "verl %s: inline rule of apply_fsdp2 (layer classes or untied nn.Embedding)" % version
    if plan in ("areal", "llamafactory"):
        version = guards.installed_version(plan)
        if version is None:
            return "%s (not installed)" % plan
        if plan == "areal":
            return ("areal %s: inline rule of apply_fsdp2 (layer classes, plus every nn.Embedding when "
                    "config.tie_word_embeddings is false)" % version)
        return ("llamafactory %s: FSDP2Engine.prepare_model (LoRA leaves; the one class get_transformer_layer_cls "
                "returns, unpatched; every nn.Embedding when the config says untied)" % version)
    return {
        "skyrl": "SkyRL: layer classes, plus every nn.Embedding when config.tie_word_embeddings is false",
        "fixed": "fsdp2-compat fixed: layer classes, plus the input embedding when untied (by identity)",
        "fixed-verl": "fsdp2-compat fixed, verl flavour: fixed plus embed_tokens / lm_head by name when untied",
        "hyperparallel": "HyperParallel FSDP2Manager: every grandchild of a module with gradient_checkpointing",
    }.get(plan, "explicit list")


def _explicit_plan(model, plan, names):
    import difflib

    wanted = [n.strip() for n in (plan.split(",") if isinstance(plan, str) else plan)]
    wanted = [n for n in wanted if n and n != "<root>"]
    valid = set(names.values())
    bad = [n for n in wanted if n not in valid]
    if bad:
        hints = []
        for n in bad:
            close = difflib.get_close_matches(n, sorted(valid), n=3)
            hints.append("%r%s" % (n, " (did you mean %s?)" % ", ".join(close) if close else ""))
        raise AuditInputError(
            "plan names no module of this model: %s; valid plans are %s or comma-separated module names "
            "from model.named_modules()" % ("; ".join(hints), ", ".join(PLANS))
        )
    out = []
    for n in wanted:
        if n not in out:
            out.append(n)
    return out
