"""``fsdp2_compat.core.hooks``: a callback runs once a module has finished importing."""

import importlib
import sys

import pytest

from fsdp2_compat.core import hooks

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python",)


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def make(name, body="VALUE = 1\n"):
        (tmp_path / (name + ".py")).write_text(body)
        importlib.invalidate_caches()
        names.append(name)
        return name

    yield make
    for name in names:
        sys.modules.pop(name, None)
        hooks._hooks.pop(name, None)


def test_hook_waits_for_the_import(module_dir):
    name = module_dir("f2c_hook_a")
    seen = []
    hooks.when_imported(name, lambda m: seen.append(m.VALUE))
    assert seen == [] and name in hooks.waiting()
    importlib.import_module(name)
    assert seen == [1] and name not in hooks.waiting()


def test_hook_runs_at_once_for_a_module_already_imported(module_dir):
    name = module_dir("f2c_hook_b")
    importlib.import_module(name)
    seen = []
    hooks.when_imported(name, lambda m: seen.append(m.__name__))
    assert seen == [name]


def test_hook_sees_the_finished_module_never_a_half_initialised_one(module_dir):
    name = module_dir("f2c_hook_c", "FIRST = 1\nimport f2c_hook_c_probe\nLAST = 2\n")
    probe = module_dir("f2c_hook_c_probe", "")
    seen = []
    hooks.when_imported(name, lambda m: seen.append((hasattr(m, "FIRST"), hasattr(m, "LAST"))))
    importlib.import_module(name)
    assert seen == [(True, True)]
    assert probe in sys.modules


def test_a_hook_fires_once_even_on_reload(module_dir):
    name = module_dir("f2c_hook_d")
    seen = []
    hooks.when_imported(name, seen.append)
    module = importlib.import_module(name)
    importlib.reload(module)
    assert len(seen) == 1


def test_cancel_forgets_a_hook_that_has_not_fired(module_dir):
    name = module_dir("f2c_hook_e")
    seen = []
    callback = seen.append
    hooks.when_imported(name, callback)
    hooks.cancel(name, callback)
    hooks.cancel(name, callback)  # no error when already gone
    importlib.import_module(name)
    assert seen == [] and name not in hooks.waiting()


def test_an_unwatched_import_is_not_touched(module_dir):
    name = module_dir("f2c_hook_f")
    module = importlib.import_module(name)
    assert "exec_module" not in vars(module.__spec__.loader)
