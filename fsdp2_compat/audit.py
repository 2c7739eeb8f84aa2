"""Wrap-plan auditor: find raw parameter reads that a FSDP2 wrap plan breaks.

Under FSDP2 a unit's parameters are unsharded only while that unit's forward
runs (its pre-forward hook to its post-forward hook).  A parameter of unit
``U`` that some other module's forward reads *directly* (``child.weight``,
never ``child(x)``) is still a sharded ``DTensor`` there, and the first op
that meets a plain tensor raises ``got mixed torch.Tensor and DTensor``.

This module finds those reads without FSDP, a process group or an
accelerator: it computes the units a plan would create (``plan_modules``),
runs one ordinary forward on CPU (``audit``), tracks which modules' forwards
are active with forward pre/post hooks, and watches every torch call with a
``TorchFunctionMode``.  A parameter whose owning unit's forward is not active
is treated as a sharded value; its taint follows the ops applied to it alone
(``view``, ``permute``, ``to`` ... as DTensor would), and the op where it
meets a plain tensor with more than one element is where FSDP2 would raise
(``grid_sample`` for GLM4V's position table).  Metadata access (``.shape``,
``.device``, ``.dtype``, ``.size()``, ``.dim()`` ...) is not a read.

    plan_modules(model, plan, layer_classes=None) -> [module name, ...]
    audit(model, batch, units, *, plan=None) -> [Hazard, ...]
    plan_problems(model, units) -> [str, ...]   # wrap-time problems, not reads
    main(argv) / add_arguments(parser) / run(args)  # ``fsdp2-compat audit``

Importing this module imports neither torch, transformers nor verl.
"""

import contextlib
import json
import sys

PLANS = ("verl", "skyrl", "fixed", "fixed-verl", "hyperparallel")
SWEEP_PLANS = ("verl", "skyrl", "fixed", "hyperparallel")
ROOT = ""  # the root unit's name

NO_PATCH = "no patch covers this: wrap the reading module instead"


class AuditInputError(ValueError):
    """Bad input (unknown family, plan, module name, config key ...): exit code 2."""


class Hazard:
    """One raw read of a sharded parameter.

    param        parameter name (its first alias in ``named_parameters``)
    owner        the FSDP unit that owns it (``""`` is the root)
    reader       innermost active module when the raw parameter was read
    reader_class that module's class name
    op           the torch function where the sharded value meets a plain
                 tensor (where FSDP2 raises); the read op if it never does
    read_op      the first torch function applied to the raw parameter
    mixed        True when ``op`` mixes the sharded value with a plain tensor
    patch        the fsdp2-compat patch that covers it, or None
    advice       what to do
    """

    __slots__ = ("param", "owner", "reader", "reader_class", "op", "read_op", "mixed", "patch", "advice")

    def __init__(self, param, owner, reader, reader_class, op, read_op, mixed, patch=None, advice=NO_PATCH):
        self.param = param
        self.owner = owner
        self.reader = reader
        self.reader_class = reader_class
        self.op = op
        self.read_op = read_op
        self.mixed = mixed
        self.patch = patch
        self.advice = advice

    def as_dict(self):
        return {k: getattr(self, k) for k in self.__slots__}

    def __repr__(self):
        return "Hazard(%s owned by %s, read by %s (%s), op %s, patch %s)" % (
            self.param, self.owner or "<root>", self.reader or "<root>", self.reader_class, self.op, self.patch)


# ---------------------------------------------------------------------------
# plans


def layer_classes_of(model):
    """``model._no_split_modules`` as a sorted list (a set in transformers 5.x, a list in 4.x)."""
    return sorted(n for n in (getattr(model, "_no_split_modules", None) or ()) if n)


def _module_names(model):
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
    from . import guards

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
    tie = model.config.tie_word_embeddings
    chosen = [
        m for _, m in model.named_modules()
        if type(m).__name__ in layer_classes or (isinstance(m, nn.Embedding) and not tie)
    ]
    return chosen, "verl %s inline apply_fsdp2 rule" % version


def _skyrl_selection(model, layer_classes):
    """SkyRL / skyrl-train (every release): layer classes, plus every nn.Embedding when untied by config."""
    import torch.nn as nn

    tie = model.config.tie_word_embeddings  # upstream reads it without a default
    return [
        m for _, m in model.named_modules()
        if type(m).__name__ in layer_classes or (isinstance(m, nn.Embedding) and not tie)
    ]


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
    otherwise), ``skyrl``, ``fixed`` (``select_wrap_targets``),
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
    names = _module_names(model)
    if isinstance(plan, (list, tuple)) or (isinstance(plan, str) and plan not in PLANS):
        return _explicit_plan(model, plan, names)
    if plan == "verl":
        modules, _ = _verl_selection(model, layer_classes)
    elif plan == "skyrl":
        modules = _skyrl_selection(model, layer_classes)
    elif plan == "fixed":
        from .fixes.selection import select_wrap_targets

        modules = select_wrap_targets(model, layer_classes)
    elif plan == "fixed-verl":
        from .integrations.verl import select_verl

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
    from . import guards

    if plan == "verl":
        version = guards.installed_version("verl")
        if version is None:
            return "verl (not installed)"
        if guards.in_range(version, ">=0.7.1"):
            return "verl %s: verl.utils.fsdp_utils._select_fsdp2_wrap_targets (unpatched)" % version
        return "verl %s: inline rule of apply_fsdp2 (layer classes or untied nn.Embedding)" % version
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


