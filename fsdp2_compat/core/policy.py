"""The gate: whether a requested target may be applied to the code that is installed.

The code decides, not the version number:

1. the installed code matches a recorded fingerprint: apply.  Inside the
   target's proven range (``Target.versions``) that is the normal case;
   outside it the outcome says so ("code identical to the 0.2.0-0.3.0
   release; 0.4.0 not in the proven range"), so a framework release that did
   not change the code we fix is covered the day it ships;
2. it matches no fingerprint: never patched blind.  The target is refused,
   and because the user asked for it that is a WARNING on the
   ``fsdp2_compat`` logger plus one line on stderr naming the patch, the
   distribution and version, expected vs found fingerprint, and what to do;
3. except where the catalogue already knows why: the release carries the fix
   (``fixed_in``), is declared not to need the target (``declared``), is
   known to have the bug in code the target does not fit (``unsupported``:
   refused, loudly, as unknown code is), or another target of the same
   patch fits this release's code (verl moved its
   selection from ``apply_fsdp2`` to ``_select_fsdp2_wrap_targets`` in 0.7.1:
   one target per layout, only one fits any release).

Strict mode (``FSDP2_COMPAT_STRICT``), only when the user asks for it:
``1`` turns a refusal or a failure into ``Fsdp2CompatError``; ``proven``
also refuses, with that error, code outside the proven range.

Stdlib only at import; ``guards`` imports packaging lazily.
"""

from . import guards
from .config import STRICT_PROVEN
from .outcomes import APPLIED, DRIFTED, FAILED, NOT_NEEDED, OTHER_SEAM, REFUSALS, UNSUPPORTED, VERSION

APPLY = "apply"
REFUSE = "refuse"


def code_label(target, module, lookup):
    """``(label, fingerprint)`` of the installed code: the release label it matches (or None).

    ``label`` is None and ``fingerprint`` a reason string when the code is absent
    or cannot be read (unknown code, never an error).
    """
    try:
        current = lookup(module, target.attr)
    except guards.Drift as exc:  # a ``Class.method`` whose class the release lacks (``core.calls``)
        return None, str(exc)
    if current is None:
        return None, "%s has no attribute %r" % (target.module, target.attr)
    try:
        fp = guards.fingerprint(current)
    except LookupError as exc:
        return None, "cannot verify %s.%s: %s" % (target.module, target.attr, exc)
    for label, known in target.fingerprints.items():
        if known == fp:
            return label, fp
    return None, fp


def fixed_reason(target, version):
    """Why ``version`` needs nothing from ``target`` because upstream carries the fix, or None.

    Decided from the installed release alone, so ``status`` can say it before
    the target's module is imported and the engine says the same at import
    (reading the version at ``apply()`` would cost ``importlib.metadata`` at
    interpreter start-up).
    """
    if target.fixed_in and version and guards.in_range(version, target.fixed_in):
        return "fixed upstream in %s %s" % (target.dist, target.fixed_in)
    return None


def declared_reason(target, version):
    """The catalogue's reason why ``version`` does not need ``target``, or None."""
    return _reason(target.declared, version)


def unsupported_reason(target, version):
    """The catalogue's reason why ``version`` has the bug in code ``target`` does not fit, or None."""
    return _reason(target.unsupported, version)


def _reason(specs, version):
    for spec, reason in (specs or {}).items():
        if guards.in_range(version, spec):
            return reason
    return None


class Verdict:
    """What the gate decided: ``action`` (APPLY / REFUSE / None: nothing to do), the outcome kind, why."""

    __slots__ = ("action", "kind", "detail", "proven")

    def __init__(self, action, kind, detail, proven=True):
        self.action = action
        self.kind = kind
        self.detail = detail
        self.proven = proven


def judge(target, module, found, siblings, lookup, strict, is_ours=lambda obj: False):
    """The verdict for ``target`` in the imported ``module`` of installed release ``found``.

    ``siblings``: the alternative layouts of the target's fix (same module);
    ``lookup(module, attr)``: how the engine finds an attribute; ``strict``: a
    ``STRICT_*`` level; ``is_ours(obj)``: whether an object is a replacement
    the engine installed (a sibling already applied fits, whatever the order
    the import hooks run in).
    """
    fixed = fixed_reason(target, found)
    if fixed is not None:
        return Verdict(None, NOT_NEEDED, fixed)
    label, fp = code_label(target, module, lookup)
    if label is None:
        # Another layout of the same fix fits this code: that one applies (say so first).
        for other in siblings:
            if is_ours(lookup(module, other.attr)):
                return Verdict(None, OTHER_SEAM, "%s %s uses the %s seam (applied)" % (target.dist, found, other.attr))
            other_label, _ = code_label(other, module, lookup)
            if other_label is not None:
                return Verdict(None, OTHER_SEAM, "%s %s uses the %s seam (code of the %s release)"
                               % (target.dist, found, other.attr, other_label))
        reason = declared_reason(target, found)
        if reason is not None:
            return Verdict(None, NOT_NEEDED, "%s %s: %s" % (target.dist, found, reason))
        reason = unsupported_reason(target, found)
        if reason is not None:
            return Verdict(REFUSE, UNSUPPORTED, "%s %s: %s" % (target.dist, found, reason))
        known = ", ".join("%s=%s" % kv for kv in target.fingerprints.items())
        if fp.startswith(("cannot verify", target.module)):
            detail = fp
        else:
            detail = "%s.%s has fingerprint %s, expected one of: %s" % (target.module, target.attr, fp, known)
        return Verdict(REFUSE, DRIFTED, detail)
    if guards.in_range(found, target.versions):
        return Verdict(APPLY, APPLIED, "")
    detail = "code identical to the %s release; %s %s not in the proven range %s" % (
        label, target.dist, found, target.versions)
    if strict == STRICT_PROVEN:
        return Verdict(REFUSE, VERSION, detail + " (FSDP2_COMPAT_STRICT=proven refuses it)")
    return Verdict(APPLY, APPLIED, detail, proven=False)


def refusal_message(patches, target, found, detail):
    """The one line a refused, requested target prints: what, where, expected vs found, what to do."""
    spans = sorted(target.fingerprints)
    return (
        "fsdp2-compat: patch %s NOT applied to %s %s (%s): %s. This code is unknown to fsdp2-compat, so it is "
        "never patched blind. Pin a release whose code it knows (%s %s), upgrade fsdp2-compat, or set "
        "FSDP2_COMPAT_STRICT=1 to make this an error."
        % ("/".join(sorted(patches)), target.dist, found, target.what, detail, target.dist, ", ".join(spans))
    )


def log_outcome(outcome, patches=()):
    """Say what happened to a target on the ``fsdp2_compat`` logger: INFO, or a WARNING for a failure; a
    requested patch refused is never silent (the WARNING, and one line on stderr where a handler would
    otherwise swallow it)."""
    import logging
    import sys

    log = logging.getLogger("fsdp2_compat")
    message = "%s %s (%s): %s%s" % (outcome.target.key, outcome.found or "", outcome.target.what, outcome.kind,
                                    " - " + outcome.detail if outcome.detail else "")
    if outcome.kind in REFUSALS and patches:
        # (Python prints the WARNING itself when no handler is configured: then not twice.)
        line = refusal_message(patches, outcome.target, outcome.found, outcome.detail)
        log.warning(line)
        if log.hasHandlers():
            try:
                sys.stderr.write(line + "\n")
            except Exception:
                pass
    elif outcome.kind == FAILED:
        log.warning(message)
    else:
        log.info(message)
