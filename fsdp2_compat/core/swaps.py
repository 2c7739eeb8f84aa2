"""Installing one seam's replacements, all or nothing, and undoing them by identity.

``install`` calls the target's seam, stores every replacement it returns (a
module global, or ``Class.method`` through ``setattr``: a class ``__dict__``
is read-only), asks for the aliases of the target's own global to be rebound
and, on a late apply, for objects that hold the original bound to themselves
(``instances``).  ``undo`` restores each attribute only where the replacement
still stands, and names what someone else rebound since.  The engine owns the
requests, the lock and the batch the alias rebinds wait in; this module owns
what one apply changed (``Applied``) and which objects are ours (``is_ours``).

Stdlib only at top level: imported with ``fsdp2_compat.core.engine``.
"""

import sys
from collections import namedtuple

from . import calls

Swap = namedtuple("Swap", "attr original replacement")  # one attribute of a seam's module replaced
# The aliases of one replaced global: ``changed`` fills with ``aliases.Change`` when the rebind runs.
Aliases = namedtuple("Aliases", "original replacement changed")

_replacements = {}  # id(replacement) -> target key, for "is this ours?"


class Applied:
    """Everything a successful apply changed, so revert can undo it."""

    __slots__ = ("module", "swaps", "aliases", "instances")

    def __init__(self, module):
        self.module = module
        self.swaps = []  # [Swap]
        self.aliases = []  # [Aliases]
        self.instances = []  # [instances.Rebound]: objects that held the original bound to themselves


def is_ours(obj):
    """True when ``obj`` is a replacement installed by fsdp2-compat and not reverted."""
    return id(obj) in _replacements


def active_targets():
    """Keys of the targets whose replacements are installed right now (the engine holds its lock)."""
    return sorted(set(_replacements.values()))


def _store(module, attr, value):
    owner, name = calls.owner_of(module, attr)
    setattr(owner, name, value)


def _resolve(dotted):
    module_name, _, func = dotted.partition(":")
    __import__(module_name)
    return getattr(sys.modules[module_name], func)


def install(applied, target, late, rebind):
    """Install every replacement of ``target``'s seam in ``applied.module``, recording each in ``applied``.

    ``rebind(original, replacement, skip, changed)`` asks for the aliases of the target's global to be
    rebound into the list ``changed``; ``late``: the module was imported before the request, so objects may
    hold the original bound to themselves (``instances``).  On an exception the caller undoes ``applied``
    (all or nothing): what was installed so far is recorded there."""
    module = applied.module
    replacements = _resolve(target.seam)(module, target.attr)
    if target.attr not in replacements:
        raise TypeError("seam %s did not replace %s" % (target.seam, target.attr))
    for attr, new in replacements.items():
        old = calls.lookup(module, attr)
        if old is None:
            raise TypeError("seam %s replaced %s, which %s does not define" % (target.seam, attr, target.module))
        _store(module, attr, new)
        applied.swaps.append(Swap(attr, old, new))
        _replacements[id(new)] = target.key
    # Only the target's own name is looked up by callers under aliases, and
    # only a module global can be imported by name; helper globals a seam
    # swaps (e.g. ``fully_shard``) are private to the module and are the
    # same object as torch's everywhere else.
    for swap in applied.swaps:
        if swap.attr == target.attr and "." not in swap.attr:
            group = Aliases(swap.original, swap.replacement, [])
            applied.aliases.append(group)
            rebind(swap.original, swap.replacement, {(module.__name__, swap.attr)}, group.changed)
            if late and target.assigned_to:  # classes a trainer gave the function to before the request
                from . import instances

                applied.instances = instances.rebind_assigned(target.assigned_to, swap.original,
                                                              swap.replacement)
        elif swap.attr == target.attr and late:
            from . import instances

            applied.instances = instances.rebind(calls.owner_of(module, swap.attr)[0], swap.original,
                                                 swap.replacement)


def undo(applied, rebind_back):
    """Restore originals by identity; returns the names someone else rebound since (left alone).

    ``rebind_back(replacement, original)``: give the original back to modules that copied the
    replacement while the patch was on (``from fsdp_utils import apply_fsdp2``)."""
    from . import aliases

    kept = []
    for swap in reversed(applied.swaps):
        if calls.lookup(applied.module, swap.attr) is swap.replacement:
            _store(applied.module, swap.attr, swap.original)
        else:
            kept.append("%s.%s" % (applied.module.__name__, swap.attr))
        _replacements.pop(id(swap.replacement), None)
    for group in reversed(applied.aliases):
        kept += aliases.restore(group.changed, group.original, group.replacement)
        rebind_back(group.replacement, group.original)
    if applied.instances:
        from . import instances

        kept += instances.restore(applied.instances)
    applied.aliases.clear()
    applied.swaps.clear()
    applied.instances = []
    return kept
