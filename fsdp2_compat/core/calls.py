"""What a seam's wrapper receives, read the same way however upstream's code was called.

A seam is a ``wrapt.FunctionWrapper`` whose wrapper gets
``(wrapped, instance, args, kwargs)``.  For a method (``Class.method`` targets,
and functions installed as methods: verl's ``forward_with_*_backend``, TRL's
``_fused_forward``) what wrapt passes depends on the call, wrapt 2.5.2:

    obj.m(x) / super().m(x) / Cls.m(obj, x) / MethodType(Cls.m, obj)(x)
                                        instance=obj,  args=(x,)
    vars(Cls)["m"](obj, x) / MethodType(vars(Cls)["m"], obj)(x)
    (the descriptor itself, as ``inspect.getattr_static`` returns it)
                                        instance=None, args=(obj, x)
    Cls.m(self=obj, x=x)                instance=None, args=(), kwargs={"self": obj, "x": x}

and any argument may come by keyword.  The one rule here: the wrapped
function's own positional arguments are ``(instance,) + args`` when wrapt bound
an instance and ``args`` otherwise; each parameter is then found by its name in
the original function's signature (position, else keyword, else its default).
A seam asks ``Signature.argument(name, ...)`` / ``Signature.receiver(...)`` and
never indexes ``args`` itself.  Calling through is always
``wrapped(*args, **kwargs)``: wrapt already made ``wrapped`` match ``args``.

A seam that cannot find what it needs (no model where one must be) calls
``missing``: a WARNING on the ``fsdp2_compat`` logger naming the target and
what was missing (once per target and reason: a training loop would repeat
it every step), and under strict mode (``FSDP2_COMPAT_STRICT``, or the patch
requested with ``strict=True``) a ``SeamInputError``.  Never a silent
call-through that leaves the user unfixed while ``status`` says "applied".

Cost: a ``Signature`` is built once per seam, when the target module is
imported (``inspect`` then); per call, ``receiver`` is one test and an index
and ``argument`` a dict lookup (see ``benchmarks/seam_calls.py``).

Stdlib only: the engine imports this module (``lookup``) at ``import fsdp2_compat.auto``.
"""

from . import config
from .outcomes import Fsdp2CompatError

_MISSING = object()
_warned = set()
# Which targets were requested with ``strict=True``: the engine's to know, handed in by the engine
# (``set_strict_source``) because the seams import this module and the engine imports the seams.
_strict_source = None


class SeamInputError(Fsdp2CompatError):
    """Strict mode: a seam did not find in its call what its fix needs (it would have been a no-op)."""


class Signature:
    """The parameters of one wrapped function, read once when its seam is built.

    ``function``  the original upstream function: the parameters are those of
                  the code that receives the call (TRL's ``_fused_forward`` is
                  ``functools.wraps``-ed to look like the model's forward: its
                  own ``fused_lm_head`` counts); a decorator that only passes
                  ``*args, **kwargs`` on (torch's ``post_backward``) is read
                  through to the function it wraps
    ``where``     what the messages call it; default ``"module.Class.method"``
                  from the function's ``__module__`` and ``__qualname__``
    """

    __slots__ = ("where", "names", "first", "_index", "_defaults", "_known")

    def __init__(self, function, where=None):
        if where is None:
            where = "%s.%s" % (getattr(function, "__module__", "?"), getattr(function, "__qualname__", function))
        self.where = where
        positional, defaults, known = [], {}, set()
        for p in _parameters(function):
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                known.add(p.name)
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                positional.append(p.name)
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.default is not p.empty:
                defaults[p.name] = p.default
        self.names = tuple(positional)
        self.first = positional[0] if positional else None
        self._index = {name: i for i, name in enumerate(positional)}
        self._defaults = defaults
        self._known = frozenset(known)

    def receiver(self, instance, args, kwargs):
        """The wrapped function's first argument (a method's self), or None when the call has none.

        Hot-path cheap: torch's per-parameter methods go through it.
        """
        if instance is not None:
            return instance
        if args:
            return args[0]
        return kwargs.get(self.first) if self.first is not None else None

    def argument(self, name, instance, args, kwargs, default=None):
        """The value the wrapped function receives for parameter ``name`` in this call.

        ``default`` when the call does not pass it and the signature has no
        default for it.  ``name`` must be a parameter of the function
        (``KeyError`` otherwise: a seam asking for a name upstream's code does
        not have is a bug in the seam, not a user's call).
        """
        if name not in self._known:
            raise KeyError("%s has no parameter %r (it has %s)" % (self.where, name, ", ".join(sorted(self._known))))
        index = self._index.get(name)
        if index is not None:
            if instance is not None:
                index -= 1
                if index < 0:
                    return instance
            if index < len(args):
                return args[index]
        value = kwargs.get(name, _MISSING)
        if value is not _MISSING:
            return value
        return self._defaults.get(name, default)


