"""``fsdp2_compat.core.guards``: versions, ranges and source fingerprints."""

import textwrap

import pytest

from fsdp2_compat.core import guards

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python",)

SOURCE = textwrap.dedent('''
    def f(x):
        """Doc."""
        # a comment
        return x + 1


    class Engine:
        def prepare(self, x):
            return x * 2

        def other(self):
            pass
''')


def test_fingerprint_ignores_docstrings_comments_and_layout():
    reformatted = "def f( x ):\n    return (x+1)\n"
    assert guards.fingerprint_source(SOURCE, "f") == guards.fingerprint_source(reformatted, "f")
    assert guards.fingerprint_source(SOURCE, "f") != guards.fingerprint_source("def f(x):\n    return x + 2\n", "f")


def test_a_method_is_fingerprinted_by_its_dotted_name():
    method = "def prepare(self, x):\n    return x * 2\n"
    assert guards.fingerprint_source(SOURCE, "Engine.prepare") == guards.fingerprint_source(method, "prepare")
    assert guards.fingerprint_source(SOURCE, "Engine.prepare") != guards.fingerprint_source(SOURCE, "Engine.other")


@pytest.mark.parametrize("name", ["g", "Engine.missing", "Missing.prepare", "f.inner"])
def test_a_missing_definition_is_a_lookup_error_naming_it(name):
    with pytest.raises(LookupError, match=repr(name.split(".")[-1]) if "." not in name else "no definition"):
        guards.fingerprint_source(SOURCE, name)


def test_live_objects_fingerprint_like_their_released_source(tmp_path, monkeypatch):
    (tmp_path / "f2c_guard_mod.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import f2c_guard_mod

    assert guards.fingerprint(f2c_guard_mod.f) == guards.fingerprint_source(SOURCE, "f")
    assert guards.fingerprint(f2c_guard_mod.Engine.prepare) == guards.fingerprint_source(SOURCE, "Engine.prepare")


def test_code_without_source_or_already_wrapped_cannot_be_verified():
    import wrapt

    with pytest.raises(LookupError, match="source is not available"):
        guards.fingerprint(len)

    def original():
        pass

    proxy = wrapt.FunctionWrapper(original, lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
    with pytest.raises(LookupError, match="wrapped by FunctionWrapper"):
        guards.fingerprint(proxy)


DECORATED = textwrap.dedent('''
    import functools


    def disable(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            return fn(*args, **kwargs)
        return inner


    class Group:
        @disable
        def post_backward(self, *unused):
            return 1
''')


def test_a_function_decorated_in_the_released_source_fingerprints_like_its_file(tmp_path, monkeypatch):
    """torch's ``@_dynamo_disable`` (functools.wraps) sits on methods we patch."""
    (tmp_path / "f2c_guard_decorated.py").write_text(DECORATED)
    monkeypatch.syspath_prepend(str(tmp_path))
    import f2c_guard_decorated

    method = f2c_guard_decorated.Group.__dict__["post_backward"]
    assert hasattr(method, "__wrapped__")
    assert guards.fingerprint(method) == guards.fingerprint_source(DECORATED, "Group.post_backward")


def test_source_that_no_longer_parses_is_unknown_code_not_a_crash(tmp_path, monkeypatch):
    path = tmp_path / "f2c_guard_broken.py"
    path.write_text("def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import f2c_guard_broken

    path.write_text("def f(:\n")  # edited on disk after the import
    import linecache

    linecache.checkcache(str(path))
    with pytest.raises(LookupError):
        guards.fingerprint(f2c_guard_broken.f)


def test_a_function_is_read_once_per_compiled_code_object(tmp_path, monkeypatch):
    """The fingerprint belongs to the code that runs: an edit on disk after the import changes nothing
    for the loaded function, and the same file compiled again is read again."""
    import importlib
    import linecache
    import sys

    path = tmp_path / "f2c_guard_memo.py"
    path.write_text("def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "f2c_guard_memo", raising=False)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # the reload below compiles the edited file
    import f2c_guard_memo

    first = guards.fingerprint(f2c_guard_memo.f)
    assert first == guards.fingerprint_source("def f():\n    return 1\n")
    path.write_text("def f():\n    return 2\n")  # same size and line count: the loaded code is unchanged
    linecache.checkcache(str(path))
    assert guards.fingerprint(f2c_guard_memo.f) == first
    reloaded = importlib.reload(f2c_guard_memo)
    assert guards.fingerprint(reloaded.f) == guards.fingerprint_source("def f():\n    return 2\n") != first


def test_an_unreadable_function_is_not_remembered_as_unreadable(tmp_path, monkeypatch):
    import linecache
    import sys

    path = tmp_path / "f2c_guard_retry.py"
    path.write_text("def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "f2c_guard_retry", raising=False)
    import f2c_guard_retry

    path.write_text("def f(:\n")
    linecache.checkcache(str(path))
    with pytest.raises(LookupError):
        guards.fingerprint(f2c_guard_retry.f)
    path.write_text("def f():\n    return 1\n")  # put back: the next call reads it
    linecache.checkcache(str(path))
    assert guards.fingerprint(f2c_guard_retry.f) == guards.fingerprint_source("def f():\n    return 1\n")


def test_a_found_release_is_read_once_per_process_until_forgotten(monkeypatch):
    from importlib import metadata

    calls = []
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda dist: calls.append(dist) or real(dist))
    guards.forget_versions()
    try:
        assert guards.installed_version("pytest") == guards.installed_version("pytest") == real("pytest")
        assert calls == ["pytest"]
        # An absent one is looked for again each time: it may be installed while the process runs.
        assert guards.installed_version("f2c-no-such-distribution") is None
        assert guards.installed_version("f2c-no-such-distribution") is None
        assert calls == ["pytest"] + ["f2c-no-such-distribution"] * 2
        guards.forget_versions()
        guards.installed_version("pytest")
        assert calls[-1] == "pytest" and len(calls) == 4
    finally:
        guards.forget_versions()


@pytest.mark.parametrize("version, spec, ok", [
    ("0.9.1", ">=0.7.1,<=0.9.1", True),
    ("0.9.2", ">=0.7.1,<=0.9.1", False),
    ("5.0.0rc3", ">=5.0.0rc0", True),  # pre-releases count
    ("5.0.0rc3", "<5.0.0", False),  # PEP 440: "<V" excludes V's own pre-releases
    ("2.13.0+cpu", ">=2.13,<=2.14.1", True),  # local versions too
])
def test_ranges(version, spec, ok):
    assert guards.in_range(version, spec) is ok


def test_an_absent_distribution_has_no_version():
    assert guards.installed_version("f2c-no-such-distribution") is None
    assert guards.installed_version("pytest") is not None
