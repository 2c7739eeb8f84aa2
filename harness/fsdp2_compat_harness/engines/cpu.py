"""The CPU stand-ins the engine harnesses need, each named and narrow.

Neither replaces code fsdp2-compat patches, nor wraps the model.

verl >= 0.9: ``use_verl_cpu_platform()`` registers a ``cpu`` platform through
verl's own ``PlatformRegistry`` (``verl.plugin.platform``, the documented
extension point; verl ships nvidia / huawei / amd only) and selects it with
``VERL_PLATFORM=cpu``: device ``cpu``, gloo.  verl's training engine classes
are registered for ``device=["cuda", "npu"]``, so ``VERL_ENGINE_DEVICE=cuda``
(read by ``EngineRegistry.get_engine_cls``) picks ``FSDPEngineWithLMHead``.  It
must run before ``verl.workers.engine`` is imported: ``transformer_impl``
reads the device name at import.  verl 0.7 / 0.8 have neither: they name the
device ``cpu`` themselves on a host without CUDA, and ``register_verl_engine_for_cpu``
registers their FSDP engine class for that device through verl's public
``EngineRegistry.register`` (the class verl registers for cuda).

SkyRL: three helpers hard-code CUDA (``init_device_mesh("cuda", ...)``,
``buf.cuda()`` / ``device="cuda"``, ``total_norm.to(torch.cuda.current_device())``).
``use_skyrl_cpu_helpers`` binds CPU copies (same logic, host device) where
SkyRL looks them up: ``fsdp_strategy.create_device_mesh`` and
``fsdp_strategy.fsdp2_clip_grad_norm_`` (imported by name there) and
``fsdp_utils._sync_non_persistent_buffers`` (a global of
``fsdp2_load_full_state_dict``), and only where the installed helpers, and
``fsdp2_load_full_state_dict`` that calls one of them, are the code the copies
were written from (``SKYRL_HELPERS``: skyrl 0.3.0-0.4.0).  skyrl 0.2.0 loads
its state dict with other code, and 0.1.0 moves it to CUDA inline: not run here.
``bert_padding_during_import`` makes a pure-torch ``flash_attn.bert_padding``
visible while SkyRL's ``model_wrapper`` imports it at module top (flash-attn
has no CPU build; the padding-free path that would call it stays off).
"""

import contextlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types

VERL_PLATFORM = "cpu"

# skyrl fsdp_utils function -> fingerprint of the code the CPU copies below stand in for.
SKYRL_HELPERS = {
    "create_device_mesh": "0fc7079212dabb08",
    "fsdp2_clip_grad_norm_": "ccd7fb52a9b4f19c",
    "_sync_non_persistent_buffers": "e8e9bbd884f003a3",
    "fsdp2_load_full_state_dict": "d2a6805b1cb31356",  # calls _sync_non_persistent_buffers; nothing else on CUDA
}


# ---------------------------------------------------------------------------
# verl


def _register_verl_cpu_platform():
    import torch

    from verl.plugin.platform import PlatformBase, PlatformRegistry

    existing = PlatformRegistry.get(VERL_PLATFORM)
    if existing is not None:
        return existing

    @PlatformRegistry.register(platform=VERL_PLATFORM)
    class CpuPlatform(PlatformBase):
        """Host memory and gloo; every accelerator-only hook does nothing (fsdp2-compat test harness)."""

        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: torch.cpu)

        def is_available(self):
            return True

        def is_platform_available(self, use_smi_check=False):
            return True

        def current_device(self):
            return "cpu"  # verl does ``tensor.to(get_device_id())``

        def device_count(self):
            return 1

        def set_device(self, device_index):
            return None

        def synchronize(self, device_index=None):
            return None

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        manual_seed_all = manual_seed

        def set_allocator_settings(self, settings):
            return None

        def empty_cache(self):
            return None

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            return None

        def profiler_stop(self):
            return None

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    return CpuPlatform


def has_platform_registry():
    """True for verl >= 0.9 (``verl.plugin.platform``); read from the installed files, nothing imported."""
    import importlib.util

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return False
    root = list(spec.submodule_search_locations)[0]
    return os.path.isfile(os.path.join(root, "plugin", "platform", "__init__.py"))


def use_verl_cpu_platform():
    """Make verl run on the host for this process; returns verl's device name (``"cpu"``).

    verl >= 0.9: the CPU platform (and the cuda-registered engine classes).
    Raises ``RuntimeError`` when verl resolved its platform before (the engine
    module must not have been imported yet in this process).  verl 0.7 / 0.8 name
    the device itself (``cpu`` without CUDA); then ``register_verl_engine_for_cpu``
    is needed once the engine is imported.
    """
    if has_platform_registry():
        os.environ["VERL_PLATFORM"] = VERL_PLATFORM
        os.environ["VERL_ENGINE_DEVICE"] = "cuda"
        _register_verl_cpu_platform()
    from verl.utils.device import get_device_name

    name = get_device_name()
    if name != "cpu":
        raise RuntimeError("verl's device is %s, not cpu (platform resolved too early, or a GPU host)" % name)
    return name


def register_verl_engine_for_cpu():
    """verl < 0.9 has no ``VERL_ENGINE_DEVICE``: register verl's own FSDP engine classes for device ``cpu`` too.

    Through verl's public ``EngineRegistry.register`` (it leaves existing entries alone).
    """
    if has_platform_registry():
        return
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl

    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(
        transformer_impl.FSDPEngineWithLMHead)


