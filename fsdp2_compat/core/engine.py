"""Apply, track and revert patches.

Life of a target (one seam in one upstream module):

    requested --(module imported)--> applied | refused | not needed | other seam | failed --(revert)--> reverted

Nothing is decided when a patch is requested: the hook waits for the target
module, and the outcome is recorded when the import happens (or at once if
the module is already loaded).  Every decision is an ``Outcome`` that says
what was required and what was found.

Fail-safe rules:
- a seam is swapped only where the installed code has a recorded
  fingerprint (``policy``: the code decides; a release outside the proven
  range is applied with a note, unknown code is refused with a warning);
- all attributes of a seam and their aliases change together or not at all;
- a failing or refused patch never breaks the user's import, unless
  ``FSDP2_COMPAT_STRICT=1`` (or ``strict=True``) asks for an error
  (``FSDP2_COMPAT_STRICT=proven``: code outside the proven range too).

This module is imported by ``fsdp2_compat.auto``: stdlib only at top level.
"""

import sys
import _thread
from collections import namedtuple

from . import calls, config, hooks, swaps
from .swaps import is_ours  # noqa: F401  (re-exported: engine.is_ours)
from .calls import lookup  # noqa: F401  (re-exported: engine.lookup)

from .outcomes import (  # noqa: F401  (re-exported: callers say engine.APPLIED)
    APPLIED,
    DRIFTED,
    FAILED,
    NOT_INSTALLED,
    Fsdp2CompatError,
    NOT_NEEDED,
    NOT_REQUESTED,
    OTHER_SEAM,
    PROBLEMS,
    REFUSALS,
    REVERTED,
    UNSUPPORTED,
    VERSION,
    WAITING,
    Outcome,
    diff_path,
)


# The records a batch passes on (``collections``: already loaded at interpreter start-up).
# A rebind waiting for the scan that ends the current ``_Batch``: ``key`` is the target whose apply waits for it
# (undone if the scan fails), None for a revert's.
_Rebind = namedtuple("_Rebind", "original replacement skip changed key")
# A target settled inside a ``_Batch``, announced after its scan.
_Settled = namedtuple("_Settled", "state outcome patches level")
# One row of ``outcomes()``: the patch that requested the target, and what happened to it.
PatchOutcome = namedtuple("PatchOutcome", "patch outcome")


class _TargetState:
    __slots__ = ("target", "patches", "outcome", "applied", "hook", "late")

    def __init__(self, target):
        self.target = target
        self.patches = set()
        self.outcome = None
        self.applied = None
        self.hook = None
        self.late = False  # its module was imported before the request: objects may hold the original


_lock = _thread.RLock()
# Per thread, inside ``apply()`` / ``revert()``: the alias rebinds waiting for their one scan of sys.modules, and
# the outcomes to announce after it (``_Batch``).
_batch = _thread._local()
_states = {}  # target key -> _TargetState
_requested = {}  # patch name -> strict level (config.STRICT_*)


def _log():
    import logging

    return logging.getLogger("fsdp2_compat")


def _registry():
    from .. import registry

    return registry


def active_targets():
    """Keys of the targets whose replacements are installed right now."""
    with _lock:
        return swaps.active_targets()


def displaced(target):
    """What now stands where ``target``'s replacement was installed, when someone replaced it since
    (verl's ``apply_monkey_patch`` assigns its own model forwards to transformers' classes); else None."""
    with _lock:
        state = _states.get(target.key)
        applied = state.applied if state is not None else None
        if applied is None:
            return None
        for swap in applied.swaps:
            if swap.attr == target.attr:
                current = lookup(applied.module, swap.attr)
                return None if current is swap.replacement else current
    return None


def resolve_names(names):
    """Normalise ``names`` (None, a selection string, or an iterable) to patch names."""
    known = _registry().names()
    if names is None:
        return known
    if isinstance(names, str):
        return config.parse_selection(names, known)
    names = [str(n).strip().lower() for n in names]
    bad = [n for n in names if n not in known]
    if bad:
        raise config.ConfigError(
            "unknown patch %r. Valid names: %s." % (bad[0], ", ".join(known))
        )
    return tuple(n for n in known if n in names)


def apply(names=None, strict=None):
    """Request patches; each target applies when its module is imported.

    ``names``: None (all), a selection string (``"glm4v,-qwen3vl"``) or an
    iterable of names.  ``strict`` (True, ``"proven"``, False) defaults to
    ``FSDP2_COMPAT_STRICT``.  Returns the tuple of names requested.  Idempotent.
    """
    chosen = resolve_names(names)
    level = config.strict_level(config.strict_setting() if strict is None else strict)
    registry = _registry()
    with _lock:
        for name in chosen:
            _requested[name] = config.stricter(level, _requested.get(name))
        pending = []
        for name in chosen:
            for target in registry.patch(name).targets:
                state = _states.get(target.key)
                if state is None:
                    state = _states[target.key] = _TargetState(target)
                state.patches.add(name)
                if state.hook is None and state.applied is None and state.outcome is None:
                    state.late = target.module in sys.modules
                    state.hook = _make_hook(state)
                    state.outcome = Outcome(target, WAITING)
                    pending.append(state)
    # Outside the lock: a hook may fire at once (module already imported); one alias scan at the end.
    with _Batch():
        for state in pending:
            hooks.when_imported(state.target.module, state.hook)
    return chosen


