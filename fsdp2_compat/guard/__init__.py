"""The run-time rank-divergence guard (``FSDP2_COMPAT_GUARD=1``): name a collective mismatch instead of hanging.

FSDP2 assumes every rank runs the same units in the same order with the same parameters: each unit all-gathers its
parameters before its forward (and again before its backward) and reduce-scatters the ones that got a gradient.
When one rank's micro-batch skips a unit (a vision tower on a text-only micro-batch), runs it once more (an image
and a video: the tower once per kind) or leaves a parameter of a unit without a gradient (an MoE expert no token on
that rank reached), the ranks issue different collectives: NCCL waits until its watchdog fires, gloo aborts with
``Received data size doesn't match expected size``; neither names the module.

With the guard on, right before each of those collectives every rank contributes four integers (what it is about to
do, a hash of the unit's path, how many parameters, a hash of their names) to one tiny all-gather on the same
process group.  Equal everywhere: the collective runs as it would have. Different: every rank exchanges a
description (``all_gather_object``) and raises ``GuardError`` at the same point, naming the unit's module path,
what each rank was about to do, the likely cause and the patch that covers it (read from the catalogue at that
moment), or that none does.  The ranks leave the collective in step, so the error is the first thing printed,
within the step it happens in.

Contract:

- Opt-in only.  ``requested()`` reads ``FSDP2_COMPAT_GUARD`` (``1`` / ``true``
  / ``yes`` / ``on``); unset, nothing is installed anywhere (no wrapper, no
  hook, no import).  The implicit ways in (the start-up ``.pth``, the verl
  plugin, the Ray hook) and ``import fsdp2_compat.auto`` call
  ``install_if_requested()``; ``install()`` / ``uninstall()`` are the explicit
  API.
- Importing this package imports neither torch nor anything beyond the
  stdlib: the torch side (``collectives``, ``agree``) is imported by a
  post-import hook once ``torch.distributed.fsdp._fully_shard._fsdp_param_group``
  is imported (at once, if it already is).
- It changes nothing FSDP2 computes: it adds one small all-gather (and, on a
  mismatch, one object all-gather) per unit collective; the cost per step is
  printed by ``benchmarks/guard_cost.py``.  Collectives a rank issues outside
  FSDP2's units (the user's own all-reduce) are not checked.

How it binds and why it is not a catalogue ``Target``: it wraps the two module
globals through which every FSDP2 unit collective goes,
``_fsdp_param_group.foreach_all_gather`` (called by ``FSDPParamGroup.unshard``)
and ``foreach_reduce`` (called by ``FSDPParamGroup.post_backward``), reading
their arguments by parameter name.  Those are the only functions it touches, so
it composes with the catalogue's wrapper of ``post_backward`` (the
accumulation fix) whatever the order, and it replaces no released behaviour, so
there is nothing a code fingerprint would protect: a torch release whose
functions no longer take ``fsdp_params`` / ``group`` / ``reduce_scatter_group``
is refused with one warning naming the function (``collectives.install``).
"""

from ..core import config, hooks
from .explain import GuardError  # noqa: F401  (stdlib only: the error type users catch)

FSDP_PARAM_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"

_state = {"requested": False, "installed": False, "refused": None}


def requested(environ=None):
    """True when ``FSDP2_COMPAT_GUARD`` asks for the guard."""
    return config.guard_requested(environ)


def install():
    """Turn the guard on in this process: now if torch's FSDP2 is imported, else when it is.  Idempotent."""
    if _state["requested"]:
        return
    _state["requested"] = True
    hooks.when_imported(FSDP_PARAM_GROUP, _bind)


def install_if_requested(environ=None):
    """``install()`` when ``FSDP2_COMPAT_GUARD`` asks for it; returns whether it did."""
    if requested(environ):
        install()
        return True
    return False


def _bind(module):
    if not _state["requested"]:
        return
    from . import agree, collectives

    refused = collectives.listen(agree.check, module)
    _state["installed"] = refused is None
    _state["refused"] = refused


def uninstall():
    """Turn the guard off (a pending post-import hook is cancelled; torch's functions are restored
    once nothing else listens)."""
    _state["requested"] = False
    hooks.cancel(FSDP_PARAM_GROUP, _bind)
    if _state["installed"]:
        from . import agree, collectives

        collectives.unlisten(agree.check)
    _state["installed"] = False


def status():
    """``{"requested": bool, "installed": bool, "refused": reason or None}`` for this process."""
    return dict(_state)
