"""The ways user and upstream code call a method, to prove a method seam under each (issue #22).

A seam on ``Class.method`` is a ``wrapt.FunctionWrapper`` on the class; what
its wrapper receives depends on how the method is reached
(``fsdp2_compat.core.calls``).  ``calling(base, name, convention)`` returns a
subclass of ``base`` whose ``name`` override reaches ``base``'s (patched or
not) implementation one way; giving a real upstream object that class
(``adopt``) makes upstream's own callers (TRL's ``compute_loss``, torch's
backward) go through that convention, so a test observes the fix's effect,
not the wrapper alone:

    instance     no override: upstream's own ``self.name(...)``
    class        ``Base.name(self, ...)``: how an override usually calls the base
    super        ``super().name(...)``
    methodtype   ``types.MethodType(Base.name, self)(...)``
    descriptor   ``types.MethodType(vars(Base)[name], self)(...)``: the class
                 attribute itself, as ``inspect.getattr_static`` / ``vars()``
                 give it; wrapt then passes ``instance=None`` and self in ``args``
    keywords     ``Base.name(self=self, p=..., ...)``: every argument by keyword

Stdlib only.
"""

import types

CONVENTIONS = ("instance", "class", "super", "methodtype", "descriptor", "keywords")

_cache = {}


def _by_keyword(method, self, args, kwargs):
    """Every argument of ``method(self, *args, **kwargs)`` as a keyword (self included)."""
    import inspect

    signature = inspect.signature(method)
    out = {}
    for name, value in signature.bind(self, *args, **kwargs).arguments.items():
        kind = signature.parameters[name].kind
        if kind == inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind == inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TypeError("%s: extra positional arguments cannot go by keyword" % name)
        else:
            out[name] = value
    return out


def defined(cls, name):
    """The class attribute ``name`` as the nearest class of ``cls``'s MRO stores it (no descriptor binding)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    raise AttributeError("%s has no attribute %r" % (cls.__name__, name))


def calling(base, name, convention):
    """A subclass of ``base`` whose ``name`` calls ``base``'s by ``convention`` (``base`` itself for "instance")."""
    if convention not in CONVENTIONS:
        raise ValueError("unknown convention %r (known: %s)" % (convention, ", ".join(CONVENTIONS)))
    if convention == "instance":
        return base
    key = (base, name, convention)
    if key in _cache:
        return _cache[key]

    # Each override looks ``base``'s attribute up at call time: a patch applied or
    # reverted after the subclass was made is what it reaches.
    if convention == "class":
        def method(self, *args, **kwargs):
            return getattr(base, name)(self, *args, **kwargs)
    elif convention == "super":
        def method(self, *args, **kwargs):
            return getattr(super(subclass, self), name)(*args, **kwargs)
    elif convention == "methodtype":
        def method(self, *args, **kwargs):
            return types.MethodType(getattr(base, name), self)(*args, **kwargs)
    elif convention == "descriptor":
        def method(self, *args, **kwargs):
            return types.MethodType(defined(base, name), self)(*args, **kwargs)
    else:
        def method(self, *args, **kwargs):
            original = getattr(base, name)
            return original(**_by_keyword(original, self, args, kwargs))

    method.__name__ = name
    subclass = type("%s_%s" % (base.__name__, convention), (base,), {name: method})
    _cache[key] = subclass
    return subclass


def adopt(obj, base, name, convention):
    """Give ``obj`` (an instance of ``base``) the class that calls ``base.name`` by ``convention``; returns ``obj``."""
    obj.__class__ = calling(base, name, convention)
    return obj
