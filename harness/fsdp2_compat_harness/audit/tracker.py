"""One CPU forward that sees every raw read of a parameter outside its unit's forward.

Forward pre/post hooks track which modules' forwards are active; a
``TorchFunctionMode`` watches every torch call.  A parameter whose owning
unit's forward is not active is treated as a sharded value; its taint
follows the ops applied to it alone (``view``, ``permute``, ``to`` ... as
DTensor would), and the op where it meets a plain tensor with more than one
element is where FSDP2 would raise.  Metadata access (``.shape``,
``.device``, ``.dtype``, ``.size()``, ``.dim()`` ...) is not a read.
"""

from .advice import Coverage
from .findings import AuditInputError, Hazard
from .ownership import parameter_owners
from .plans import module_names

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
    names = module_names(model)
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
    cover = Coverage(model, plan, units, owners)
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