def owner_of(module, attr):
    """``(owner, name)``: the module, or the module-level class of a ``"Class.method"`` attr, and the leaf name."""
    from . import guards

    head, _, leaf = attr.rpartition(".")
    if not head:
        return module, attr
    owner = module.__dict__.get(head)
    if not isinstance(owner, type):
        raise guards.Drift("%s has no class %r" % (module.__name__, head))
    return owner, leaf


def lookup(module, attr):
    """The object ``attr`` names in ``module`` as defined there: the owner's own ``__dict__``
    (never an inherited or computed attribute), ``None`` when absent."""
    owner, name = owner_of(module, attr)
    return owner.__dict__.get(name)


def _parameters(function):
    import inspect

    while True:
        own = inspect.signature(function, follow_wrapped=False).parameters.values()
        passes_on = all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in own)
        if not passes_on or not hasattr(function, "__wrapped__"):
            return own
        function = function.__wrapped__  # one decorator layer at a time


def signature_of(module, attr):
    """``Signature`` of ``module.attr`` as the module defines it (``attr``: ``f`` or ``Class.method``)."""
    return Signature(lookup(module, attr), "%s.%s" % (module.__name__, attr))


def set_strict_source(source):
    """The engine's ``strict_requested(where)``: True when a patch asked for the target at ``where`` strictly."""
    global _strict_source
    _strict_source = source


def _strict_for(where):
    if config.strict_from_env():
        return True
    return _strict_source is not None and _strict_source(where)


def missing(where, what):
    """A seam at ``where`` found no ``what`` in its call: warn (once per pair), raise under strict mode.

    Returns normally when not strict: the seam then calls upstream's code
    unchanged, which is what an unpatched user gets.
    """
    message = "fsdp2-compat: %s was called without %s; its fix did not run for this call" % (where, what)
    if _strict_for(where):
        raise SeamInputError(message + " (strict mode)")
    key = (where, what)
    if key not in _warned:
        _warned.add(key)
        import logging

        logging.getLogger("fsdp2_compat").warning(message)


def before_each_call(module, attr, what, before):
    """``{attr: wrapper}``: each call of ``module.attr`` first runs ``before(self)`` (the method's receiver,
    however it was called), then upstream's code unchanged.  A call without a receiver is ``missing(what)``."""
    return _around_each_call(module, attr, what, before, None)


def after_each_call(module, attr, what, after):
    """``{attr: wrapper}``: upstream's code unchanged, then ``after(self)``, as ``before_each_call``."""
    return _around_each_call(module, attr, what, None, after)


def _around_each_call(module, attr, what, before, after):
    import wrapt

    signature = signature_of(module, attr)

    def _around(wrapped, instance, args, kwargs):
        receiver = signature.receiver(instance, args, kwargs)
        if receiver is None:
            missing(signature.where, what)
        elif before is not None:
            before(receiver)
        result = wrapped(*args, **kwargs)
        if receiver is not None and after is not None:
            after(receiver)
        return result

    return {attr: wrapt.FunctionWrapper(lookup(module, attr), _around)}