class _Batch:
    """Within it, alias rebinds wait for one scan (``aliases.rebind_all``: 30-90 ms in a training process, as
    much for ten objects as for one); each settled target is announced (logged; in strict mode, raised) after
    it, its detail naming where its aliases were rebound.  Nested batches join the outermost one."""

    def __enter__(self):
        self._outer = getattr(_batch, "queue", None) is None
        if self._outer:
            _batch.queue, _batch.settled = [], []

    def __exit__(self, kind, exc, tb):
        if not self._outer:
            return False
        queue, settled = _batch.queue, _batch.settled
        _batch.queue = _batch.settled = None
        if queue:  # (aliases is not imported otherwise: ``import fsdp2_compat.auto`` applies nothing to rebind)
            _scan(queue)
        strict_error = None
        for done in settled:
            try:  # the state's outcome now: FAILED if the scan failed
                _announce(done.state, done.state.outcome or done.outcome, done.patches, done.level)
            except Fsdp2CompatError as error:
                strict_error = strict_error or error
        if strict_error is not None and exc is None:
            raise strict_error
        return False


def _requests(queue):
    from . import aliases

    return [aliases.Request(q.original, q.replacement, q.skip) for q in queue]


def _scan(queue):
    """One ``aliases.rebind_all`` for a batch's queue (``[_Rebind]``); if it fails, undo every target that
    waited for it."""
    from . import aliases

    with _lock:
        try:
            for rebind, found in zip(queue, aliases.rebind_all(_requests(queue))):
                rebind.changed.extend(found)
        except Exception as error:  # nothing was rebound: undo the targets that waited for it
            _batch.queue = []  # their undo's own rebinds, tried once below
            try:
                for rebind in queue:
                    key = rebind.key
                    state = _states.get(key)
                    if key is None or state is None or state.applied is None:
                        continue
                    _undo(state.applied)
                    state.applied = None
                    state.outcome = Outcome(state.target, FAILED, state.outcome.found,
                                            "%s: %s" % (type(error).__name__, error))
            finally:
                backs, _batch.queue = _batch.queue, None
            try:  # (the scan failed a moment ago; the seams' own globals are restored either way)
                aliases.rebind_all(_requests(backs))
            except Exception:
                pass
            if any(rebind.key is None for rebind in queue):  # a revert's rebinds: revert() raises, as it did
                raise


def _rebind(old, new, skip, changed, key=None):
    """Rebind the aliases of ``old`` into ``changed``: now, or in the scan that ends the current ``_Batch``
    (``key``: the target whose apply waits for it, undone if that scan fails; None for a revert's)."""
    queue = getattr(_batch, "queue", None)
    if queue is not None:
        return queue.append(_Rebind(old, new, skip, changed, key))
    from . import aliases

    changed.extend(aliases.rebind_all([aliases.Request(old, new, skip)])[0])


def _make_hook(state):
    def on_import(module):
        with _lock:
            if state.hook is not on_import:  # cancelled by revert meanwhile
                return
            state.hook = None
            level = None
            for name in state.patches:
                level = config.stricter(_requested.get(name), level)
            outcome = _settle(state, module, level)
            state.outcome = outcome
            patches = sorted(state.patches)
        settled = getattr(_batch, "settled", None)
        if settled is None:
            _announce(state, outcome, patches, level)
        else:  # after the batch's alias scan
            settled.append(_Settled(state, outcome, patches, level))

    return on_import


def _announce(state, outcome, patches, level):
    """Log a settled target (its detail completed with the aliases rebound); in strict mode raise a problem."""
    if outcome.kind == APPLIED and state.applied is not None and outcome is state.outcome:
        rebound = sorted({change.module for group in state.applied.aliases for change in group.changed})
        if rebound:
            outcome.detail += "; rebound aliases in " + ", ".join(rebound)
        if state.applied.instances:  # objects built before the request kept calling upstream's method
            outcome.detail += "; rebound objects that held the original: " + ", ".join(
                rebound.label for rebound in state.applied.instances)
    _log_outcome(outcome, patches)
    if level is not None and outcome.kind in PROBLEMS:
        raise Fsdp2CompatError(
            "fsdp2-compat (strict): %s for %s: %s" % (outcome.kind, outcome.target.key, outcome.detail)
        )


def _log_outcome(outcome, patches=()):
    from .policy import log_outcome

    log_outcome(outcome, patches)


