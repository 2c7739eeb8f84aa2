"""Process-wide activation through the launchers users run, with the installed wheel (built and installed as
test_processes.py says: ``support/installed_wheel.py``, fixtures in ``conftest.py``):

- Ray: a real local cluster; plugin discovery in an actor, the runtime_env
  helper's setup hook for SkyRL (bootstrap off, user hook chained), and nothing
  patched when the variable is unset.
- torchrun with 2 ranks: every rank reports the patch applied (AReaL's and
  LLaMA-Factory's modules too).
- verl's training engine (GLM-4.1V, 2 ranks, against the DP-average reference):
  trained with only FSDP2_COMPAT_PATCHES set (bootstrap and plugin), and with
  ``import fsdp2_compat.auto`` in the ranks (bootstrap and plugins off).
- TRL: the .pth applies the TRL target at ``import trl.trainer.utils``; ``import
  fsdp2_compat.auto`` at the top of a script does it with the bootstrap off; under
  ``accelerate launch`` (2 CPU processes) every rank has it.

Slow tests carry ``pytest.mark.slow``.  Ray tests share one cluster per module (and carry ``xdist_group`` for
``--dist loadgroup``).
"""

import os
import shutil
import subprocess
import time

import pytest

from fsdp2_compat.core import engine, guards
from support.installed_wheel import (  # the shared pieces of both activation modules
    VERL, SKYRL, HAS_RAY, HAS_TORCH, slow, needs_verl, _verl_at_least, needs_verl_plugins, REPORT, _result,
    _clean_env, _applied, _assert_installed_copy,
)

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python", "torch")


# -- slow: a real local Ray cluster -------------------------------------------------------

RAY_HEAD = r"""
import os, sys, ray
ctx = ray.init(num_cpus=2, include_dashboard=False, object_store_memory=150 * 1024 * 1024,
               _temp_dir=sys.argv[1], configure_logging=False)
print("ADDRESS " + ctx.address_info["gcs_address"], flush=True)
sys.stdin.read()
ray.shutdown()
"""

USER_HOOK = """
import os
def mark():
    os.environ["F2C_USER_HOOK_RAN"] = "1"
"""

RAY_DRIVER = r"""
import os, sys, ray
address, mode = sys.argv[1], sys.argv[2]

def callable_hook():
    os.environ["F2C_CALLABLE_HOOK_RAN"] = "1"

opts, frameworks = {}, []
if mode == "plugin":
    ray.init(address=address)
    opts = {"runtime_env": {"env_vars": {"FSDP2_COMPAT_PATCHES": "glm4v", "FSDP2_COMPAT_DISABLE_BOOTSTRAP": "1"}}}
    frameworks = ["verl"]
elif mode == "external-modules":
    ray.init(address=address)
    opts = {"runtime_env": {"env_vars": {"FSDP2_COMPAT_PATCHES": "glm4v", "FSDP2_COMPAT_DISABLE_BOOTSTRAP": "1",
                                         "VERL_USE_EXTERNAL_MODULES": "fsdp2_compat.auto", "VERL_USE_EXTERNAL_PLUGINS": "none"}}}
    frameworks = ["verl"]
elif mode == "helper-skyrl":
    from fsdp2_compat.activation.ray_env import runtime_env
    ray.init(address=address, runtime_env=runtime_env("glm4v", base={
        "env_vars": {"FSDP2_COMPAT_DISABLE_BOOTSTRAP": "1", "F2C_USER_VAR": "kept"},
        "worker_process_setup_hook": "f2c_user_hook.mark"}))
    frameworks = ["skyrl"]
elif mode == "helper-callable":
    from fsdp2_compat.activation.ray_env import runtime_env
    ray.init(address=address, runtime_env=runtime_env("glm4v", base={
        "env_vars": {"FSDP2_COMPAT_DISABLE_BOOTSTRAP": "1"}, "worker_process_setup_hook": callable_hook}))
elif mode == "unset":
    ray.init(address=address)
    frameworks = [f for f in ("verl", "skyrl") if f in sys.argv[3:]]

@ray.remote(num_cpus=0)
class Probe:
    def run(self, frameworks):
        from fsdp2_compat_harness.scenarios import import_fsdp_utils
        before = report()
        errors = {}
        for fw in frameworks:
            try:
                import_fsdp_utils(fw)
            except ModuleNotFoundError as exc:  # a dependency this environment lacks
                errors[fw] = {"name": exc.name, "error": str(exc)}
        after = report()
        after["before"] = {"decisions": before["decisions"], "requested": before["requested"]}
        after["import_errors"] = errors
        return after

probe = Probe.options(**opts).remote()
emit(ray.get(probe.run.remote(frameworks), timeout=540))
ray.shutdown()
"""


