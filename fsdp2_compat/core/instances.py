"""Objects that captured a method bound to themselves before a patch replaced it on their class.

A seam on ``Cls.method`` replaces the class attribute.  An object built before
that and holding the original bound to itself in its own ``__dict__`` keeps
calling upstream's code: ms-swift 4.6.0's loader saves
``model.origin_forward = model.forward`` and installs a ``forward`` of its own
that calls it, so a patch requested after the model was loaded never ran for
that model, and nothing said so.  When the engine applies a ``Class.method``
target to a module that was imported before the request (the only time such
objects can exist), ``rebind`` points each such attribute at the replacement
bound to the same object, and ``restore`` (revert) puts back what was there.
The engine names every rebound attribute in the target's outcome, which
``fsdp2-compat status`` shows.  ``rebind_assigned`` does the same for a module
function a trainer assigned over a class method before the request
(``Target.assigned_to``: lmms-engine's forwards).

Finding them: instances of a heap type refer to their type, so one
``gc.get_referrers`` of the class and its subclasses finds every instance in
one pass over the tracked objects (tens of milliseconds in a training
process), on a late apply only.  Stdlib only.
"""

import gc
import types
from collections import namedtuple

# One attribute pointed at the replacement: ``namespace[key]`` held ``old`` and now holds ``new``; ``label`` names it
# for ``status`` (``"Class.key (id 0x...)"``).  ``namespace`` is an instance ``__dict__`` or a ``_ClassNamespace``.
Rebound = namedtuple("Rebound", "namespace label key old new")


def _family(cls):
    """``cls`` and every subclass of it."""
    found, todo = [], [cls]
    while todo:
        c = todo.pop()
        if c not in found:
            found.append(c)
            todo.extend(c.__subclasses__())
    return tuple(found)


def rebind(cls, original, replacement):
    """Point every instance attribute holding ``original`` bound to its own instance at ``replacement`` bound
    to it.  Returns ``[Rebound]`` for ``restore``."""
    classes = _family(cls)
    changed = []
    for obj in gc.get_referrers(*classes):
        namespace = getattr(obj, "__dict__", None) if isinstance(obj, classes) else None
        if not isinstance(namespace, dict):
            continue
        for key, value in list(namespace.items()):
            if isinstance(value, types.MethodType) and value.__func__ is original and value.__self__ is obj:
                new = replacement.__get__(obj, type(obj))
                namespace[key] = new
                changed.append(Rebound(namespace, "%s.%s (id %#x)" % (type(obj).__name__, key, id(obj)), key, value, new))
    return changed


def rebind_assigned(holders, original, replacement):
    """Point each class attribute of ``holders`` (``"pkg.mod:Class.attr"``, ``Target.assigned_to``) that holds
    the function ``original`` at ``replacement``; a module not imported, or an attribute holding anything else,
    is left alone.  Returns the changes, as ``rebind`` does, for ``restore``."""
    import sys

    changed = []
    for holder in holders:
        module_name, _, path = holder.partition(":")
        cls_name, _, key = path.rpartition(".")
        cls = getattr(sys.modules.get(module_name), cls_name, None)
        if isinstance(cls, type) and cls.__dict__.get(key) is original:
            setattr(cls, key, replacement)
            changed.append(Rebound(_ClassNamespace(cls), "%s.%s" % (cls.__name__, key), key, original, replacement))
    return changed


class _ClassNamespace:
    """A class seen as ``restore`` reads a namespace (a class ``__dict__`` is read-only: writes go through setattr)."""

    __slots__ = ("cls",)

    def __init__(self, cls):
        self.cls = cls

    def get(self, key):
        return self.cls.__dict__.get(key)

    def __setitem__(self, key, value):
        setattr(self.cls, key, value)


def restore(changed):
    """Undo ``rebind``; an attribute someone set since is left alone and its label returned."""
    kept = []
    for r in changed:
        if r.namespace.get(r.key) is r.new:
            r.namespace[r.key] = r.old
        else:
            kept.append(r.label)
    return kept
