"""fsdp2-compat: version-gated runtime fixes for FSDP2 in the frameworks people train with.

Enable at trainer start-up with ``import fsdp2_compat.auto`` (patches named in
``FSDP2_COMPAT_PATCHES``, all when unset) or programmatically::

    import fsdp2_compat
    fsdp2_compat.apply("glm4v")      # applies when verl / SkyRL are imported
    fsdp2_compat.status()            # what happened, per patch and target
    fsdp2_compat.revert()

Importing this package imports neither torch, transformers nor any framework;
the heavier helpers below load on first attribute access.

Layout: ``core/`` (what start-up loads: config, hooks, records, guards,
aliases, engine, status), ``registry`` (the catalogue: patches as lists of
fixes), ``fixes/`` (one ``Fix`` record per mechanism, and its code),
``integrations/`` (data: where each framework release keeps the code a fix
goes into), ``guard/`` (collective checks at run time), ``activation/`` (the
implicit ways in: start-up ``.pth``, verl plugin, Ray), ``cli/`` (``status``,
``doctor``, ``list``).  ``check`` and ``audit`` live in the harness, a
distribution of their own (``fsdp2_compat_harness``).
"""

__version__ = "0.1.0"

from .core.config import ConfigError  # noqa: E402  (stdlib only)
from .core.engine import Fsdp2CompatError, apply, patched, revert  # noqa: E402

_LAZY = {
    "select_wrap_targets": ("fsdp2_compat.fixes.selection", "select_wrap_targets"),
    "embeddings_tied": ("fsdp2_compat.fixes.selection", "embeddings_tied"),
    "status": ("fsdp2_compat.core.status", "status"),
    "gather_param": ("fsdp2_compat.fixes.gather", "gather_param"),
    "gathered": ("fsdp2_compat.fixes.gather", "gathered"),
    "GatherError": ("fsdp2_compat.fixes.gather", "GatherError"),
    "ray_runtime_env": ("fsdp2_compat.activation.ray_env", "runtime_env"),
}

__all__ = [
    "apply", "revert", "patched", "status", "select_wrap_targets", "embeddings_tied",
    "gather_param", "gathered", "GatherError", "ray_runtime_env", "Fsdp2CompatError", "ConfigError",
]


def __getattr__(name):
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError("module 'fsdp2_compat' has no attribute %r" % name) from None
    import importlib

    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value