@pytest.fixture(scope="module")
def ray_cluster(venv, tmp_path_factory):
    """One local Ray cluster per module, run by a holder process of the installed venv."""
    if not HAS_RAY or not HAS_TORCH:
        pytest.skip("ray and torch are needed for the Ray tests")
    hookdir = tmp_path_factory.mktemp("hooks")
    (hookdir / "f2c_user_hook.py").write_text(USER_HOOK)
    temp_dir = "/tmp/f2c-ray-%d" % os.getpid()  # short: Ray's socket paths must stay < 108 chars
    # A private, throw-away cluster: no usage stats, no token (drivers would need ~/.ray/auth_token).
    env = _clean_env(PYTHONPATH=str(hookdir), RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    holder = subprocess.Popen(
        [venv.python, "-c", RAY_HEAD, temp_dir],
        env=env,
        cwd=venv.cwd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    address = None
    deadline = time.time() + 180
    while time.time() < deadline:
        line = holder.stdout.readline()
        if not line:
            break
        if line.startswith("ADDRESS "):
            address = line.split()[1]
            break
    if address is None:
        holder.kill()
        raise AssertionError("Ray head did not start: %s" % holder.stderr.read()[-4000:])
    yield {"address": address, "env": env}
    holder.stdin.close()
    try:
        holder.wait(timeout=60)
    except subprocess.TimeoutExpired:
        holder.kill()
        holder.wait()
    shutil.rmtree(temp_dir, ignore_errors=True)


def _ray_driver(venv, cluster, mode, *args):
    proc = subprocess.run(
        [venv.python, "-c", REPORT + RAY_DRIVER, cluster["address"], mode, *args],
        env=cluster["env"],
        cwd=venv.cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return _result(proc)


def _skip_missing_dependency(result, framework):
    error = result["import_errors"].get(framework)
    if error is not None:
        assert not (error["name"] or "").startswith("fsdp2_compat"), error
        pytest.skip("%s's fsdp_utils cannot be imported here: %s" % (framework, error["error"]))


@pytest.mark.depends_on("python", "torch", "verl", "ray")
@slow
@pytest.mark.xdist_group("fsdp2_compat_ray")
@needs_verl_plugins
def test_ray_actor_gets_patch_through_verl_plugin(venv, ray_cluster):
    r = _ray_driver(venv, ray_cluster, "plugin")
    _skip_missing_dependency(r, "verl")
    _assert_installed_copy(venv, r)
    assert r["pid"] != os.getpid()
    assert r["before"]["requested"] == [], "nothing may be requested before verl is imported"
    assert r["decisions"]["bootstrap"]["active"] is False  # disabled: the plugin did it
    assert r["plugin"]["active"] is True and r["requested"] == ["glm4v"]
    assert _applied(r, "verl.utils.fsdp_utils"), r["rows"]


@pytest.mark.depends_on("python", "torch", "verl", "ray")
@slow
@pytest.mark.xdist_group("fsdp2_compat_ray")
@pytest.mark.skipif(not _verl_at_least("0.6.0"), reason="VERL_USE_EXTERNAL_MODULES needs verl 0.6.0+ (found %s)" % VERL)
def test_ray_actor_gets_patch_through_verl_external_modules(venv, ray_cluster):
    """The verl 0.6-0.8 recipe: VERL_USE_EXTERNAL_MODULES in the actor's env_vars (plugins and bootstrap off)."""
    r = _ray_driver(venv, ray_cluster, "external-modules")
    _skip_missing_dependency(r, "verl")
    assert r["before"]["requested"] == []
    assert r["plugin_loaded"] is False and r["decisions"]["bootstrap"]["active"] is False
    assert r["requested"] == ["glm4v"] and _applied(r, "verl.utils.fsdp_utils"), r["rows"]


@pytest.mark.depends_on("python", "torch", "skyrl", "ray")
@slow
@pytest.mark.xdist_group("fsdp2_compat_ray")
@pytest.mark.skipif(SKYRL is None, reason="skyrl is not installed in this environment")
def test_ray_runtime_env_helper_patches_skyrl(venv, ray_cluster):
    r = _ray_driver(venv, ray_cluster, "helper-skyrl")
    _skip_missing_dependency(r, "skyrl")
    assert r["before"]["decisions"]["ray"]["active"] is True, "the setup hook runs before the actor"
    assert r["before"]["requested"] == ["glm4v"]
    assert r["decisions"]["bootstrap"]["active"] is False and r["plugin_loaded"] is False
    assert _applied(r, "skyrl.backends.skyrl_train.distributed.fsdp_utils"), r["rows"]
    assert r["env"]["F2C_USER_VAR"] == "kept" and r["env"]["F2C_USER_HOOK_RAN"] == "1"


@pytest.mark.depends_on("python", "ray")
@slow
@pytest.mark.xdist_group("fsdp2_compat_ray")
def test_ray_runtime_env_helper_chains_a_callable_hook(venv, ray_cluster):
    r = _ray_driver(venv, ray_cluster, "helper-callable")
    assert r["decisions"]["ray"]["active"] is True and r["requested"] == ["glm4v"]
    assert r["env"]["F2C_CALLABLE_HOOK_RAN"] == "1"


@pytest.mark.depends_on("python", "ray")
@slow
@pytest.mark.xdist_group("fsdp2_compat_ray")
def test_ray_nothing_patched_when_unset(venv, ray_cluster):
    frameworks = [f for f, v in (("verl", VERL), ("skyrl", SKYRL)) if v is not None]
    if not frameworks:
        pytest.skip("neither verl nor skyrl is installed")
    r = _ray_driver(venv, ray_cluster, "unset", *frameworks)
    if len(r["import_errors"]) == len(frameworks):
        pytest.skip("no framework's fsdp_utils can be imported here: %s" % r["import_errors"])
    assert r["requested"] == [] and r["swapped"] and not any(r["swapped"].values()), r["swapped"]
    assert "ray" not in r["decisions"] and "bootstrap" not in r["decisions"]
    if _verl_at_least("0.9.0"):
        assert r["plugin"]["active"] is False and r["plugin"]["reason"] == "FSDP2_COMPAT_PATCHES unset"


# -- slow: torchrun -----------------------------------------------------------------------

# A torchrun rank: joins the gloo group, imports the modules named on its command line, and
# rank 0 emits every rank's report.
RANK = r"""
import datetime, importlib, sys, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
for name in sys.argv[1:]:
    importlib.import_module(name)
r = report()
r["rank"], r["world"] = dist.get_rank(), dist.get_world_size()
gathered = [None] * r["world"]
dist.all_gather_object(gathered, r)
if r["rank"] == 0:
    emit(gathered)
dist.destroy_process_group()
# Every report is out; skip interpreter teardown, where a framework's C++ thread still joinable (LLaMA-Factory's
# imports on tf4, seen once under load) aborts the process ("terminate called without an active exception").
sys.stdout.flush(); sys.stderr.flush()
import os; os._exit(0)
"""


def _torchrun(venv, tmp_path, modules, patches):
    """Two torchrun ranks of ``RANK`` importing ``modules``, with only ``FSDP2_COMPAT_PATCHES=patches`` set;
    every rank's report (the command must succeed)."""
    script = tmp_path / "rank.py"
    script.write_text(REPORT + RANK)
    proc = subprocess.run(
        [venv.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)] + modules,
        env=_clean_env(FSDP2_COMPAT_PATCHES=patches, OMP_NUM_THREADS="1"),
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    ranks = _result(proc)
    assert sorted(r["rank"] for r in ranks) == [0, 1] and len({r["pid"] for r in ranks}) == 2
    return ranks


@slow
@needs_verl
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_torchrun_every_rank_applies(venv, tmp_path):
    for r in _torchrun(venv, tmp_path, ["verl.utils.fsdp_utils"], "glm4v"):
        _assert_installed_copy(venv, r)
        assert r["decisions"]["bootstrap"]["active"] is True, r["decisions"]
        assert _applied(r, "verl.utils.fsdp_utils"), (r["rank"], r["rows"])


# -- slow: verl's training engine, turned on the way users turn it on ---------------------

ENGINE_CHILD = r"""
import sys
from fsdp2_compat_harness.engines import common, verl_engine
from fsdp2_compat_harness.ranks import run_ranks
path = common.model_dir("glm4v", sys.argv[1])
results = run_ranks(verl_engine.train_verl_engine, 2, "glm4v", path, sys.argv[2], timeout=540)
emit({"results": results, "driver": report()})
"""
GLM4V_FORWARD = "verl:verl.models.transformers.glm4v."


def _engine_run(venv, tmp_path, mode, env):
    from fsdp2_compat.fixes import glm4v_forward
    from fsdp2_compat_harness.engines import common, verl_engine

    unrunnable = verl_engine.unrunnable()
    if unrunnable is not None:
        pytest.skip(unrunnable)
    needed = glm4v_forward.adapted_for(guards.installed_version("transformers"))
    # The wrap-selection target of this release: its own function from 0.7.1, inline in apply_fsdp2 before.
    from fsdp2_compat.integrations import verl as verl_targets

    selection = (verl_targets.WRAP_SELECTION if _verl_at_least("0.7.1") else verl_targets.WRAP_SELECTION_INLINE).key
    proc = venv.run(ENGINE_CHILD, env=dict(env, OMP_NUM_THREADS="1"), args=(str(tmp_path), mode), timeout=600)
    result = _result(proc)
    for rank, r in enumerate(result["results"]):
        where = "rank %d" % rank
        assert r["error"] is None, "%s: %s\n%s" % (where, r["error"], proc.stderr[-3000:])
        assert r["activation"]["file"].startswith(venv.site), r["activation"]["file"]
        assert r["activation"]["requested"] == ["glm4v"], r["activation"]
        assert r["activation"]["outcomes"][selection] == engine.APPLIED, r["activation"]["outcomes"]
        # verl's GLM4V forward ran with the forward targets this transformers needs (none on 5.0.0rc0-rc3).
        for attr in ("_get_input_embeds", "process_position_ids"):
            kind = r["activation"]["outcomes"][GLM4V_FORWARD + attr]
            assert kind == (engine.APPLIED if attr in needed else engine.NOT_NEEDED), (attr, kind)
        assert "model.visual.embeddings.position_embedding" not in r["units"]
        tol = common.tolerance(r)  # 1e-5; bf16's bound where verl's engine autocasts to bf16 regardless (0.7.0)
        for key in ("loss_err", "step0_grad_err", "step1_grad_err", "param_err_after_step1", "grad_norm_err"):
            assert r[key] < tol, (where, key, r[key], tol)
    assert result["results"][0]["reference_losses"] != result["results"][1]["reference_losses"]
    return result


# Where they run: the way the patch reaches each rank (the bootstrap, verl's plugin, ``import
# fsdp2_compat.auto``) depends on the interpreter and the verl release, not on transformers: the
# engine's training on each transformers is tests/integrations/test_verl_engine.py's.
@pytest.mark.depends_on("python", "torch", "verl")
@slow
@needs_verl
def test_verl_engine_trains_glm4v_with_only_the_variable_set(venv, tmp_path):
    """FSDP2_COMPAT_PATCHES=glm4v and nothing else: every rank gets the patch from the installed wheel
    (the .pth bootstrap at start-up; on verl >= 0.9 also verl's plugin entry point when verl is imported)."""
    result = _engine_run(venv, tmp_path, "env", {"FSDP2_COMPAT_PATCHES": "glm4v"})
    for r in result["results"]:
        assert r["activation"]["decisions"]["bootstrap"]["active"] is True, r["activation"]
        if _verl_at_least("0.9.0"):
            assert r["activation"]["decisions"]["plugin"]["active"] is True, r["activation"]


@pytest.mark.depends_on("python", "torch", "verl")
@slow
@needs_verl
def test_verl_engine_trains_glm4v_with_fsdp2_compat_auto(venv, tmp_path):
    """``import fsdp2_compat.auto`` in the rank, the bootstrap and verl's plugins off: the explicit way in."""
    env = {"FSDP2_COMPAT_PATCHES": "glm4v", "FSDP2_COMPAT_DISABLE_BOOTSTRAP": "1", "VERL_USE_EXTERNAL_PLUGINS": "none"}
    result = _engine_run(venv, tmp_path, "auto", env)
    assert result["driver"]["requested"] == [], "only the ranks' import of fsdp2_compat.auto may request"
    for r in result["results"]:
        assert r["activation"]["decisions"]["bootstrap"]["active"] is False
        assert "plugin" not in r["activation"]["decisions"], r["activation"]


# -- slow: TRL (accelerate launch starts one process per rank) ----------------------------

TRL = guards.installed_version("trl")
needs_trl = pytest.mark.skipif(TRL is None or not guards.in_range(TRL, ">=1.15.0"),
                               reason="needs trl >= 1.15.0 (add_fused_lm_head); found %s" % TRL)
TRL_UTILS = "trl.trainer.utils"


def _trl_patched(r, module=TRL_UTILS):
    rows = [row for row in r["rows"] if row["module"] == module and row["patch"] == "qwen3vl"]
    return bool(rows) and all(row["outcome"] == engine.APPLIED for row in rows)


@pytest.mark.depends_on("python", "torch", "trl")
@slow
@needs_trl
def test_pth_applies_the_trl_target_when_trl_utils_is_imported(venv):
    """Only FSDP2_COMPAT_PATCHES set: the installed .pth requests it, the import of trl.trainer.utils applies it."""
    proc = venv.run(
        """
        import trl.trainer.utils
        import trl.trainer.sft_trainer as sft
        from fsdp2_compat.core import engine
        r = report(); r["alias_is_ours"] = engine.is_ours(sft.add_fused_lm_head)
        emit(r)
        """,
        env={"FSDP2_COMPAT_PATCHES": "qwen3vl"},
    )
    r = _result(proc)
    _assert_installed_copy(venv, r)
    assert r["decisions"]["bootstrap"]["active"] is True and r["requested"] == ["qwen3vl"]
    assert _trl_patched(r) and r["alias_is_ours"], r["rows"]


TRL_SCRIPT = r"""
import fsdp2_compat.auto  # first line of the training script
from trl import SFTTrainer  # noqa: F401  (imports trl.trainer.sft_trainer -> trl.trainer.utils)
import trl.trainer.sft_trainer as sft
from fsdp2_compat.core import engine
r = report(); r["alias_is_ours"] = engine.is_ours(sft.add_fused_lm_head)
emit(r)
"""


@pytest.mark.depends_on("python", "torch", "trl")
@slow
@needs_trl
def test_import_auto_at_the_top_of_a_trl_script_applies_the_trl_target(venv, tmp_path):
    """The bootstrap is off: only the script's own ``import fsdp2_compat.auto`` can request the patch."""
    script = tmp_path / "train.py"
    script.write_text(REPORT + TRL_SCRIPT)
    proc = subprocess.run([venv.python, str(script)], env=_clean_env(FSDP2_COMPAT_PATCHES="qwen3vl",
                          FSDP2_COMPAT_DISABLE_BOOTSTRAP="1"), cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=600)
    r = _result(proc)
    _assert_installed_copy(venv, r)
    assert r["decisions"]["bootstrap"]["active"] is False and r["requested"] == ["qwen3vl"]
    assert _trl_patched(r) and r["alias_is_ours"], r["rows"]


# qwen3vl carries accelerate's VLM tail-unit target, applied where accelerate's code is the fingerprinted 1.14.0-1.15.0.
ACC_NORM_PATCHED = guards.in_range(guards.installed_version("accelerate") or "0", ">=1.14.0,<=1.15.0")

ACCELERATE_RANK = r"""
import torch.distributed as dist
from accelerate import PartialState
state = PartialState(cpu=True)  # the gloo group accelerate launch set up the environment for
import trl.trainer.sft_trainer as sft
from fsdp2_compat.core import engine
r = report(); r["alias_is_ours"] = engine.is_ours(sft.add_fused_lm_head)
r["rank"], r["world"] = state.process_index, state.num_processes
gathered = [None] * r["world"]
dist.all_gather_object(gathered, r)
if r["rank"] == 0:
    emit(gathered)
# Leave the group before the interpreter exits: a gloo group torn down at exit can abort a rank
# ("terminate called without an active exception", SIGABRT), at random.
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.depends_on("python", "torch", "trl", "accelerate")
@slow
@needs_trl
def test_accelerate_launch_every_rank_applies_the_trl_target(venv, tmp_path):
    """``accelerate launch`` (its torchrun launcher, 2 CPU processes) with only FSDP2_COMPAT_PATCHES set."""
    script = tmp_path / "rank.py"
    script.write_text(REPORT + ACCELERATE_RANK)
    cmd = [venv.python, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
           "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0", str(script)]
    proc = subprocess.run(cmd, env=_clean_env(FSDP2_COMPAT_PATCHES="qwen3vl", OMP_NUM_THREADS="1"),
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    ranks = _result(proc)
    assert sorted(r["rank"] for r in ranks) == [0, 1] and len({r["pid"] for r in ranks}) == 2
    for r in ranks:
        _assert_installed_copy(venv, r)
        assert r["decisions"]["bootstrap"]["active"] is True, r["decisions"]
        assert _trl_patched(r) and r["alias_is_ours"], (r["rank"], r["rows"])
        # accelerate's own FSDP2 preparation is patched in every rank too (its tail unit: the VLM's final norm)
        assert r["swapped"].get("accelerate:accelerate.utils.fsdp_utils._find_final_norm") is ACC_NORM_PATCHED, (
            r["rank"], r["swapped"])


NEW_FRAMEWORKS = [d for d in ("areal", "llamafactory") if guards.installed_version(d)]

@pytest.mark.depends_on("python", "torch", "areal", "llamafactory")
@slow
@pytest.mark.skipif(not HAS_TORCH or not NEW_FRAMEWORKS, reason="neither areal nor llamafactory is installed")
def test_torchrun_every_rank_applies_to_areal_and_llamafactory(venv, tmp_path):
    """AReaL's local launcher and LLaMA-Factory's v1 launcher start the trainer ranks with torchrun and
    the launcher's own environment: the variable alone reaches each rank, the bootstrap applies there."""
    from fsdp2_compat import integrations

    modules = [integrations.get(d).wrap_module for d in NEW_FRAMEWORKS]
    for r in _torchrun(venv, tmp_path, modules, "glm4v"):
        _assert_installed_copy(venv, r)
        assert r["decisions"]["bootstrap"]["active"] is True, r["decisions"]
        for module in modules:
            expected = 2 if module.startswith("llamafactory") else 1  # selection and layer-class lookup
            assert len(_applied(r, module)) == expected, (r["rank"], module, r["rows"])
