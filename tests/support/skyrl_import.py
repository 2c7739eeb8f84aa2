"""Import the real SkyRL FSDP modules in the CPU / Python 3.11 test venvs.

``import_skyrl_module(name)`` returns the module ``name`` (for example
``"skyrl.backends.skyrl_train.distributed.fsdp_utils"`` or
``"skyrl_train.distributed.fsdp_strategy"``), loaded from the installed
upstream files, which are never edited. It first tries a plain import and only
applies a workaround when that plain import fails for one of these known,
test-environment-only reasons:

1. ``skyrl.backends`` (skyrl 0.2.0 and 0.3.0) on Python < 3.12.
   ``skyrl/backends/__init__.py`` imports ``skyrl.backends.backend``, which imports
   ``skyrl.tinker.types``. That module declares ``class MultiModalKwargs(typing.TypedDict)``
   and uses it in a pydantic model. Every pydantic 2.x release (2.0 through
   2.14, checked) rejects ``typing.TypedDict`` below Python 3.12
   (``PydanticUserError``, code ``typed-dict-version``: "Please use
   ``typing_extensions.TypedDict``"). No pydantic pin helps, and skyrl uses the
   pydantic 2 API, so pydantic 1 is not an option either. The FSDP modules do
   not need that ``__init__`` (it only re-exports the Tinker ``AbstractBackend``).
   Workaround: register ``skyrl.backends`` in ``sys.modules`` as a bare package
   object whose ``__path__`` is the real ``skyrl/backends`` folder, so the
   submodules load from the real files and only the failing ``__init__`` is
   skipped. (Rebinding ``typing.TypedDict`` to ``typing_extensions.TypedDict``
   would also work, but it changes the standard library for the whole process.)

2. ``flash_attn`` (all of skyrl 0.1.0-0.3.0 and skyrl-train 0.3.1).
   ``fsdp_strategy`` imports ``model_wrapper``, which runs
   ``from flash_attn.bert_padding import pad_input, unpad_input`` at module top.
   flash-attn has no CPU build and cannot be installed without CUDA.
   Workaround: for the duration of the import only, put a stand-in
   ``flash_attn.bert_padding`` (pure-torch ``pad_input`` / ``unpad_input`` with the
   flash-attn 2.7 signatures) into ``sys.modules``; remove it again afterwards.
   The stand-in must not stay visible: transformers 5.x ``is_flash_attn_2_available()``
   raises ``KeyError: 'flash_attn'`` when ``find_spec("flash_attn")`` finds a module
   that has no installed distribution. So transformers' own flash-attn probes
   are run (and cached) before the stand-in appears.

3. ``skyrl_train.distributed.fsdp_strategy`` of skyrl-train 0.3.1.
   It does ``from skyrl_train.distributed.fsdp_utils import MixedPrecisionPolicy``,
   but 0.3.1's ``fsdp_utils`` no longer imports that name (0.3.0's did): the
   released module cannot be imported on any torch. Workaround: set
   ``fsdp_utils.MixedPrecisionPolicy = torch.distributed.fsdp.MixedPrecisionPolicy``
   (an attribute on the loaded module object) before importing ``fsdp_strategy``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["import_skyrl_module"]


def import_skyrl_module(name: str) -> types.ModuleType:
    """Return the real upstream module ``name`` (see the module docstring for why
    and when a workaround is applied)."""
    if name in sys.modules:
        return sys.modules[name]
    if name == "skyrl.backends" or name.startswith("skyrl.backends."):
        _ensure_skyrl_backends_package()
    if name == "skyrl_train.distributed.fsdp_strategy":
        _ensure_skyrl_train_mixed_precision_policy()
    with _flash_attn_bert_padding_standin():
        return importlib.import_module(name)


def _ensure_skyrl_backends_package() -> None:
    from fsdp2_compat.tooling.scenarios import ensure_skyrl_backends_package

    ensure_skyrl_backends_package()


def _ensure_skyrl_train_mixed_precision_policy() -> None:
    fsdp_utils = importlib.import_module("skyrl_train.distributed.fsdp_utils")
    if not hasattr(fsdp_utils, "MixedPrecisionPolicy"):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        fsdp_utils.MixedPrecisionPolicy = MixedPrecisionPolicy


@contextlib.contextmanager
def _flash_attn_bert_padding_standin():
    if "flash_attn" in sys.modules or importlib.util.find_spec("flash_attn") is not None:
        yield
        return
    _warm_transformers_flash_attn_probes()
    import torch

    def unpad_input(hidden_states, attention_mask, unused_mask=None):
        all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
        seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
        used_seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
        indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
        max_seqlen = int(seqlens.max().item())
        cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
        flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
        return flat[indices], indices, cu_seqlens, max_seqlen, used_seqlens

    def pad_input(hidden_states, indices, batch, seqlen):
        out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
        out = out.index_put((indices,), hidden_states)
        return out.reshape(batch, seqlen, *hidden_states.shape[1:])

    pkg = types.ModuleType("flash_attn", "stand-in from tests/support/skyrl_import.py")
    pkg.__path__ = []
    pkg.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    sub = types.ModuleType("flash_attn.bert_padding", "stand-in from tests/support/skyrl_import.py")
    sub.__spec__ = importlib.machinery.ModuleSpec("flash_attn.bert_padding", None)
    sub.pad_input, sub.unpad_input = pad_input, unpad_input
    pkg.bert_padding = sub
    sys.modules["flash_attn"] = pkg
    sys.modules["flash_attn.bert_padding"] = sub
    try:
        yield
    finally:
        for mod in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
            if sys.modules[mod] is pkg or sys.modules[mod] is sub:
                del sys.modules[mod]


def _warm_transformers_flash_attn_probes() -> None:
    # Import transformers' modelling stack and run its (lru-cached in 5.x)
    # flash-attn availability checks while no flash_attn module is visible.
    importlib.import_module("transformers.modeling_utils")
    import_utils = importlib.import_module("transformers.utils.import_utils")
    for probe in (
        "is_flash_attn_2_available",
        "is_flash_attn_3_available",
        "is_flash_attn_4_available",
    ):
        fn = getattr(import_utils, probe, None)
        if fn is not None:
            with contextlib.suppress(Exception):
                fn()
