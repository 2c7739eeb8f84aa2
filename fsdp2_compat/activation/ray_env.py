"""Ray: carry fsdp2-compat into every worker process of a job.

Ray workers are separate processes: a patch applied in the driver does not
reach them.  ``runtime_env()`` returns the job-level runtime_env entries that
do::

    import ray
    from fsdp2_compat.activation.ray_env import runtime_env

    ray.init(runtime_env=runtime_env("glm4v", base={"env_vars": {"MY_VAR": "1"}}))

- ``env_vars["FSDP2_COMPAT_PATCHES"]``: every worker (and the verl plugin or
  the start-up bootstrap there) sees the selection;
- ``worker_process_setup_hook = "fsdp2_compat.activation.ray_env.setup_worker"``: each
  worker requests the patches before it runs any task or actor, with no verl
  import needed (SkyRL, plain Ray programs).

Ray honours ``worker_process_setup_hook`` only in the *job* runtime_env
(``ray.init(runtime_env=...)`` or a job submission); in an actor's or task's
``.options(runtime_env=...)`` Ray 2.x ignores it (checked on ray 2.60), so there
only ``env_vars`` plus the plugin or the bootstrap take effect.  Job-level
``env_vars`` (including the hook's) are merged into actor-level ones.

Merging into ``base`` never clobbers: the user's other ``env_vars`` and keys are
kept; a different ``FSDP2_COMPAT_PATCHES`` already in ``base`` is an error;
a user setup hook is composed, ours first:

- a dotted string: moved to ``env_vars["FSDP2_COMPAT_RAY_CHAINED_SETUP_HOOK"]``
  and called by ``setup_worker`` after ours (works with job submission, which
  accepts strings only);
- a callable: wrapped in a function that calls ours, then it (Ray pickles it).

The driver itself is not a Ray worker: call ``fsdp2_compat.apply(...)`` there if
the driver builds FSDP2 models.

This module never imports ray; ``setup_worker`` is stdlib only.
(Named ``ray_env``, not ``ray``: with absolute imports ``activation/ray.py``
would not shadow the real package, but anything that puts this folder on
``sys.path`` -- running a file in it as a script -- would, and tracebacks
mentioning ``ray.py`` would mislead.)
"""

import importlib
import os

from ..core import config
from . import bootstrap

SETUP_HOOK = "fsdp2_compat.activation.ray_env.setup_worker"
CHAINED_HOOK_ENV = "FSDP2_COMPAT_RAY_CHAINED_SETUP_HOOK"
_RAY_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"  # Ray-internal; refuses user values


def _selection_text(patches):
    if isinstance(patches, str):
        return patches.strip()
    return ",".join(str(p).strip() for p in patches)


def runtime_env(patches=None, base=None):
    """Return a new job runtime_env: ``base`` plus what fsdp2-compat needs in workers.

    ``patches``: a selection string (``"glm4v"``, ``"all"``, ``"-qwen3vl"``) or
    an iterable of names; None takes ``base``'s ``FSDP2_COMPAT_PATCHES``, else
    this process's, else ``"all"``.  It is validated here, so a typo fails in
    the driver (``fsdp2_compat.ConfigError``), not in every worker.
    ``base``: an existing runtime_env (dict or ``ray.runtime_env.RuntimeEnv``);
    it is not modified.  Raises ``ValueError`` on a conflicting
    ``FSDP2_COMPAT_PATCHES`` or chained hook already in ``base``.
    """
    from ..core import engine

    env = dict(base or {})
    env_vars = dict(env.get("env_vars") or {})
    if _RAY_HOOK_ENV in env_vars:
        raise ValueError("runtime_env env_vars may not set %s (Ray-internal)" % _RAY_HOOK_ENV)

    existing = env_vars.get(config.PATCHES_ENV)
    if patches is None:
        selection = (existing or "").strip() or config.implicit_selection() or "all"
    else:
        selection = _selection_text(patches) or "all"
        if existing is not None and existing.strip():
            if engine.resolve_names(existing) != engine.resolve_names(selection):
                raise ValueError(
                    "runtime_env(patches=%r): base env_vars already set %s=%r; pass patches=None to keep it"
                    % (patches, config.PATCHES_ENV, existing)
                )
            selection = existing.strip()
    engine.resolve_names(selection)  # ConfigError on a typo, here in the driver
    env_vars[config.PATCHES_ENV] = selection

    hook = env.get("worker_process_setup_hook")
    if hook is None or hook == SETUP_HOOK or getattr(hook, "_fsdp2_compat_chained", None) is not None:
        env["worker_process_setup_hook"] = hook or SETUP_HOOK
    elif isinstance(hook, str):
        chained = env_vars.get(CHAINED_HOOK_ENV)
        if chained and chained != hook:
            raise ValueError(
                "base env_vars %s=%r conflicts with worker_process_setup_hook=%r" % (CHAINED_HOOK_ENV, chained, hook)
            )
        env_vars[CHAINED_HOOK_ENV] = hook
        env["worker_process_setup_hook"] = SETUP_HOOK
    elif callable(hook):
        env["worker_process_setup_hook"] = _compose(hook)
    else:
        raise TypeError("worker_process_setup_hook must be a dotted string or a callable, got %r" % (hook,))
    env["env_vars"] = env_vars
    return env


def _compose(user_hook):
    def chained_setup_hook():
        setup_worker()
        return user_hook()

    name = "fsdp2_compat_then_%s" % getattr(user_hook, "__name__", "hook")
    chained_setup_hook.__name__ = chained_setup_hook.__qualname__ = name
    chained_setup_hook._fsdp2_compat_chained = user_hook
    return chained_setup_hook


def _load_dotted(path):
    # Same rule as Ray's load_class: "pkg.mod.func" -> pkg.mod, func.
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError("%s=%r is not a dotted 'module.function' path" % (CHAINED_HOOK_ENV, path))
    return getattr(importlib.import_module(module_name), attr)


def setup_worker():
    """Ray ``worker_process_setup_hook``: request the patches in this worker.

    Then calls the user's hook chained by ``runtime_env()``, if any.  A bad
    selection raises (Ray then stops the worker and reports this message):
    ``runtime_env()`` already validated it in the driver.
    """
    bootstrap.activate("ray")
    chained = os.environ.get(CHAINED_HOOK_ENV, "").strip()
    if chained:
        _load_dotted(chained)()
