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
   Workaround: for the duration of the import only, the named CPU stand-in
   ``fsdp2_compat_harness.engines.cpu.bert_padding_during_import`` (pure-torch
   ``pad_input`` / ``unpad_input`` with the flash-attn 2.7 signatures, removed
   again afterwards; transformers' flash-attn probes run and cache first, since
   a visible module without an installed distribution makes them raise).

3. ``skyrl_train.distributed.fsdp_strategy`` of skyrl-train 0.3.1.
   It does ``from skyrl_train.distributed.fsdp_utils import MixedPrecisionPolicy``,
   but 0.3.1's ``fsdp_utils`` no longer imports that name (0.3.0's did): the
   released module cannot be imported on any torch. Workaround: set
   ``fsdp_utils.MixedPrecisionPolicy = torch.distributed.fsdp.MixedPrecisionPolicy``
   (an attribute on the loaded module object) before importing ``fsdp_strategy``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types

from fsdp2_compat_harness.engines.cpu import bert_padding_during_import

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
    with bert_padding_during_import():
        return importlib.import_module(name)


def _ensure_skyrl_backends_package() -> None:
    from fsdp2_compat_harness.scenarios import ensure_skyrl_backends_package

    ensure_skyrl_backends_package()


def _ensure_skyrl_train_mixed_precision_policy() -> None:
    fsdp_utils = importlib.import_module("skyrl_train.distributed.fsdp_utils")
    if not hasattr(fsdp_utils, "MixedPrecisionPolicy"):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        fsdp_utils.MixedPrecisionPolicy = MixedPrecisionPolicy
