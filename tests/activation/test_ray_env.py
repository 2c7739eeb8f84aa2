"""``fsdp2_compat.activation.ray_env`` in-process: how ``runtime_env`` merges into a user's
runtime_env, and what ``setup_worker`` runs (the real Ray cluster: ``test_processes.py``)."""

import json
import sys

import pytest

from fsdp2_compat.core import engine

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python",)


def test_runtime_env_fresh(monkeypatch):
    from fsdp2_compat.activation.ray_env import SETUP_HOOK, runtime_env

    monkeypatch.delenv("FSDP2_COMPAT_PATCHES", raising=False)
    assert runtime_env() == {"env_vars": {"FSDP2_COMPAT_PATCHES": "all"}, "worker_process_setup_hook": SETUP_HOOK}
    monkeypatch.setenv("FSDP2_COMPAT_PATCHES", "qwen3vl")
    assert runtime_env()["env_vars"]["FSDP2_COMPAT_PATCHES"] == "qwen3vl"
    assert runtime_env(["glm4v", "qwen2vl"])["env_vars"]["FSDP2_COMPAT_PATCHES"] == "glm4v,qwen2vl"


def test_runtime_env_merges_without_clobbering():
    from fsdp2_compat.activation.ray_env import CHAINED_HOOK_ENV, SETUP_HOOK, runtime_env

    base = {"env_vars": {"A": "1"}, "pip": ["x"], "worker_process_setup_hook": "my.mod.hook"}
    snapshot = json.loads(json.dumps(base))
    env = runtime_env("glm4v", base=base)
    assert base == snapshot, "base must not be modified"
    assert env["pip"] == ["x"] and env["worker_process_setup_hook"] == SETUP_HOOK
    assert env["env_vars"] == {"A": "1", "FSDP2_COMPAT_PATCHES": "glm4v", CHAINED_HOOK_ENV: "my.mod.hook"}
    assert runtime_env("glm4v", base=env) == env, "idempotent"
    # The user's own selection is kept, a different one is refused.
    kept = runtime_env(base={"env_vars": {"FSDP2_COMPAT_PATCHES": "qwen2vl"}})
    assert kept["env_vars"]["FSDP2_COMPAT_PATCHES"] == "qwen2vl"
    with pytest.raises(ValueError, match="already set FSDP2_COMPAT_PATCHES"):
        runtime_env("glm4v", base={"env_vars": {"FSDP2_COMPAT_PATCHES": "qwen2vl"}})
    with pytest.raises(ValueError, match="conflicts"):
        runtime_env("glm4v", base={"env_vars": {CHAINED_HOOK_ENV: "a.b"}, "worker_process_setup_hook": "c.d"})


def test_runtime_env_rejects_typos_in_the_driver():
    from fsdp2_compat import ConfigError
    from fsdp2_compat.activation.ray_env import runtime_env

    with pytest.raises(ConfigError, match="glm4x"):
        runtime_env("glm4x")


def test_setup_worker_requests_then_calls_chained_hooks(monkeypatch):
    from fsdp2_compat.activation import ray_env

    calls = []
    monkeypatch.setenv("FSDP2_COMPAT_PATCHES", "glm4v")
    monkeypatch.setenv(ray_env.CHAINED_HOOK_ENV, "fsdp2_compat_test_hook_target.hook")
    target = type(sys)("fsdp2_compat_test_hook_target")
    target.hook = lambda: calls.append(engine.requested())
    monkeypatch.setitem(sys.modules, "fsdp2_compat_test_hook_target", target)
    ray_env.setup_worker()
    assert calls == [("glm4v",)], "ours first, then the user's"
    engine.revert()

    composed = ray_env.runtime_env("qwen2vl", base={"worker_process_setup_hook": lambda: calls.append("callable")})
    hook = composed["worker_process_setup_hook"]
    assert callable(hook) and hook.__name__ == "fsdp2_compat_then_<lambda>"
    monkeypatch.setenv("FSDP2_COMPAT_PATCHES", "qwen2vl")
    monkeypatch.delenv(ray_env.CHAINED_HOOK_ENV)
    hook()
    assert calls[-1] == "callable" and engine.requested() == ("qwen2vl",)
    assert ray_env.runtime_env("qwen2vl", base=composed)["worker_process_setup_hook"] is hook