# ---------------------------------------------------------------------------
# ownership


def _deepest_unit(module_name, unit_set):
    name = module_name
    while True:
        if name in unit_set:
            return name
        if not name:
            return ROOT
        name = name.rpartition(".")[0]


def parameter_owners(model, units):
    """``{id(param): (param, name, owner unit, [unit of each alias])}``.

    Rule: for each name under which the parameter is reachable
    (``named_parameters(remove_duplicate=False)``), the deepest unit whose
    module contains it (by name prefix; the root ``""`` otherwise).  When the
    aliases land in different units (a tied weight split across units) the
    owner is the first of them in ``fully_shard`` order: the plan's units in
    the order given, the root last - the unit FSDP2 would manage it in first.
    torch 2.13 refuses such a split at wrap time (``plan_problems`` says so).
    """
    unit_set = set(units) | {ROOT}
    order = {u: i for i, u in enumerate([u for u in units if u] + [ROOT])}
    aliases, params = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
        params[id(p)] = p
    owners = {}
    for pid, alias_names in aliases.items():
        cands = []
        for n in alias_names:
            u = _deepest_unit(n.rpartition(".")[0], unit_set)
            if u not in cands:
                cands.append(u)
        owner = min(cands, key=lambda u: order[u])
        owners[pid] = (params[pid], alias_names[0], owner, cands)
    return owners


def plan_problems(model, units):
    """Problems of the plan itself, not read hazards: a unit nested in one that is sharded
    before it, and tied weights split across units."""
    problems = []
    position = {u: i for i, u in enumerate(units)}
    for u in units:
        parent = u.rpartition(".")[0]
        while parent:
            if parent in position and position[parent] < position[u]:
                problems.append(
                    "unit %s is nested in unit %s, which is sharded first: torch 2.13 does not support that "
                    "order (2 ranks: 'Cannot concatenate overlapping meshes' at wrap time; 1 rank: mixed "
                    "Tensor/DTensor at the first forward)" % (u, parent))
                break
            parent = parent.rpartition(".")[0]
    for _, name, owner, cands in parameter_owners(model, units).values():
        if len(cands) > 1:
            problems.append(
                "tied parameter %s spans units %s (torch 2.13 refuses a parameter shared across FSDP groups)"
                % (name, ", ".join(c or "<root>" for c in cands)))
    return problems


# ---------------------------------------------------------------------------
# the forward


# Tensor attributes and methods that read metadata only (no data, no taint).
_META = frozenset((
    "shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_leaf", "grad_fn", "names",
    "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "itemsize",
    "nbytes", "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset",
    "is_contiguous", "element_size", "get_device", "is_floating_point", "is_complex", "is_signed",
    "data_ptr", "__len__", "is_inference", "requires_grad_", "retain_grad", "register_hook",
    "__repr__", "__format__", "__hash__", "__bool__",
))
# Methods whose tensor arguments after ``self`` supply metadata only (dtype/device/shape).
_SELF_ONLY = frozenset((
    "to", "type_as", "expand_as", "view_as", "reshape_as", "new_empty", "new_zeros", "new_ones",
    "new_full", "new_tensor",
))


def _func_name(func):
    name = getattr(func, "__name__", None) or repr(func)
    if name in ("__get__", "__set__"):
        prop = getattr(getattr(func, "__self__", None), "__name__", None)
        if prop:
            return prop
    return name


class _Read:
    __slots__ = ("pid", "reader", "read_op", "active")

    def __init__(self, pid, reader, read_op, active):
        self.pid = pid
        self.reader = reader
        self.read_op = read_op
        self.active = active


