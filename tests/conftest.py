import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A developer's exported selection must not leak into the tests (the verl
# plugin and the start-up bootstrap read it in this process and its children).
for _name in [n for n in os.environ if n.startswith("FSDP2_COMPAT_")]:
    del os.environ[_name]


def _child_env(env):
    full_env = dict(os.environ)
    full_env.pop("FSDP2_COMPAT_PATCHES", None)
    full_env.pop("FSDP2_COMPAT_STRICT", None)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, full_env.get("PYTHONPATH")) if p)
    full_env.update(env or {})
    return full_env


def _checked(proc, check):
    if check and proc.returncode != 0:
        raise AssertionError("subprocess failed (%d):\n%s\n%s" % (proc.returncode, proc.stdout, proc.stderr))
    return proc


def run_python(code, env=None, check=True, timeout=300):
    """Run ``code`` in a fresh interpreter (clean import state); return CompletedProcess."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=_child_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return _checked(proc, check)


@pytest.fixture(scope="session")
def python():
    return run_python


@pytest.fixture(scope="session")
def warm_python():
    """``run_python`` in a child forked from a server that has imported torch and transformers.

    For tests about what happens when fsdp2-compat and a framework are imported (each child still
    imports them itself); never for tests about start-up, about what gets imported, or about an
    environment variable torch or transformers read at import (``support/warm.py``).
    """
    from support.warm import WarmPython

    server = WarmPython(_child_env(None))

    def run(code, env=None, check=True, timeout=300):
        return _checked(server.run(code, _child_env(env), timeout=timeout), check)

    yield run
    server.close()


@pytest.fixture(autouse=True)
def _no_leftover_patches():
    """Every test starts and ends with nothing requested in this process."""
    import fsdp2_compat

    fsdp2_compat.revert()
    yield
    fsdp2_compat.revert()


# -- the CI test matrix (.ci/matrix.py) ----------------------------------------
# ``.ci/test`` names the pinned set it runs in FSDP2_CI_SET; a test then runs
# only where no earlier set pins the same releases of what it depends on (its
# module's DEPENDS_ON, or a ``depends_on`` marker).  Without FSDP2_CI_SET
# (a developer's plain ``pytest``) everything runs.  FSDP2_CI_ORDER=reverse
# runs the collected tests in reversed order (.ci/test uses it for every other
# set, so no test can rely on what an earlier test imported or left), and
# FSDP2_CI_ORDER=random:SEED in a seeded random order.


def pytest_configure(config):
    config.addinivalue_line("markers", "depends_on(*dists): this test's DEPENDS_ON, overriding its module's")
    config.addinivalue_line("markers", "wrappable(family): skip unless tiny.unwrappable(family) is None (decided at setup)")
    _share_rank_server(config)


def _share_rank_server(config):
    """Under xdist, pytest's controller starts the rank server every worker (and every child they start for
    ``fsdp2-compat check``) forks its ranks from: one preload per run instead of one per process
    (``fsdp2_compat_harness.rank_server``).  It is started here, before the workers exist, so that they inherit
    its address; it preloads in the background while they collect."""
    import importlib.util

    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("fsdp2_compat_harness") is None:
        return  # no rank runs here (the bare set: no torch, no harness)
    from fsdp2_compat_harness import rank_server

    rank_server.share()


def _matrix():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fsdp2_ci_matrix", os.path.join(REPO, ".ci", "matrix.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _item_depends(item, matrix):
    marker = item.get_closest_marker("depends_on")
    depends = tuple(marker.args) if marker is not None else getattr(getattr(item, "module", None), "DEPENDS_ON", None)
    if depends is None:
        return None
    framework = getattr(item, "callspec", None) and item.callspec.params.get("framework")
    return matrix.expand(depends, framework if isinstance(framework, str) else None)


def pytest_collection_modifyitems(config, items):
    set_name = os.environ.get("FSDP2_CI_SET")
    if set_name:
        matrix = _matrix()
        sets = matrix.order()
        if set_name not in sets:
            raise pytest.UsageError("FSDP2_CI_SET=%s is not a pinned set (%s)" % (set_name, ", ".join(sets)))
        pinned = matrix.all_pins(sets, os.environ.get("FSDP2_CI_DEFAULT_PYTHON"))
        keep, proven, proven_by = [], [], {}
        for item in items:
            dists = _item_depends(item, matrix)
            by = None if dists is None else matrix.first_set(dists, pinned, sets)[matrix.key(pinned[set_name], dists)]
            if by is None or by == set_name:
                keep.append(item)
            else:
                proven.append(item)
                proven_by[item.nodeid] = by
        report = os.environ.get("FSDP2_CI_COLLECT_REPORT")  # .ci/matrix.py verify: who proves what
        if report:
            import json

            with open(report, "w") as f:
                json.dump({"set": set_name, "selected": [i.nodeid for i in keep], "proven_by": proven_by}, f)
        if proven:
            config.hook.pytest_deselected(items=proven)
            items[:] = keep
    order = os.environ.get("FSDP2_CI_ORDER", "forward")
    if order == "reverse":
        items.reverse()
    elif order.startswith("random:"):  # random:SEED, for a one-off check of order independence
        import random

        random.Random(order.partition(":")[2]).shuffle(items)
    elif order != "forward":
        raise pytest.UsageError("FSDP2_CI_ORDER=%s: use forward, reverse or random:SEED" % order)


def pytest_runtest_setup(item):
    """Skip a ``wrappable(family)`` test whose tiny family the stack cannot wrap, and fail a test whose
    ``xdist_group`` mark does not reach ``--dist loadgroup``'s scheduler.

    The tests batch expensive rank runs per group (a module cache filled once,
    read by every test of the group): a silently ignored group runs each batch
    once per worker.  pytest 9.2.0 with pytest-xdist 3.8.0 does exactly that
    (the group suffix xdist adds to a node id is not kept), hence the pins in
    ``.ci/install-set``.
    """
    wrappable = item.get_closest_marker("wrappable")
    if wrappable is not None:
        # At setup, not at collection: building every family to decide costs seconds in each worker of each set,
        # and most sets deselect the test anyway (the matrix).
        from fsdp2_compat_harness import tiny

        reason = tiny.unwrappable(wrappable.args[0])
        if reason is not None:
            pytest.skip(str(reason))
    if (getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group")
            and "@" not in item.nodeid):
        import xdist

        pytest.fail("pytest %s with pytest-xdist %s ignores xdist_group: every group runs its batch once per "
                    "worker; install the versions .ci/install-set pins" % (pytest.__version__, xdist.__version__),
                    pytrace=False)