# ---------------------------------------------------------------------------
# SkyRL


def skyrl_helpers_unknown(utils_module):
    """None when the installed SkyRL helpers are the code the CPU copies stand in for, else why not."""
    from fsdp2_compat.core import guards

    for name, known in SKYRL_HELPERS.items():
        obj = utils_module.__dict__.get(name)
        try:
            found = guards.fingerprint(obj) if obj is not None else "absent"
        except LookupError as exc:
            found = str(exc)
        if found != known:
            return "%s.%s is not the code the CPU stand-ins were written from (%s, expected %s)" % (
                utils_module.__name__, name, found, known)
    return None


def cpu_create_device_mesh(world_size, fsdp_size):
    """SkyRL's ``create_device_mesh`` on the host device."""
    from torch.distributed.device_mesh import init_device_mesh

    if fsdp_size < 0 or fsdp_size >= world_size:
        return init_device_mesh("cpu", mesh_shape=(world_size,), mesh_dim_names=["fsdp"])
    return init_device_mesh("cpu", mesh_shape=(world_size // fsdp_size, fsdp_size), mesh_dim_names=["ddp", "fsdp"])


def cpu_sync_non_persistent_buffers(model, loaded_sd):
    """SkyRL's ``_sync_non_persistent_buffers``: rank 0's non-persistent buffers broadcast, on the host."""
    import torch
    import torch.distributed as dist

    for module in model.modules():
        for key in sorted(getattr(module, "_non_persistent_buffers_set", set())):
            buf = module._buffers.get(key)
            if buf is None:
                continue
            src = buf.detach().clone() if dist.get_rank() == 0 else torch.empty(buf.shape, dtype=buf.dtype)
            dist.broadcast(src, src=0)
            module._buffers[key] = src


def cpu_fsdp2_clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """SkyRL's ``fsdp2_clip_grad_norm_`` with the total norm left on the host."""
    import torch
    from torch.nn.utils.clip_grad import _clip_grads_with_norm_, _get_total_norm

    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = _get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    _clip_grads_with_norm_(parameters, max_norm, total_norm, foreach)
    return total_norm


@contextlib.contextmanager
def skyrl_cpu_helpers(strategy_module, utils_module):
    """Bind the CPU copies where SkyRL looks its helpers up, for the duration; ``RuntimeError`` on unknown code."""
    unknown = skyrl_helpers_unknown(utils_module)
    if unknown is not None:
        raise RuntimeError(unknown)
    swaps = [
        (strategy_module, "create_device_mesh", cpu_create_device_mesh),
        (strategy_module, "fsdp2_clip_grad_norm_", cpu_fsdp2_clip_grad_norm_),
        (utils_module, "_sync_non_persistent_buffers", cpu_sync_non_persistent_buffers),
    ]
    saved = [(m, n, m.__dict__[n]) for m, n, _ in swaps]
    for m, n, f in swaps:
        setattr(m, n, f)
    try:
        yield
    finally:
        for m, n, f in saved:
            setattr(m, n, f)


@contextlib.contextmanager
def bert_padding_during_import():
    """A pure-torch ``flash_attn.bert_padding`` in ``sys.modules`` for the duration (import time only).

    A working flash-attn is used as is.  One installed without a loadable CUDA
    extension is hidden meanwhile.  transformers 5.x caches its flash-attn
    probes, so they run first, while no stand-in is visible (a module without
    an installed distribution makes them raise).
    """
    if importlib.util.find_spec("flash_attn") is not None:
        try:
            importlib.import_module("flash_attn.bert_padding")
            yield
            return
        except (ImportError, OSError):  # installed, but its CUDA extension cannot load here
            for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
                del sys.modules[name]
    importlib.import_module("transformers.modeling_utils")
    import_utils = importlib.import_module("transformers.utils.import_utils")
    for probe in ("is_flash_attn_2_available", "is_flash_attn_3_available", "is_flash_attn_4_available"):
        with contextlib.suppress(Exception):
            getattr(import_utils, probe, lambda: None)()
    import torch

    def unpad_input(hidden_states, attention_mask, unused_mask=None):
        mask = attention_mask if unused_mask is None else attention_mask + unused_mask
        seqlens = mask.sum(-1, dtype=torch.int32)
        indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
        cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
        flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
        return flat[indices], indices, cu_seqlens, int(seqlens.max()), attention_mask.sum(-1, dtype=torch.int32)

    def pad_input(hidden_states, indices, batch, seqlen):
        out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
        out[indices] = hidden_states
        return out.reshape(batch, seqlen, *hidden_states.shape[1:])

    pkg = types.ModuleType("flash_attn", "CPU stand-in (fsdp2_compat_harness.engines.cpu), import time only")
    pkg.__path__ = []
    pkg.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    sub = types.ModuleType("flash_attn.bert_padding", "CPU stand-in (fsdp2_compat_harness.engines.cpu)")
    sub.__spec__ = importlib.machinery.ModuleSpec("flash_attn.bert_padding", None)
    sub.pad_input, sub.unpad_input = pad_input, unpad_input
    pkg.bert_padding = sub
    sys.modules["flash_attn"], sys.modules["flash_attn.bert_padding"] = pkg, sub
    try:
        yield
    finally:
        for name in ("flash_attn.bert_padding", "flash_attn"):
            if sys.modules.get(name) in (pkg, sub):
                del sys.modules[name]
