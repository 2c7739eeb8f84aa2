"""What happened to a target: the outcome names and the ``Outcome`` record.

One vocabulary for the engine (which records outcomes), the policy (which
decides them), status and the CLI (which show them)::

    applied                            patched; ``proven`` says whether inside the proven range
    waiting for import                 requested; its module has not been imported yet
    other seam                         another target of the patch fits this release's code
    not needed                         fixed upstream, or declared not to need it
    refused: unknown upstream code     the code matches no recorded fingerprint: never patched blind
    refused: outside the proven range  known code, but FSDP2_COMPAT_STRICT=proven refuses unproven releases
    refused: release not covered       the catalogue knows this release has the bug in code the patch does not fit
    failed                             the seam raised; nothing was changed
    skipped: not installed             the distribution is absent
    reverted / not requested
"""


from collections import namedtuple

# What the catalogue says of one code path or release, where the answer is more than "ok or why not":
# ``kind`` names the class (doctor: "fixes" / "not needed" / ...; ``covered``: "proven" / "unverified" / ...),
# ``why`` says what decided it.  (Where the answer is "ok or why not", the convention is ``None`` or the reason.)
Classified = namedtuple("Classified", "kind why")


class Fsdp2CompatError(RuntimeError):
    """A requested patch could not be applied (or, ``core.calls``, not do its work) and strict mode is on."""


APPLIED = "applied"
WAITING = "waiting for import"
NOT_INSTALLED = "skipped: not installed"
VERSION = "refused: outside the proven range"
DRIFTED = "refused: unknown upstream code"
UNSUPPORTED = "refused: release not covered"
NOT_NEEDED = "not needed"
OTHER_SEAM = "other seam"
FAILED = "failed"
REVERTED = "reverted"
NOT_REQUESTED = "not requested"

# Outcomes that mean "the user asked for this and did not get it".
PROBLEMS = (VERSION, DRIFTED, UNSUPPORTED, FAILED)
REFUSALS = (VERSION, DRIFTED, UNSUPPORTED)


def diff_path(target, version):
    """Repository path of the source diff equivalent to ``target`` for ``version``.

    A local version label names a build, not other code: ``2.13.0+cpu`` uses
    the ``2.13.0`` diffs.
    """
    if not target.diff or not version:
        return None
    return "patches/%s/%s/%s.diff" % (target.dist, version.split("+", 1)[0], target.diff)


class Outcome:
    """What happened to one target, and why."""

    __slots__ = ("target", "kind", "found", "detail", "proven")

    def __init__(self, target, kind, found=None, detail="", proven=None):
        self.target = target
        self.kind = kind
        self.found = found
        self.detail = detail
        self.proven = proven  # applied: True inside the proven range, False outside it

    def as_dict(self):
        t = self.target
        return {
            "target": t.key,
            "dist": t.dist,
            "module": t.module,
            "attr": t.attr,
            "what": t.what,
            "required": t.versions,
            "found": self.found,
            "outcome": self.kind,
            "proven": self.proven,
            "detail": self.detail,
            "diff": diff_path(t, self.found),
        }

    def __repr__(self):
        return "Outcome(%s: %s%s)" % (self.target.key, self.kind, " - " + self.detail if self.detail else "")

