"""What each FSDP2 unit collective is about to do, told to listeners before it runs.

Every collective an FSDP2 unit issues goes through one of two module globals
of ``torch.distributed.fsdp._fully_shard._fsdp_param_group``:
``foreach_all_gather(fsdp_params, group, ...)`` (from ``FSDPParamGroup.unshard``:
a unit's forward, its backward, a prefetch or an explicit ``unshard()``) and
``foreach_reduce(fsdp_params, unsharded_grads, reduce_scatter_group, ...)``
(from ``FSDPParamGroup.post_backward``, with only the parameters that have a
gradient).  ``listen(fn)`` wraps both (once, for every listener) and calls
``fn(event)`` before the collective with a ``Collective``; a listener that
raises stops the collective.  ``unlisten(fn)`` removes it; with no listener
left torch's functions are put back.

The unit (``FSDPParamGroup``) is the caller's ``self``: the wrapper looks at
most a few frames up for it (torch calls both functions from a method of the
group; the accumulation fix's wrapper of ``post_backward`` calls torch's own
method, so the calling frame is still torch's).  Without it the event still
carries the parameters, named by their ``_param_fqn``.

Listeners: the guard (``guard.agree.check``) and the audit's recorder
(the harness's ``audit.divergence``).
"""

import inspect
import sys
import zlib

ALL_GATHER, REDUCE_SCATTER = "all-gather", "reduce-scatter"
# argument names read from each function (bound by name: any calling convention)
_ARGS = {"foreach_all_gather": ("fsdp_params", "group"),
         "foreach_reduce": ("fsdp_params", "reduce_scatter_group")}
_KIND = {"foreach_all_gather": ALL_GATHER, "foreach_reduce": REDUCE_SCATTER}

_listeners = []
_originals = {}  # name -> torch's function, while wrapped
_counts = {}  # (kind, unit) -> how many this pass (reset by the first forward all-gather after a reduce)
_last = {"kind": None}


class Collective:
    """One unit collective about to run on this rank.

    kind        ``"all-gather"`` or ``"reduce-scatter"``
    phase       ``"forward"``, ``"backward"``, ``"after backward"`` (a reduce-scatter) or ``"outside forward/backward"``
    unit        the unit's module path (``""`` is the root)
    params      names of the parameters it moves (a reduce-scatter: those with a gradient)
    unit_params names of every parameter of the unit
    nth         1 for the unit's first collective of this kind in this forward + backward, 2 for the second ...
    group       the process group it runs on; ``device`` the device a collective on it needs
    model_type  ``config.model_type`` of the root module, when known
    """

    __slots__ = ("kind", "phase", "unit", "params", "unit_params", "nth", "group", "device", "model_type")

    def __init__(self, kind, phase, unit, params, unit_params, nth, group, device, model_type):
        self.kind = kind
        self.phase = phase
        self.unit = unit
        self.params = tuple(params)
        self.unit_params = tuple(unit_params)
        self.nth = nth
        self.group = group
        self.device = device
        self.model_type = model_type

    def code(self):
        """Four integers equal on every rank exactly when the ranks are about to run the same collective."""
        return [1 if self.kind == ALL_GATHER else 2, _crc(self.unit), len(self.params), _crc("\n".join(self.params))]

    def describe(self):
        """A plain dict (picklable) for the other ranks' error message."""
        return {"kind": self.kind, "phase": self.phase, "unit": self.unit, "params": list(self.params),
                "unit_params": list(self.unit_params), "nth": self.nth, "model_type": self.model_type}


def _crc(text):
    return zlib.crc32(text.encode("utf-8"))


def _group_of_caller(fsdp_params):
    """The ``FSDPParamGroup`` whose method called the wrapped function (a few frames up), or None."""
    frame = sys._getframe(1)
    for _ in range(6):  # this function, _event, the wrapper, then torch's method (or a wrapper of it)
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and type(owner).__name__ == "FSDPParamGroup" and hasattr(owner, "fsdp_params"):
            if fsdp_params is owner.fsdp_params or all(any(p is q for q in owner.fsdp_params) for p in fsdp_params):
                return owner
        frame = frame.f_back
    return None


def _phase(kind, group):
    if kind == REDUCE_SCATTER:
        return "after backward"
    state = getattr(getattr(group, "_training_state", None), "name", "")
    return {"FORWARD": "forward", "PRE_BACKWARD": "backward", "POST_BACKWARD": "backward"}.get(
        state, "outside forward/backward")