def _tracker(owners, names):
    """The TorchFunctionMode class and the shared state it records into."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.weak import WeakIdKeyDictionary

    Tensor = torch.Tensor
    state = {"stack": [], "active": {}, "reads": [], "hits": [], "taint": WeakIdKeyDictionary()}

    def active_names():
        return tuple(names.get(id(m), "?") for m in state["stack"])

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = _func_name(func)
            if name in _META:
                return func(*args, **kwargs)
            leaves = [args[0]] if (name in _SELF_ONLY and args) else tree_leaves((args, kwargs))
            sources, plain = [], False
            taint = state["taint"]
            for x in leaves:
                if not isinstance(x, Tensor):
                    continue
                entry = owners.get(id(x))
                if entry is not None and entry[0] is x:
                    if state["active"].get(entry[2], 0) > 0:
                        plain = plain or x.numel() != 1
                        continue
                    stack = state["stack"]
                    reader = names.get(id(stack[-1]), "?") if stack else None
                    read = _Read(id(x), reader, name, active_names())
                    state["reads"].append(read)
                    sources.append(read)
                    continue
                src = taint.get(x)
                if src is not None:
                    sources.extend(src)
                elif x.numel() != 1:  # DTensor treats one-element plain tensors as replicated
                    plain = True
            out = func(*args, **kwargs)
            if not sources:
                return out
            if plain:
                for read in sources:
                    state["hits"].append((read, name))
                return out  # FSDP2 raises here: nothing downstream is sharded-derived
            for y in tree_leaves(out):
                if isinstance(y, Tensor) and owners.get(id(y), (None,))[0] is not y:
                    taint[y] = tuple(sources)
            return out

    return Mode, state


def audit(model, batch, units, *, plan=None):
    """Run ``model(**batch)`` once on CPU and return the hazards of the wrap plan ``units``.

    ``units``: module names with their own FSDP unit (``plan_modules``); the
    root is always a unit.  A parameter is readable (unsharded) while its
    owning unit's forward is on the stack of active module forwards - that
    includes nested non-unit children of the unit, and nested child units,
    whose own parameters are sharded but whose parent's are not.  A unit's
    parameters are *not* unsharded by an active ancestor unit.  Ownership
    (tied weights included) follows ``parameter_owners``.  Each hazard is
    reported once per (parameter, reading module, op).  ``plan`` (the plan's
    name) only tailors the advice: the wrap-selection patches change the
    ``verl`` and ``skyrl`` plans only, so other plans (and ``None``) get a
    patch only for verl's fused-forward ``lm_head`` reads.  No process group, no FSDP; the
    model is not modified (hooks are removed afterwards).
    """
    names = _module_names(model)
    valid, unit_set = set(names.values()), set(units)
    unknown = [u for u in units if u and u not in valid]
    if unknown:
        raise AuditInputError("units name no module of this model: %s" % ", ".join(unknown))
    owners = parameter_owners(model, units)
    classes = {id(m): type(m).__name__ for m in model.modules()}
    unit_of = {id(m): name for name, m in model.named_modules() if name in unit_set or m is model}
    Mode, state = _tracker(owners, names)

    def pre(module, args):
        state["stack"].append(module)
        u = unit_of.get(id(module))
        if u is not None:
            state["active"][u] = state["active"].get(u, 0) + 1

    def post(module, args, output):
        stack = state["stack"]
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is module:
                del stack[i:]
                break
        u = unit_of.get(id(module))
        if u is not None and state["active"].get(u, 0) > 0:
            state["active"][u] -= 1

    handles = []
    try:
        for m in model.modules():
            handles.append(m.register_forward_pre_hook(pre))
            handles.append(m.register_forward_hook(post, always_call=True))
        with Mode():
            model(**batch)
    finally:
        for h in handles:
            h.remove()

    by_name = {v: k for k, v in names.items()}  # name -> id(module)
    cover = _Coverage(model, plan, units, owners)
    hazards, seen = [], set()

    def add(read, op, mixed):
        _, pname, owner, _ = owners[read.pid]
        key = (pname, read.reader, op)
        if key in seen:
            return
        seen.add(key)
        patch, advice = cover.advice(read, pname, owner)
        reader_class = classes.get(by_name.get(read.reader), "?")
        hazards.append(Hazard(pname, owner, read.reader, reader_class, op, read.read_op, mixed, patch, advice))

    hit = {(read.pid, read.reader) for read, _ in state["hits"]}
    for read, op in state["hits"]:
        add(read, op, True)
    for read in state["reads"]:
        if (read.pid, read.reader) not in hit:
            # Never met a plain tensor during the forward: still a sharded value where it was read.
            add(read, read.read_op, False)
    return hazards


# ---------------------------------------------------------------------------
# advice


def _norm(text):
    return "".join(c for c in text.lower() if c.isalnum())


class _Coverage:
    """Which fsdp2-compat patch (if any) removes a hazard."""

    def __init__(self, model, plan, units, owners):
        self.model = model
        self.plan = plan
        self.units = units
        self.owners = owners
        self._fixed_owners = None

    def _fused_target(self):
        from . import registry

        fwd = type(self.model).__dict__.get("forward")
        if fwd is None:
            return None, None
        mod, attr = getattr(fwd, "__module__", None), getattr(fwd, "__name__", None)
        found = [(p, t) for p in registry.PATCHES for t in p.targets if t.module == mod and t.attr == attr]
        if not found:
            return None, None
        # Several patches may carry the target (glm4v also covers dense_common
        # for GLM-4.5V): name the one named for this model, else the most specific.
        named = self._named_for_model([p for p, _ in found])
        p, t = next(((p, t) for p, t in found if p is named), None) or min(found, key=lambda pt: len(pt[0].targets))
        return p.name, t

    def _named_for_model(self, patches):
        """The patch among ``patches`` whose name or families name this model's type, or None."""
        mt = _norm(getattr(getattr(self.model, "config", None), "model_type", "") or "")
        for p in patches:
            labels = [p.name]
            for fam in p.families:
                head, _, rest = fam.partition("(")
                labels += [head, rest.rstrip(")"), fam]
            if any(_norm(label) == mt for label in labels if label):
                return p
        return None

    def _fixed(self):
        if self._fixed_owners is None:
            fixed_plan = "fixed-verl" if self.plan == "verl" else "fixed"
            self._fixed_owners = parameter_owners(self.model, plan_modules(self.model, fixed_plan))
        return self._fixed_owners

    def _wrap_patch(self):
        from . import registry

        wrap = {t.key for t in registry.WRAP_SELECTION}
        cands = [p for p in registry.PATCHES if any(t.key in wrap for t in p.targets)]
        named = self._named_for_model(cands)
        return (named.name if named is not None else None), [c.name for c in cands]

    def advice(self, read, pname, owner):
        from . import guards

        out = getattr(self.model, "get_output_embeddings", lambda: None)()
        out_w = getattr(out, "weight", None) if out is not None else None
        p = self.owners[read.pid][0]
        if read.reader == ROOT and out_w is p:
            name, target = self._fused_target()
            if name is not None:
                version = guards.installed_version(target.dist)
                note = ""
                if version is not None and not guards.in_range(version, target.versions):
                    note = " (but it targets %s %s; installed: %s)" % (target.dist, target.versions, version)
                return name, "apply patch '%s': it unshards %s through FSDP before %s.%s reads it%s" % (
                    name, owner or "<root>", target.module.rpartition(".")[2], target.attr, note)
        if self.plan in ("verl", "skyrl"):  # the plans the wrap-selection patches change
            fixed_owner = self._fixed()[read.pid][2]
            if fixed_owner in read.active:
                name, all_names = self._wrap_patch()
                mt_name = getattr(getattr(self.model, "config", None), "model_type", None)
                where = "the root unit" if fixed_owner == ROOT else "unit " + fixed_owner
                if name is not None:
                    return name, "apply patch '%s': its wrap-selection fix keeps %s in %s" % (name, pname, where)
                return None, ("the wrap-selection fix keeps %s in %s, but no patch is named for model type %r: "
                              "any of %s applies it" % (pname, where, mt_name, ", ".join(all_names)))
        return None, "%s (%s), or keep %s out of a unit of its own" % (NO_PATCH, read.reader or "<root>", owner)


