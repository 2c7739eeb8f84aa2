"""Process-wide activation: the code behind every implicit way in.

Three mechanisms start fsdp2-compat without a line in the user's code, and all
three follow one rule: **apply only when ``FSDP2_COMPAT_PATCHES`` is set to a
non-empty value** (``all`` means every patch).  An installed package never
changes training on its own.

- Interpreter start: the wheel ships ``fsdp2_compat_bootstrap.pth`` (its one
  line is ``config.PTH_LINE``) into site-packages.  With the variable unset the
  line reads ``os.environ`` and stops: nothing is imported.  Set, it imports
  this package and calls ``startup()``.  ``FSDP2_COMPAT_DISABLE_BOOTSTRAP=1``
  turns this path off while keeping the variable for the other two.
- verl >= 0.9.0: ``fsdp2_compat.activation.verl_plugin`` (entry point group ``verl.plugins``).
- Ray workers: ``fsdp2_compat.activation.ray_env.setup_worker`` (``worker_process_setup_hook``).

``import fsdp2_compat.auto`` is the explicit way in and keeps its own rule
(unset means all).  ``VERL_USE_EXTERNAL_MODULES=fsdp2_compat.auto`` uses it.

Each mechanism records its decision here (``decisions()``), so status can say
what started fsdp2-compat in a process, and what declined to and why.

Importing this module has no side effects; it is stdlib only and cheap, since
the ``.pth`` path runs in every Python process of the environment.
"""

import os
import sys

from ..core import config

PTH_NAME = config.PTH_NAME  # where the start-up line lives; config owns it
PLUGIN_MODULE = "fsdp2_compat.activation.verl_plugin"  # the entry point's value (pyproject.toml)

_decisions = {}  # source ("bootstrap", "plugin", "ray") -> decision dict


def decision(source, active, reason, requested=(), error=None):
    """The record every way in leaves: ``{"source", "active", "requested", "reason", "error"}``."""
    return {
        "source": source,
        "active": bool(active),
        "requested": list(requested),
        "reason": reason,
        "error": error,
    }


def record(source, decision):
    """Remember ``decision`` as what ``source`` did in this process."""
    _decisions[source] = decision
    return decision


def decisions():
    """``{source: decision}`` for every mechanism that ran in this process.

    A decision is ``{"source", "active", "requested", "reason", "error"}``;
    a source that never ran (e.g. verl not imported: no plugin) is absent.
    """
    return {k: dict(v, requested=list(v["requested"])) for k, v in _decisions.items()}


def describe(decision):
    """One line for people, e.g. ``plugin loaded, inactive: FSDP2_COMPAT_PATCHES unset``."""
    what = {"bootstrap": "start-up bootstrap (.pth)", "plugin": "verl plugin", "ray": "Ray setup hook"}
    name = what.get(decision["source"], decision["source"])
    if decision.get("error"):
        return "%s loaded, failed: %s" % (name, decision["error"])
    if decision["active"]:
        return "%s loaded, active: requested %s (%s)" % (name, ", ".join(decision["requested"]), decision["reason"])
    return "%s loaded, inactive: %s" % (name, decision["reason"])


def installed_pth_files():
    """Paths of our ``.pth`` in this interpreter's site directories (empty: editable/not installed)."""
    import site

    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE and hasattr(site, "getusersitepackages"):
        dirs.append(site.getusersitepackages())
    found = []
    for d in dirs:
        path = os.path.join(d, PTH_NAME)
        if os.path.exists(path) and path not in found:
            found.append(path)
    return found


def plugin_registered():
    """True when ``verl.plugins`` holds our entry point (what verl 0.9+ would load)."""
    from importlib.metadata import entry_points

    try:
        eps = entry_points(group="verl.plugins")
    except TypeError:  # Python < 3.10 API
        eps = entry_points().get("verl.plugins", ())
    return any(ep.value.split(":")[0] == PLUGIN_MODULE for ep in eps)


def activation_summary():
    """What the implicit mechanisms did here, for ``fsdp2-compat status``.

    ``{"decisions": ..., "pth": [paths], "plugin_registered": bool, "lines": [str]}``;
    ``lines`` are ready to print.  Reads metadata (importlib.metadata): call it
    from status, never at start-up.
    """
    seen = decisions()
    pth = installed_pth_files()
    registered = plugin_registered()
    lines = []
    if "bootstrap" in seen:
        lines.append("bootstrap: " + describe(seen["bootstrap"]))
    elif pth:
        reason = "%s unset" % config.PATCHES_ENV if config.implicit_selection() is None else "did not run in this process"
        lines.append("bootstrap: start-up bootstrap (.pth) installed, inactive: %s" % reason)
    else:
        lines.append("bootstrap: no %s in site-packages (editable install?): start-up bootstrap off" % PTH_NAME)
    if "plugin" in seen:
        lines.append("plugin: " + describe(seen["plugin"]))
    elif registered:
        lines.append("plugin: verl plugin registered, not loaded in this process (verl not imported, verl < 0.9.0, "
                     "or VERL_USE_EXTERNAL_PLUGINS excludes it)")
    else:
        lines.append("plugin: verl plugin not registered (reinstall fsdp2-compat)")
    if "ray" in seen:
        lines.append("ray: " + describe(seen["ray"]))
    return {"decisions": seen, "pth": pth, "plugin_registered": registered, "lines": lines}


def activate(source, environ=None):
    """Request the patches named in ``FSDP2_COMPAT_PATCHES``; record and return the decision.

    ``FSDP2_COMPAT_GUARD`` set: the collective guard is installed first (``fsdp2_compat.guard``), whatever
    the patches' variable says.

    Unset or blank: nothing is requested (and nothing imported beyond this
    package).  A selection that cannot be parsed raises
    ``fsdp2_compat.ConfigError`` after recording the failure: each caller
    decides how loud to be.
    """
    from .. import guard

    guard.install_if_requested(environ)  # FSDP2_COMPAT_GUARD: its own switch, whatever the patches say
    selection = config.implicit_selection(environ)
    if selection is None:
        return record(source, decision(source, False, "%s unset" % config.PATCHES_ENV))
    from ..core import engine

    try:
        requested = engine.apply(selection)
    except Exception as exc:
        record(
            source,
            decision(source, False, "%s=%s" % (config.PATCHES_ENV, selection), error="%s: %s" % (type(exc).__name__, exc)),
        )
        raise
    reason = "%s=%s" % (config.PATCHES_ENV, selection)
    if not requested:
        return record(source, decision(source, False, reason + " selects no patch"))
    return record(source, decision(source, True, reason, requested))


def startup():
    """Called by the ``.pth`` line at interpreter start (variable set). Never raises.

    Prints at most one line to stderr, and only when it could not do what the
    variable asks (a typo in the selection, a broken installation).
    """
    try:
        if config.bootstrap_disabled():
            record("bootstrap", decision("bootstrap", False, "%s is set" % config.DISABLE_BOOTSTRAP_ENV))
            return
        activate("bootstrap")
    except Exception as exc:  # site start-up must never fail because of us
        try:
            sys.stderr.write(
                "fsdp2-compat: start-up bootstrap applied nothing: %s: %s\n"
                % (type(exc).__name__, str(exc).replace("\n", " "))
            )
        except Exception:
            pass