_root_model_type = {"value": None}


def _model_type(group):
    for module in getattr(group, "modules", ()) or ():
        mt = getattr(getattr(module, "config", None), "model_type", None)
        if mt:
            if getattr(group, "_module_fqn", None) == "":
                _root_model_type["value"] = mt
            return mt
    return _root_model_type["value"]


def _name(fsdp_param):
    return getattr(fsdp_param, "_param_fqn", None) or "?"


def _device(pg, fsdp_params):
    import torch
    import torch.distributed as dist

    try:
        backend = str(dist.get_backend(pg)).lower()
    except Exception:  # noqa: BLE001 - an unregistered group: the parameters' device
        backend = ""
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if "gloo" in backend or "fake" in backend or not fsdp_params:
        return torch.device("cpu")
    return getattr(fsdp_params[0], "device", torch.device("cpu"))


def _event(name, bound):
    fsdp_params, pg = (bound.get(a) for a in _ARGS[name])
    fsdp_params = list(fsdp_params or ())
    kind = _KIND[name]
    group = _group_of_caller(fsdp_params)
    unit = getattr(group, "_module_fqn", None)
    if unit is None:  # the longest module path the parameters share
        parts = [n.split(".")[:-1] for n in map(_name, fsdp_params)] or [[]]
        common = []
        for level in zip(*parts):
            if len(set(level)) != 1:
                break
            common.append(level[0])
        unit = ".".join(common)
    if kind == ALL_GATHER and _last["kind"] == REDUCE_SCATTER:
        _counts.clear()  # a new forward after a backward: count again
    _last["kind"] = kind
    key = (kind, unit)
    _counts[key] = _counts.get(key, 0) + 1
    unit_params = [_name(p) for p in getattr(group, "fsdp_params", fsdp_params)]
    return Collective(kind, _phase(kind, group), unit, [_name(p) for p in fsdp_params], unit_params, _counts[key],
                      pg, _device(pg, fsdp_params), _model_type(group))


def _wrap(name, original):
    signature = inspect.signature(original)

    def guarded(*args, **kwargs):
        if _listeners:
            bound = signature.bind_partial(*args, **kwargs).arguments
            event = _event(name, bound)
            for listener in list(_listeners):
                listener(event)
        return original(*args, **kwargs)

    guarded.__wrapped__ = original
    guarded.__name__ = original.__name__
    guarded.__qualname__ = getattr(original, "__qualname__", original.__name__)
    guarded.__doc__ = original.__doc__
    guarded.fsdp2_compat_guard = True  # what tests and status look for
    return guarded


def refusal(module):
    """Why the functions of ``module`` cannot be read (None when they can)."""
    for name, wanted in _ARGS.items():
        fn = module.__dict__.get(name)
        if fn is None:
            return "%s.%s does not exist in this torch" % (module.__name__, name)
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError) as exc:
            return "%s.%s has no readable signature (%s)" % (module.__name__, name, exc)
        missing = [a for a in wanted if a not in params]
        if missing:
            return "%s.%s takes no %s in this torch" % (module.__name__, name, ", ".join(missing))
    return None


def listen(fn, module=None):
    """Call ``fn(Collective)`` before every FSDP2 unit collective of this process.

    Returns None, or the reason the installed torch cannot be read (then one WARNING on the ``fsdp2_compat``
    logger and nothing is wrapped)."""
    if module is None:
        import importlib

        module = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_param_group")
    if not _originals:
        why = refusal(module)
        if why is not None:
            import logging

            logging.getLogger("fsdp2_compat").warning("fsdp2-compat: the collective guard is off: %s", why)
            return why
        for name in _ARGS:
            _originals[name] = (module, module.__dict__[name])
            setattr(module, name, _wrap(name, module.__dict__[name]))
    if fn not in _listeners:
        _listeners.append(fn)
    return None


def unlisten(fn):
    """Stop calling ``fn``; torch's functions are restored when no listener is left."""
    if fn in _listeners:
        _listeners.remove(fn)
    if not _listeners:
        for name, (module, original) in list(_originals.items()):
            if getattr(module.__dict__.get(name), "__wrapped__", None) is original:
                setattr(module, name, original)
            del _originals[name]
        _counts.clear()
        _last["kind"] = None


def listening():
    """The listeners now installed (tests: the guard off installs nothing)."""
    return list(_listeners)
