"""How the collective guard is switched on and off (``FSDP2_COMPAT_GUARD``), and what it costs when off.

Off (the default) nothing is installed: no post-import hook, no wrapper of torch's functions, no module of
the guard's torch side loaded.  On, it reaches a process the ways the patches do (the start-up ``.pth``
line runs for either variable, ``bootstrap.activate`` behind the ``.pth``, the verl plugin and the Ray hook,
and ``import fsdp2_compat.auto``), without importing torch: it binds when torch's FSDP2 is imported.
"""

import pytest

from fsdp2_compat.core import config

DEPENDS_ON = ("python",)

FSDP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"


@pytest.mark.parametrize("value, on", [("1", True), ("on", True), (" yes ", True), ("0", False), ("", False),
                                       (None, False)])
def test_the_variable_follows_the_one_truthiness_rule(value, on):
    environ = {} if value is None else {config.GUARD_ENV: value}
    assert config.guard_requested(environ) is on


def test_the_pth_line_runs_for_the_guard_variable_too():
    line = config.PTH_LINE
    assert 'os.environ.get("%s", "")' % config.GUARD_ENV in line
    assert 'os.environ.get("%s", "")' % config.PATCHES_ENV in line
    compile(line, config.PTH_NAME, "exec")
    env = {}
    exec(line.replace("import %s as b; b.startup()" % config.BOOTSTRAP_MODULE, "pass"), {"os": _Env(env)})


class _Env:
    """``os`` with an empty environment: the line must not import anything then."""

    def __init__(self, environ):
        self.environ = environ


# no patch requested (the accumulation fix waits for the same module): only the guard can wait for it
@pytest.mark.parametrize("env, waiting", [({"FSDP2_COMPAT_PATCHES": "none"}, False),
                                          ({"FSDP2_COMPAT_PATCHES": "none", "FSDP2_COMPAT_GUARD": "1"}, True)])
def test_auto_import_loads_no_torch_and_waits_for_fsdp_only_when_asked(python, env, waiting):
    proc = python(
        """
        import sys
        import fsdp2_compat.auto
        from fsdp2_compat.core import hooks
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "wrapt", "inspect", "logging")))
        print(%r in hooks.waiting())
        print(sorted(m for m in sys.modules if m.startswith("fsdp2_compat.guard")))
        """ % FSDP, env=env)
    imported, is_waiting, guard_modules = proc.stdout.strip().splitlines()
    assert imported == "[]"
    assert is_waiting == str(waiting)
    assert "collectives" not in guard_modules and "agree" not in guard_modules


@pytest.mark.parametrize("how", ["auto", "bootstrap"])
@pytest.mark.parametrize("env", [{}, {"FSDP2_COMPAT_GUARD": "1"}])
def test_torch_functions_are_wrapped_only_with_the_guard_on(warm_python, how, env):
    pytest.importorskip("torch")
    entry = "import fsdp2_compat.auto" if how == "auto" else \
        "from fsdp2_compat.activation import bootstrap; bootstrap.startup()"
    proc = warm_python(
        """
        import sys
        %s
        import torch.distributed.fsdp
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as m
        from fsdp2_compat import guard
        wrapped = [getattr(getattr(m, n), "fsdp2_compat_guard", False) for n in ("foreach_all_gather", "foreach_reduce")]
        print(wrapped, "fsdp2_compat.guard.collectives" in sys.modules, guard.status()["installed"])
        guard.uninstall()
        print([getattr(getattr(m, n), "fsdp2_compat_guard", False) for n in ("foreach_all_gather", "foreach_reduce")])
        """ % entry, env=env)
    on = bool(env)
    first, after = proc.stdout.strip().splitlines()[-2:]
    assert first == "%s %s %s" % ([on, on], on, on), proc.stdout
    assert after == "[False, False]", proc.stdout  # uninstall puts torch's functions back
