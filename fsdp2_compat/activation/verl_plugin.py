"""verl plugin: ``import verl`` (0.9.0+) activates fsdp2-compat in every process.

Registered in the ``verl.plugins`` entry-point group under the name
``fsdp2_compat`` (value ``fsdp2_compat.activation.verl_plugin``).  verl
0.9.x's ``verl/__init__.py`` imports every entry point of that group
(``ep.load()``; it calls nothing), after ``verl.protocol`` and before any of
``verl.utils.fsdp_utils`` or the model modules are imported, so the work is
done by importing this module.  verl's policy variable
``VERL_USE_EXTERNAL_PLUGINS`` selects plugins: ``auto`` (default) loads all,
``none`` none, ``a,b`` only those names (include ``fsdp2_compat``).

Decision (``DECISION``, also in ``bootstrap.decisions()``), the implicit
policy of ``fsdp2_compat.core.config``:

- ``FSDP2_COMPAT_PATCHES`` unset or blank: nothing is applied.  An installed
  package must not silently change training; the plugin logs once at INFO
  that it is loaded and inactive.
- set: the named patches are requested (``all`` for every patch), each
  applying when its upstream module is imported.
- anything goes wrong (a typo in the selection, a broken install): a WARNING on
  the ``fsdp2_compat`` logger and nothing applied.  verl logs plugin load
  errors at DEBUG only, so this module never lets an exception reach verl.

Read ``DECISION`` through ``sys.modules.get("fsdp2_compat.activation.verl_plugin")``:
importing this module *is* loading the plugin.
"""

import logging

DECISION = None
"""What the plugin did in this process (a dict; see ``bootstrap.decision``)."""


def _load():
    global DECISION
    log = logging.getLogger("fsdp2_compat")
    try:
        from . import bootstrap

        DECISION = bootstrap.activate("plugin")
    except Exception as exc:
        error = "%s: %s" % (type(exc).__name__, exc)
        try:
            from . import bootstrap

            DECISION = bootstrap.record("plugin", bootstrap.decision("plugin", False, "error", error=error))
        except Exception:  # the package itself is broken: there is nothing to record into
            pass
        log.warning("fsdp2-compat verl plugin applied nothing: %s", error)
        return
    if DECISION["active"]:
        log.info(
            "fsdp2-compat verl plugin: requested %s (%s)", ", ".join(DECISION["requested"]), DECISION["reason"]
        )
    else:
        log.info("fsdp2-compat verl plugin loaded, inactive: %s", DECISION["reason"])


try:
    _load()
except Exception:  # logging itself failed: still never raise into verl
    pass