def _settle(state, module, strict=None):
    """Decide (``policy.judge``) and, if the code is known, apply one target. Never raises."""
    from . import guards, policy

    target = state.target
    found = None
    try:
        found = guards.installed_version(target.dist)
        if found is None:
            return Outcome(target, NOT_INSTALLED, None, "%s is imported but %s has no installed metadata" % (target.module, target.dist))
        if _present(module, target.attr) and is_ours(lookup(module, target.attr)):
            return Outcome(target, APPLIED, found, "already patched", proven=guards.in_range(found, target.versions))
        verdict = policy.judge(target, module, found, _siblings(state), lookup, strict, is_ours)
        if verdict.action != policy.APPLY:
            return Outcome(target, verdict.kind, found, verdict.detail)
        applied = _swap(target, module, state.late)
    except guards.Drift as exc:
        return Outcome(target, DRIFTED, found, str(exc))
    except guards.NotNeeded as exc:
        return Outcome(target, NOT_NEEDED, found, str(exc))
    except Exception as exc:  # a broken patch must not break the user's import
        return Outcome(target, FAILED, found, "%s: %s" % (type(exc).__name__, exc))
    state.applied = applied
    detail = "replaced %s.%s" % (target.module, ", ".join(swap.attr for swap in applied.swaps))  # + aliases: _announce
    if verdict.detail:
        detail = verdict.detail + "; " + detail
    return Outcome(target, APPLIED, found, detail, proven=verdict.proven)


def _present(module, attr):
    """Whether ``module`` has ``attr`` at all: a ``Class.method`` whose class this release lacks is for
    ``policy.judge`` to classify (another layout's seam, declared, or unknown code), not a drift here."""
    from . import guards

    try:
        lookup(module, attr)
    except guards.Drift:
        return False
    return True


def _siblings(state):
    """Other targets of the requesting patches that patch the same module (one per code layout)."""
    return _registry().siblings(state.target, state.patches)


def _swap(target, module, late=False):
    """``swaps.install``, all or nothing, its alias rebinds in the current batch's scan."""
    applied = swaps.Applied(module)
    try:
        swaps.install(applied, target, late,
                      lambda old, new, skip, changed: _rebind(old, new, skip, changed, target.key))
    except BaseException:
        _undo(applied)
        raise
    return applied


def _undo(applied):
    """``swaps.undo``; the target's rebinds still waiting for a batch's scan never run."""
    mine = {id(group.changed) for group in applied.aliases}
    if getattr(_batch, "queue", None):
        _batch.queue[:] = [q for q in _batch.queue if id(q.changed) not in mine]
    return swaps.undo(applied, lambda old, new: _rebind(old, new, (), []))


def revert(names=None):
    """Undo patches (all when ``names`` is None) and forget their requests.

    A target shared with a patch that stays active is kept.  Originals are
    restored by identity; a name someone else rebound since is left alone and
    reported in the returned outcome's detail.
    """
    chosen = resolve_names(names) if names is not None else tuple(_requested)
    reverted = []
    with _lock, _Batch():
        for name in chosen:
            _requested.pop(name, None)
        for key, state in list(_states.items()):
            state.patches.difference_update(chosen)
            if state.patches:
                continue
            if state.hook is not None:
                hooks.cancel(state.target.module, state.hook)
                state.hook = None
            if state.applied is not None:
                kept = _undo(state.applied)
                state.applied = None
                detail = "left alone (rebound by someone else since): " + ", ".join(kept) if kept else ""
                reverted.append(Outcome(state.target, REVERTED, state.outcome.found, detail))
            del _states[key]
    for outcome in reverted:
        _log_outcome(outcome)
    return reverted


class patched:
    """Context manager: ``with patched("glm4v"): ...`` applies, then reverts.

    Patches that were already active before entering stay active after exit.
    """

    def __init__(self, names=None, strict=None):
        self._names = names
        self._strict = strict
        self._added = ()

    def __enter__(self):
        before = set(_requested)
        chosen = apply(self._names, strict=self._strict)
        self._added = tuple(n for n in chosen if n not in before)
        return self

    def __exit__(self, *exc):
        if self._added:
            revert(self._added)
        return False


def requested():
    with _lock:
        return tuple(_requested)


def outcomes(names=None):
    """``[PatchOutcome(patch name, Outcome)]`` for every target of ``names`` (default: all)."""
    registry = _registry()
    rows = []
    with _lock:
        for name in resolve_names(names):
            for target in registry.patch(name).targets:
                state = _states.get(target.key)
                if state is not None and name in state.patches and state.outcome is not None:
                    rows.append(PatchOutcome(name, state.outcome))
                else:
                    rows.append(PatchOutcome(name, Outcome(target, NOT_REQUESTED)))
    return rows


def is_applied(name):
    """True when every target of ``name`` that met its module is applied."""
    rows = [row.outcome for row in outcomes([name])]
    return any(o.kind == APPLIED for o in rows) and not any(o.kind in PROBLEMS for o in rows)


def strict_requested(where):
    """True when a patch that requested the target at ``where`` (``"module.attr"``) asked for strict mode."""
    with _lock:
        for state in _states.values():
            if "%s.%s" % (state.target.module, state.target.attr) == where:
                if any(_requested.get(name) is not None for name in state.patches):
                    return True
    return False


calls.set_strict_source(strict_requested)
