"""Import each framework's FSDP2 module and shard a model through its own entry point.

``import_fsdp_utils(framework)`` imports ``Integration.wrap_module``.
``shard(framework, model, world, precision=None)`` runs, in a process whose
default gloo group spans ``world`` ranks:

- verl, skyrl, skyrl-train: ``fsdp_utils.apply_fsdp2(model, {"mesh": mesh}, {})``
  on a 1-D mesh named ``fsdp`` (as verl and SkyRL name it); with a
  ``precision``, the caller's ``mp_policy`` in those kwargs, as their engines
  pass it;
- areal: ``parallelize_model`` from ``areal.engine.fsdp_utils.parallel``, the
  function ``FSDPEngine`` calls, with AReaL's own ``ParallelHelper`` over
  ``FSDPParallelStrategy(data_parallel_size=world)`` (its world mesh, flattened
  to ``dp_sp``), ``TrainEngineConfig(dtype="float32")`` and the default
  ``FSDPWrapPolicy()``; it imported ``apply_fsdp2`` by name, so this runs
  through the alias the engine rebinds;
- llamafactory: ``FSDP2Engine({"name": "fsdp2"}, bf16=False).prepare_model(model)``,
  the engine built by its own ``__init__`` (``precision="bf16"``: ``bf16=True``,
  as its trainer passes its ``bf16`` argument; the engine then picks bf16
  params / fp32 reduce itself).  Its ``DistributedInterface``
  (a singleton) calls ``init_process_group`` itself from ``RANK`` /
  ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` and builds its own
  ``(mp_replicate, mp_shard)`` mesh, so the caller's group is handed over
  first: rank 0 picks a free local port and broadcasts it, the group is
  destroyed, and LLaMA-Factory initialises the replacement (gloo, env://).
  The caller's ``destroy_process_group()`` then destroys that one.
- lmms-engine: ``fsdp2_utils.apply_fsdp2(model, {"mesh": mesh}, layer_classes)``, as
  ``FSDP2SFTTrainer.prepare_model`` calls it, with the model's ``_no_split_modules``
  as the list its configs give in ``transformer_layer_cls_to_wrap`` (its default,
  the set itself, fails its own ``[0]`` on transformers 5.x).

``precision`` names one policy for all of them: ``"bf16"`` is bf16 params with
an fp32 reduce (each framework's own bf16 default), ``"fp32"`` fp32 both;
``None`` is each entry point's call above without one.

Nothing here is CUDA-bound: AReaL's ``current_platform`` is its CPU platform
and LLaMA-Factory's accelerator helper falls back to CPU on a CPU-only torch.
"""

import importlib
import importlib.machinery
import os
import sys

ENTRY = {"llamafactory": "prepare_model"}  # the name a wrap-time error is reported under; else apply_fsdp2


def entry_name(framework):
    return ENTRY.get(framework, "apply_fsdp2")


PRECISIONS = ("bf16", "fp32")


def shard(framework, model, world, precision=None):
    """Shard ``model`` in place through ``framework``'s own entry point; returns the model.

    ``precision``: None, or one of ``PRECISIONS`` (see the module docstring),
    given to each framework the way its own engine gives it.
    """
    if precision is not None and precision not in PRECISIONS:
        raise ValueError("precision %r: one of %s" % (precision, PRECISIONS))
    if framework == "areal":
        return _areal(model, world, precision)
    if framework == "llamafactory":
        return llamafactory_engine(world, bf16=precision == "bf16").prepare_model(model)
    from torch.distributed.device_mesh import init_device_mesh

    fsdp_utils = import_fsdp_utils(framework)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    kwargs = {"mesh": mesh}
    if precision is not None:
        kwargs["mp_policy"] = mp_policy(precision)
    if framework == "lmms-engine":
        fsdp_utils.apply_fsdp2(model, kwargs, sorted(getattr(model, "_no_split_modules", None) or ()))
        return model
    fsdp_utils.apply_fsdp2(model, kwargs, {})
    return model