# ---------------------------------------------------------------------------
# inputs


def _families():
    from .examples import tiny_models

    return tiny_models.FAMILIES


def _parse_sets(pairs):
    out = []
    for pair in pairs or ():
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise AuditInputError("--set expects KEY=VALUE (e.g. vision_config.depth=2), got %r" % pair)
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out.append((key.strip(), value))
    return out


def _apply_sets(config, sets):
    for key, value in sets:
        obj, parts = config, key.split(".")
        for part in parts[:-1]:
            nxt = obj.get(part) if isinstance(obj, dict) else getattr(obj, part, None)
            if nxt is None:
                raise AuditInputError("--set %s: the config has no %r" % (key, part))
            obj = nxt
        leaf = parts[-1]
        if isinstance(obj, dict):
            obj[leaf] = value
        else:
            if not hasattr(obj, leaf):
                raise AuditInputError("--set %s: %s has no attribute %r (see its to_dict() keys)"
                                      % (key, type(obj).__name__, leaf))
            setattr(obj, leaf, value)


_LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "depth", "encoder_layers",
               "decoder_layers", "num_encoder_layers", "num_decoder_layers")
_FIXED = {
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "embed_dim": 32, "out_hidden_size": 32,
    "projector_hidden_size": 32, "intermediate_size": 64, "ffn_dim": 64, "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64, "n_inner": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "num_attention_heads": 2, "num_heads": 2, "encoder_attention_heads": 2, "decoder_attention_heads": 2,
    "n_head": 2, "num_key_value_heads": 1, "num_kv_heads": 1, "head_dim": 16,
}
_CAPS = {"num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
         "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
         "max_position_embeddings": 4096}


