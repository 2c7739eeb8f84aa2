"""Post-import hooks: run a callback once a named module has finished importing.

Contract:
- ``when_imported(name, callback)`` calls ``callback(module)`` at once if
  ``name`` is already fully imported, otherwise right after its import
  finishes (after the module body ran, before the importer sees it).
- A callback never runs twice for the same registration, and never while the
  module is still half-initialised.
- Exceptions from callbacks are the caller's business: the engine wraps its
  callbacks so that a faulty patch cannot break the user's import.

Constraints: stdlib only, and only modules the interpreter has already loaded
(``sys``, ``_thread``), because this runs at ``import fsdp2_compat.auto`` and
from the interpreter-start bootstrap, where every millisecond is paid by every
Python process.  (wrapt has the same feature but importing it costs 50-100 ms.)

Mechanism: a finder at the front of ``sys.meta_path`` that answers only for
watched names.  It asks the other finders for the real spec and wraps the
spec's loader so that ``exec_module`` fires the hooks when it returns.
"""

import sys
import _thread

_lock = _thread.RLock()
_hooks = {}  # module name -> list of callbacks still waiting
_resolving = set()  # names our finder is resolving right now (no recursion)


def _is_ready(module):
    spec = getattr(module, "__spec__", None)
    return not getattr(spec, "_initializing", False)


def when_imported(name, callback):
    """Run ``callback(module)`` once ``name`` is imported (now, if it is)."""
    module = sys.modules.get(name)
    if module is not None and _is_ready(module):
        callback(module)
        return
    with _lock:
        _hooks.setdefault(name, []).append(callback)
        _install_finder()


def cancel(name, callback):
    """Forget a registration that has not fired yet (no error if it did)."""
    with _lock:
        waiting = _hooks.get(name, [])
        if callback in waiting:
            waiting.remove(callback)
        if not waiting:
            _hooks.pop(name, None)


def waiting():
    """Names of modules that still have hooks waiting for their import."""
    with _lock:
        return sorted(_hooks)


def _fire(name, module):
    with _lock:
        callbacks = _hooks.pop(name, [])
    for callback in callbacks:
        callback(module)


class _LoaderProxy:
    """Stand-in loader for loaders that refuse a per-instance ``exec_module``."""

    def __init__(self, loader, name):
        self._fsdp2_compat_loader = loader
        self._fsdp2_compat_name = name

    def create_module(self, spec):
        return self._fsdp2_compat_loader.create_module(spec)

    def exec_module(self, module):
        self._fsdp2_compat_loader.exec_module(module)
        _fire(self._fsdp2_compat_name, module)

    def __getattr__(self, attr):
        return getattr(self._fsdp2_compat_loader, attr)


class _Finder:
    """Meta-path finder that only watches names with pending hooks."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _hooks or fullname in _resolving:
            return None
        _resolving.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            _resolving.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        _wrap_loader(spec, fullname)
        return spec

    # Python's import system calls this on every finder; nothing is cached.
    def invalidate_caches(self):
        pass


def _wrap_loader(spec, fullname):
    loader = spec.loader
    original = loader.exec_module

    def exec_module(module):
        # Restore the class method first: the loader may be reused (reload).
        try:
            del loader.exec_module
        except AttributeError:
            pass
        original(module)
        _fire(fullname, module)

    try:
        # File loaders are one instance per module, so an instance attribute
        # is private to this import and keeps isinstance() checks true.
        loader.exec_module = exec_module
    except (AttributeError, TypeError):
        spec.loader = _LoaderProxy(loader, fullname)


_finder = _Finder()


def _install_finder():
    if not any(f is _finder for f in sys.meta_path):
        sys.meta_path.insert(0, _finder)
