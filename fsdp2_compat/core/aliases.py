"""Rebind names that other modules imported from a patched module.

Upstream callers do ``from verl.utils.fsdp_utils import apply_fsdp2`` at
module top, so replacing the attribute on ``fsdp_utils`` alone leaves their
copy pointing at the old function.  We find such copies by identity in the
``__dict__`` of every loaded module and swap them too, remembering each swap
so that revert can undo exactly what was done.

Module ``__dict__`` is read directly (not ``getattr``/``dir``) so that lazy
modules such as transformers' ``_LazyModule`` are never asked to import more.
"""

import sys
import types


def rebind(original, replacement, skip=()):
    """Point every global name bound to ``original`` at ``replacement``.

    ``skip`` holds ``(module_name, attr)`` pairs left alone (the seam itself).
    Returns the list of ``(module_dict, module_name, attr)`` that changed.
    """
    changed = []
    for name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType):
            continue
        namespace = module.__dict__
        try:
            hits = [key for key, value in namespace.items() if value is original]
        except RuntimeError:  # dict changed size: a module importing on another thread
            hits = [key for key, value in list(namespace.items()) if value is original]
        for key in hits:
            if (name, key) in skip:
                continue
            namespace[key] = replacement
            changed.append((namespace, name, key))
    return changed


def restore(changed, original, replacement):
    """Undo ``rebind``; names rebound since by someone else are left alone."""
    kept = []
    for namespace, name, key in changed:
        if namespace.get(key) is replacement:
            namespace[key] = original
        else:
            kept.append("%s.%s" % (name, key))
    return kept