def _shrink(d, top=True):
    """Tiny dimensions for a config dict (and its sub-config dicts), in place."""
    old_layers = next((d[k] for k in _LAYER_KEYS if isinstance(d.get(k), int)), None)
    new_layers = None
    for k in _LAYER_KEYS:
        if isinstance(d.get(k), int) and d[k] > 2:
            d[k] = 2
            new_layers = 2
    for k, v in list(d.items()):
        if isinstance(v, dict) and k.endswith("_config"):
            _shrink(v, top=False)
        elif k in _FIXED and isinstance(v, int) and v > 0:
            d[k] = _FIXED[k]
        elif k in _CAPS and isinstance(v, int):
            d[k] = min(v, _CAPS[k])
        elif new_layers and isinstance(v, list) and len(v) == old_layers:
            d[k] = v[:new_layers]  # per-layer lists (layer_types, ...)
    if isinstance(d.get("vocab_size"), int):
        ids = []
        for k, v in d.items():
            if k.endswith(("_token_id", "_token_index", "_token_ids")):
                ids += [x for x in (v if isinstance(v, list) else [v]) if isinstance(x, int)]
        d["vocab_size"] = max([256] + [i + 1 for i in ids])
    for key in ("rope_parameters", "rope_scaling"):
        rope = d.get(key)
        if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
            factor = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0
            freqs = max(len(rope["mrope_section"]), int(16 * factor) // 2)
            sec, total = rope["mrope_section"], sum(rope["mrope_section"]) or 1
            new = [max(1, round(s * freqs / total)) for s in sec]
            new[-1] += freqs - sum(new)
            rope["mrope_section"] = new
    return d


def _deep_merge(base, over):
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_merge(base[k], v)
        else:
            base[k] = v
    return base


def _family_of_config_class(name):
    from .examples import tiny_models

    for family, (_, cfg_cls) in tiny_models._CLASSES.items():
        if cfg_cls == name:
            return family
    return None


def _config_class(model_type):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for key in (model_type, model_type.replace("-", "_"), model_type.replace("_", "-")):
        try:
            return CONFIG_MAPPING[key]
        except KeyError:
            continue
    return None


def _family_of_model_type(model_type):
    import transformers

    from .examples import tiny_models

    for family, (_, cfg_cls) in tiny_models._CLASSES.items():
        cls = getattr(transformers, cfg_cls, None)
        if cls is not None and _norm(getattr(cls, "model_type", "") or "") == _norm(model_type):
            return family
    return None


def _text_batch(model):
    import torch

    vocab = getattr(model.get_input_embeddings(), "num_embeddings", 256)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, max(4, min(vocab, 240)), (2, 12), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _build_generic(config):
    import torch
    import transformers

    archs = getattr(config, "architectures", None) or []
    classes = [getattr(transformers, a, None) for a in archs]
    errors = []
    for cls in [c for c in classes if c is not None]:
        try:
            return cls(config)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append("%s: %s" % (cls.__name__, exc))
    for auto in ("AutoModelForImageTextToText", "AutoModelForCausalLM", "AutoModel"):
        cls = getattr(transformers, auto, None)
        if cls is None:
            continue
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                return cls.from_config(config)
        except Exception as exc:  # noqa: BLE001
            errors.append("%s: %s" % (auto, str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
    raise AuditInputError("could not build a model from this config: " + "; ".join(errors))


def build_inputs(args):
    """(model, batch, label, notes) for parsed CLI arguments."""
    import transformers

    from .examples import tiny_models

    sets = _parse_sets(args.set)
    notes = []
    if args.model:
        if args.model not in tiny_models.FAMILIES:
            raise AuditInputError("unknown --model %r; valid families: %s" % (args.model, ", ".join(tiny_models.FAMILIES)))
        ok = tiny_models.available(args.model)
        if ok is not True:
            raise AuditInputError("--model %s: %s" % (args.model, ok))
        if sets:
            config = tiny_models._quiet(tiny_models._tiny_config, args.model, args.tie)
            _apply_sets(config, sets)
            model = _instantiate(getattr(transformers, tiny_models._CLASSES[args.model][0]), config)
        else:
            model = tiny_models.build(args.model, tie=args.tie)
        return model, tiny_models.make_batch(args.model, model, seed=0), args.model, notes
    if args.config:
        cfg_cls = getattr(transformers, args.config, None)
        if cfg_cls is None or not isinstance(cfg_cls, type) or not hasattr(cfg_cls, "model_type"):
            raise AuditInputError("--config %r is not a configuration class of transformers %s (e.g. Glm4vConfig, "
                                  "Qwen2Config)" % (args.config, transformers.__version__))
        family = _family_of_config_class(args.config)
        if family is not None and tiny_models.available(family) is True:
            config = tiny_models._quiet(tiny_models._tiny_config, family, args.tie)
            _apply_sets(config, sets)
            model = _instantiate(getattr(transformers, tiny_models._CLASSES[family][0]), config)
            return model, tiny_models.make_batch(family, model, seed=0), args.config, notes
        config = cfg_cls.from_dict(_shrink(cfg_cls().to_dict()))
        _apply_sets(config, sets)
        return _generic(config, args.config, notes)
    return _from_json(args.config_json, sets, args.tie, notes)


def _instantiate(cls, config):
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(config)
    return model.to(dtype=torch.float32, device="cpu").train()


def _generic(config, label, notes):
    import torch

    model = _build_generic(config).to(dtype=torch.float32, device="cpu").train()
    notes.append("no tiny batch is known for model type %r: the audit ran a text-only batch, so vision/audio "
                 "towers were not exercised (their hazards are not seen)" % config.model_type)
    return model, _text_batch(model), label, notes


def _from_json(path, sets, tie, notes):
    import transformers

    from .examples import tiny_models

    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise AuditInputError("--config-json %s: %s" % (path, exc)) from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not model_type:
        raise AuditInputError("--config-json %s has no model_type" % path)
    family = _family_of_model_type(model_type)
    cfg_cls = getattr(transformers, tiny_models._CLASSES[family][1]) if family else _config_class(model_type)
    if cfg_cls is None:
        raise AuditInputError("--config-json %s: model_type %r is unknown to transformers %s"
                              % (path, model_type, transformers.__version__))
    d = _shrink(dict(raw))
    if family is not None and tiny_models.available(family) is True:
        # Geometry, token ids and rotary settings of the tiny family (the batch depends on them);
        # everything else (flags, tying, optional heads) as in the file.
        tiny = tiny_models._quiet(tiny_models._tiny_config, family, False)
        tiny_d = tiny.to_diff_dict()
        for sub in [d] + [v for v in d.values() if isinstance(v, dict)]:
            sub_tiny = tiny_d if sub is d else next((tiny_d.get(k) for k, v in d.items() if v is sub), None)
            if isinstance(sub_tiny, dict) and any(k in sub_tiny for k in ("rope_parameters", "rope_scaling", "rope_theta")):
                for k in ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"):
                    sub.pop(k, None)
        # Tying stays as the file (or, where it is silent, the config class default) says.
        for sub in [tiny_d] + [v for v in tiny_d.values() if isinstance(v, dict)]:
            sub.pop("tie_word_embeddings", None)
        _deep_merge(d, tiny_d)
        if tie:
            for sub in [d] + [v for k, v in d.items() if k == "text_config" and isinstance(v, dict)]:
                sub["tie_word_embeddings"] = True
        d.pop("architectures", None)
        config = tiny_models._quiet(cfg_cls.from_dict, d)
        _apply_sets(config, sets)
        try:
            model = _instantiate(getattr(transformers, tiny_models._CLASSES[family][0]), config)
            batch = tiny_models.make_batch(family, model, seed=0)
        except Exception as exc:  # noqa: BLE001
            raise AuditInputError("--config-json %s: the shrunk %s config did not build (%s: %s); fix it with "
                                  "--set or use --model %s" % (path, model_type, type(exc).__name__, exc, family)) from None
        return model, batch, "%s (%s, shrunk)" % (path, model_type), notes
    config = tiny_models._quiet(cfg_cls.from_dict, d)
    _apply_sets(config, sets)
    try:
        return _generic(config, "%s (%s, shrunk)" % (path, model_type), notes)
    except AuditInputError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise AuditInputError("--config-json %s: the shrunk config did not build (%s: %s); fix it with --set"
                              % (path, type(exc).__name__, exc)) from None


def apply_fused(model):
    """verl's fused-kernel forward on ``model`` (torch backend), as verl's workers install it.

    verl's ``apply_monkey_patch`` assigns forwards on the model *classes*
    (process-wide): a process that audits the fused forward should not audit
    unfused forwards of the same classes afterwards.
    """
    from . import guards

    if guards.installed_version("verl") is None:
        raise AuditInputError("--fused needs verl installed (it runs verl's own fused-kernel forward)")
    import io

    from verl.models.transformers.monkey_patch import apply_monkey_patch

    with contextlib.redirect_stdout(io.StringIO()):  # verl prints what it patches
        apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True, fused_kernels_backend="torch")


def add_verl_position_ids(model, batch):
    """verl's Qwen2-VL / GLM4V fused forwards require (4, batch, seq) position ids: text
    positions stacked on the 3D rope index, as verl's dataset builds them."""
    import inspect

    import torch

    fwd = type(model).__dict__.get("forward")
    if "position_ids" in batch or getattr(fwd, "__module__", "") not in (
            "verl.models.transformers.qwen2_vl", "verl.models.transformers.glm4v"):
        return
    get_rope_index = getattr(getattr(model, "model", model), "get_rope_index", None)
    if get_rope_index is None:
        return
    accepted = inspect.signature(get_rope_index).parameters
    rope, _ = get_rope_index(**{k: v for k, v in batch.items() if k in accepted})
    b, n = batch["input_ids"].shape
    batch["position_ids"] = torch.cat([torch.arange(n).expand(1, b, n), rope], 0)


# ---------------------------------------------------------------------------
# reports


def _versions():
    from . import guards

    return {d: guards.installed_version(d) for d in ("torch", "transformers", "verl")}


def report(model, batch, plan, label, fused=False, layer_classes=None, notes=()):
    """Plan, audit and collect everything the CLI prints, as a dict."""
    units = plan_modules(model, plan, layer_classes)
    plan_name = plan if isinstance(plan, str) and plan in PLANS else "explicit"
    if fused:
        batch = {k: v for k, v in batch.items() if k != "labels"}
        batch["return_dict"] = True
        add_verl_position_ids(model, batch)
    adapt = contextlib.nullcontext()
    notes = list(notes)
    if fused and getattr(type(model).__dict__.get("forward"), "__module__", "") == "verl.models.transformers.glm4v":
        from .examples import glm4v_bridge

        need = glm4v_bridge.needed()
        if need is not None:
            adapt = glm4v_bridge.bridge()
            notes.append("verl's GLM4V forward does not run on this transformers (%s; an upstream verl bug, not "
                         "FSDP2): audited with transformers adapted by fsdp2_compat.examples.glm4v_bridge" % need)
    try:
        with adapt:
            hazards = audit(model, batch, units, plan=plan_name)
    except AuditInputError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise AuditInputError("the tiny forward of %s failed (%s: %s)" % (label, type(exc).__name__,
                                                                           str(exc).splitlines()[0] if str(exc) else ""))
    if plan == "verl" and not layer_classes_of(model) and layer_classes is None:
        notes.append("model._no_split_modules is empty: verl's apply_fsdp2 asserts a non-empty layer class list "
                     "(set wrap_policy.transformer_layer_cls_to_wrap, or --layer-classes here)")
    return {
        "model": label,
        "model_class": type(model).__name__,
        "model_type": getattr(model.config, "model_type", None),
        "plan": plan_name if plan_name != "explicit" else ",".join(units),
        "plan_source": describe_plan(plan_name),
        "fused": bool(fused),
        "units": units,
        "plan_problems": plan_problems(model, units),
        "hazards": [h.as_dict() for h in hazards],
        "notes": notes,
        "versions": _versions(),
    }


def format_report(rep):
    lines = [
        "model: %s (%s)  %s" % (rep["model"], rep["model_class"],
                                " ".join("%s %s" % (k, v) for k, v in rep["versions"].items() if v)),
        "plan: %s - %s%s" % (rep["plan"], rep["plan_source"], "  [verl fused forward]" if rep["fused"] else ""),
        "units (%d + root): %s" % (len(rep["units"]), ", ".join(rep["units"]) or "none"),
    ]
    for p in rep["plan_problems"]:
        lines.append("plan problem: " + p)
    for n in rep["notes"]:
        lines.append("note: " + n)
    hz = rep["hazards"]
    if not hz:
        lines.append("no hazards: every parameter is read while its unit's forward runs")
        return "\n".join(lines)
    rows = [("PARAMETER", "OWNER UNIT", "READ BY", "OP", "PATCH")]
    for h in hz:
        rows.append((h["param"], h["owner"] or "<root>", "%s (%s)" % (h["reader"] or "<root>", h["reader_class"]),
                     h["op"] + ("" if h["mixed"] else " (no mix seen)"), h["patch"] or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines.append("%d hazard(s): sharded parameters read outside their unit's forward" % len(hz))
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    for h in hz:
        lines.append("- %s: %s" % (h["param"], h["advice"]))
    return "\n".join(lines)


def sweep(families=None, plans=SWEEP_PLANS):
    """Audit tiny families x plans (unfused); rows of dicts for ``format_sweep``."""
    from . import guards
    from .examples import tiny_models

    if families is None:
        families = [f for f in tiny_models.FAMILIES if f not in ("qwen2", "llama")]
    rows = []
    for family in families:
        ok = tiny_models.available(family)
        if ok is not True:
            rows.append({"family": family, "plan": "-", "skipped": str(ok)})
            continue
        model = tiny_models.build(family)
        batch = tiny_models.make_batch(family, model, seed=0)
        for plan in plans:
            if plan == "verl" and guards.installed_version("verl") is None:
                rows.append({"family": family, "plan": plan, "skipped": "verl not installed"})
                continue
            rep = report(model, batch, plan, family)
            rows.append({"family": family, "plan": plan, "units": len(rep["units"]),
                         "hazards": rep["hazards"], "plan_problems": rep["plan_problems"], "notes": rep["notes"]})
    return rows


def format_sweep(rows, markdown=False):
    head = ("family", "plan", "units", "hazards (parameter <- reader, op)", "covering patch", "plan problems")
    body = []
    for r in rows:
        if "skipped" in r:
            body.append((r["family"], r["plan"], "-", "skipped: " + r["skipped"], "-", "-"))
            continue
        hz = "; ".join("%s <- %s, %s" % (h["param"], h["reader_class"], h["op"]) for h in r["hazards"]) or "none"
        patches = "; ".join(h["patch"] or "none (gap)" for h in r["hazards"]) or "-"
        problems = "; ".join([_short_problem(p) for p in r["plan_problems"]] + [_short_problem(n) for n in r.get("notes", ())]) or "-"
        body.append((r["family"], r["plan"], str(r["units"]), hz, patches, problems))
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
        return "\n".join(out)
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head] + body)


def _short_problem(p):
    if p.startswith("unit ") and " is nested in unit " in p:
        inner, _, rest = p[5:].partition(" is nested in unit ")
        return "nested: %s in %s" % (inner, rest.partition(" ")[0].rstrip(",:"))
    if p.startswith("tied parameter "):
        return "split tied: " + p.split(" ")[2]
    if p.startswith("model._no_split_modules is empty"):
        return "empty _no_split_modules: verl's apply_fsdp2 asserts"
    return p


# ---------------------------------------------------------------------------
# CLI


def add_arguments(parser):
    """Add the ``audit`` arguments to an argparse parser."""
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="FAMILY",
                     help="a built-in tiny family (fsdp2_compat.examples.tiny_models.FAMILIES), built from its "
                          "config class with 1-2 layers, hidden 32: no download")
    src.add_argument("--config", metavar="CLASSNAME",
                     help="a transformers config class name (e.g. Glm4vConfig); a class of a built-in family "
                          "starts from that family's tiny config (and batch), any other from its defaults "
                          "shrunk as for --config-json, run on a text-only batch")
    src.add_argument("--config-json", metavar="PATH",
                     help="a local config.json, shrunk before building: layer counts -> at most 2, hidden "
                          "sizes -> 32, FFN -> 64, heads -> 2 (kv heads 1, head_dim 16), experts -> 4 (2 "
                          "per token), vocab -> 256 (or just above the largest special token id), in every "
                          "*_config sub-dict alike.  For a built-in family's model_type the tiny family's "
                          "geometry, token ids and rotary settings replace the file's (the tiny batch "
                          "needs them) while flags and tying come from the file; other model types run a "
                          "text-only batch.  Conservative: if the shrunk config does not build, fix it "
                          "with --set")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", default=[],
                        help="override a config value (JSON or plain string; dotted keys reach sub-configs, "
                             "e.g. vision_config.depth=2); repeatable")
    parser.add_argument("--tie", action="store_true", help="tiny families: build with tied input/output embeddings")
    parser.add_argument("--plan", default="verl", metavar="PLAN",
                        help="verl (what the installed verl selects), skyrl, fixed, fixed-verl, hyperparallel, "
                             "or comma-separated module names (default: verl)")
    parser.add_argument("--layer-classes", metavar="NAMES",
                        help="comma-separated layer class names (default: the model's _no_split_modules)")
    parser.add_argument("--fused", action="store_true",
                        help="run verl's fused-kernel forward (apply_monkey_patch use_fused_kernels=True, torch "
                             "backend; return_dict=True, no labels)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--sweep", action="store_true",
                        help="audit every available vision/audio tiny family under verl, skyrl, fixed and "
                             "hyperparallel (ignores the model and plan options)")
    parser.add_argument("--markdown", action="store_true", help="with --sweep: a Markdown table")