def mp_policy(precision):
    """The ``MixedPrecisionPolicy`` a ``precision`` names: bf16 or fp32 params, always an fp32 reduce."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = torch.bfloat16 if precision == "bf16" else torch.float32
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)


def import_fsdp_utils(framework):
    """Import the framework's real ``fsdp_utils`` module.

    skyrl 0.2.0+ cannot ``import skyrl.backends`` on Python < 3.12 (its
    ``__init__`` pulls a pydantic model that needs 3.12's TypedDict), although
    ``fsdp_utils`` itself does not need that package ``__init__``.  There, and
    only there, the package is registered without running its ``__init__``;
    the module under test is still the released file, executed unchanged.
    """
    from fsdp2_compat import integrations

    name = integrations.get(framework).wrap_module
    if name is None:
        raise ValueError("%s wraps no model itself (no apply_fsdp2); see fsdp2_compat.integrations" % framework)
    if framework == "skyrl":
        ensure_skyrl_backends_package()
    if framework == "lmms-engine":
        ensure_lmms_engine_utils_package()
    return importlib.import_module(name)


# What lmms-engine 0.1.4's ``lmms_engine/utils/__init__.py`` imports and ``fsdp2_utils`` does not.
LMMS_ENGINE_UTILS_DEPS = ("deepspeed", "datasets", "librosa", "jsonlines", "pandas", "yaml", "loguru", "rich")


def ensure_lmms_engine_utils_package():
    """Make ``lmms_engine.utils.fsdp2_utils`` importable where the package ``__init__``'s deps are absent.

    lmms-engine's ``utils/__init__.py`` imports ``train_utils`` (deepspeed) and
    ``data_utils`` (datasets, librosa); ``fsdp2_utils.py`` imports only torch and
    ``lmms_engine.parallel.process_group_manager`` (torch).  ``package_without_init``.
    """
    package_without_init("lmms_engine.utils", LMMS_ENGINE_UTILS_DEPS)


def package_without_init(name, absent_deps):
    """Import package ``name``; where that fails only because one of ``absent_deps`` is missing (a pinned
    test set installs the framework ``--no-deps``), register it without running its ``__init__``: its
    modules are still the released files, executed unchanged when imported."""
    if name in sys.modules:
        return
    try:
        importlib.import_module(name)
        return
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in absent_deps:
            raise
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]
    _bare_package(name, "%s, __init__ skipped (its deps are not installed)" % name)


def _bare_package(name, doc):
    """Register package ``name`` (its parent imported) without running its ``__init__``."""
    import types

    parent_name, _, child = name.rpartition(".")
    parent = importlib.import_module(parent_name)
    path = os.path.join(os.path.dirname(parent.__file__), child)
    pkg = types.ModuleType(name, doc)
    pkg.__path__ = [path]
    pkg.__package__ = name
    pkg.__file__ = os.path.join(path, "__init__.py")
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [path]
    pkg.__spec__ = spec
    sys.modules[name] = pkg
    setattr(parent, child, pkg)


def ensure_skyrl_backends_package():
    """Make ``skyrl.backends`` importable on Python < 3.12 (see ``import_fsdp_utils``).

    On 3.12+ it is a plain import: the released ``__init__`` runs, and any error
    it raises is upstream's.  Below 3.12 only pydantic's ``typed-dict-version``
    error selects the workaround.
    """
    import os
    import types

    if "skyrl.backends" in sys.modules:
        return
    if sys.version_info >= (3, 12):
        importlib.import_module("skyrl.backends")
        return
    try:
        importlib.import_module("skyrl.backends")
        return
    except Exception as exc:  # pydantic.errors.PydanticUserError
        if getattr(exc, "code", None) != "typed-dict-version":
            raise
    # Drop what the failed import left half-initialised.
    for mod in [m for m in sys.modules if m == "skyrl.tinker.types" or m.startswith("skyrl.backends")]:
        del sys.modules[mod]
    import skyrl

    path = os.path.join(os.path.dirname(skyrl.__file__), "backends")
    pkg = types.ModuleType("skyrl.backends", "skyrl.backends, __init__ skipped (Python < 3.12)")
    pkg.__path__ = [path]
    pkg.__package__ = "skyrl.backends"
    pkg.__file__ = os.path.join(path, "__init__.py")
    spec = importlib.machinery.ModuleSpec("skyrl.backends", None, is_package=True)
    spec.submodule_search_locations = [path]
    pkg.__spec__ = spec
    sys.modules["skyrl.backends"] = pkg
    skyrl.backends = pkg


_areal_helpers = {}  # (id of the default group, world) -> ParallelHelper (its mesh is built once)


def _areal(model, world, precision=None):
    import torch.distributed as dist
    from areal.api import FSDPParallelStrategy
    from areal.api.cli_args import FSDPWrapPolicy, TrainEngineConfig
    from areal.engine.fsdp_utils.parallel import ParallelHelper, parallelize_model

    key = (id(dist.distributed_c10d._get_default_group()), world)
    helper = _areal_helpers.get(key)
    if helper is None:
        helper = ParallelHelper.from_parallel_strategy(FSDPParallelStrategy(data_parallel_size=world))
        _areal_helpers.clear()
        _areal_helpers[key] = helper
    config = TrainEngineConfig(dtype="bfloat16" if precision == "bf16" else "float32", grad_reduce_dtype="float32")
    parallelize_model(model, config, model.config, helper.world_mesh, helper, cpu_offload=None,
                      wrap_policy=FSDPWrapPolicy())
    return model


_lf_group = []  # the default group LLaMA-Factory's DistributedInterface created in this process


def llamafactory_engine(world, bf16=False):
    """``FSDP2Engine({"name": "fsdp2"}, bf16=bf16)`` on the process group LLaMA-Factory created itself."""
    import torch.distributed as dist
    from llamafactory.v1.accelerator.interface import DistributedInterface
    from llamafactory.v1.plugins.trainer_plugins.distributed import fsdp2

    current = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    interface = DistributedInterface._instance
    if not (interface is not None and interface._initialized and _lf_group and current is _lf_group[0]):
        _hand_over_group(DistributedInterface, world)
    return fsdp2.FSDP2Engine({"name": "fsdp2"}, bf16=bf16)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hand_over_group(interface, world):
    """Replace the caller's default group by the one LLaMA-Factory's ``DistributedInterface`` creates."""
    import torch.distributed as dist

    rank = 0
    port = [_free_port()]
    if dist.is_initialized():
        rank = dist.get_rank()
        dist.broadcast_object_list(port, src=0)
        dist.destroy_process_group()
    elif world != 1:
        raise RuntimeError("llamafactory: no process group to hand over for %d ranks" % world)
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port[0])}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        # A singleton: one left from an earlier (destroyed) group is rebuilt.
        interface._instance, interface._initialized = None, False
        interface({"timeout": 120})
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    _lf_group[:] = [dist.distributed_c10d._get_default_group()]