def _check_plan_arg(plan):
    """Reject what cannot be a plan before building a model; module names are checked later."""
    if plan in PLANS:
        return
    parts = [p.strip() for p in (plan or "").split(",")]
    if not all(parts) or any(any(c.isspace() for c in p) for p in parts):
        raise AuditInputError("unknown --plan %r; valid: %s, or comma-separated module names" % (plan, ", ".join(PLANS)))


def run(args):
    """Run a parsed ``audit`` command; returns the exit code (0 clean, 1 hazards, 2 bad input)."""
    import fsdp2_compat

    fsdp2_compat.revert()  # audit upstream as released: nothing of ours applied in this process
    try:
        if args.sweep:
            rows = sweep()
            if args.json:
                json.dump(rows, sys.stdout, indent=2)
                sys.stdout.write("\n")
            else:
                print(format_sweep(rows, markdown=args.markdown))
            return 1 if any(r.get("hazards") for r in rows) else 0
        if not (args.model or args.config or args.config_json):
            raise AuditInputError("say what to audit: --model FAMILY (one of %s), --config CLASSNAME or "
                                  "--config-json PATH" % ", ".join(_families()))
        _check_plan_arg(args.plan)
        model, batch, label, notes = build_inputs(args)
        if args.fused:
            apply_fused(model)
        layer_classes = args.layer_classes.split(",") if args.layer_classes else None
        plan = args.plan if args.plan in PLANS else args.plan.split(",")
        rep = report(model, batch, plan, label, fused=args.fused, layer_classes=layer_classes, notes=notes)
    except AuditInputError as exc:
        print("fsdp2-compat audit: %s" % exc, file=sys.stderr)
        return 2
    if args.json:
        json.dump(rep, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_report(rep))
    return 1 if rep["hazards"] else 0


def main(argv=None):
    """``fsdp2-compat audit ...``: exit 0 when clean, 1 when hazards are found, 2 on bad input."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="fsdp2-compat audit",
        description="Find parameters that a FSDP2 wrap plan leaves sharded where another module's forward "
                    "reads them directly (one CPU forward of a tiny model; no GPU, no process group).")
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
