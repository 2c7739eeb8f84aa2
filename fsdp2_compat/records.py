"""The two declarative records everything else is built from.

A ``Target`` is one seam in one upstream release range: "in distribution D,
versions V, module M, the object ``M.attr`` is the code whose fingerprint we
know; install what ``seam`` returns".  A ``Patch`` is what users name
(``glm4v``, ``qwen3vl``): a family-level bundle of targets.  Several patches
may share a target; it is applied once and reverted when no active patch
needs it.

Supporting a new upstream release is a change to a ``Target``: widen
``versions`` and, if the released function changed, add its fingerprint.

Stdlib only: these records are imported at ``import fsdp2_compat.auto``.
"""


class Target:
    """One replaceable object in one upstream distribution.

    dist          distribution name as pip knows it (``verl``, ``skyrl-train``)
    module        module holding the object (``verl.utils.fsdp_utils``)
    attr          the object replaced, and the one whose code is fingerprinted
    versions      PEP 440 specifier string the seam was verified on
    fingerprints  {release label: source fingerprint of ``module.attr``}
                  (see ``fsdp2_compat.guards.fingerprint``)
    seam          ``"pkg.mod:function"``; ``function(module, attr)`` returns
                  ``{attr: replacement, ...}`` for every module attribute it swaps
    fixed_in      specifier of releases that carry the fix (patch not needed)
    diff          stem of the equivalent source diff: the file for release X is
                  ``patches/<dist>/<X>/<diff>.diff`` in the repository
    """

    __slots__ = ("dist", "module", "attr", "versions", "fingerprints", "seam", "fixed_in", "diff", "what")

    def __init__(self, dist, module, attr, versions, fingerprints, seam, what, fixed_in=None, diff=None):
        self.dist = dist
        self.module = module
        self.attr = attr
        self.versions = versions
        self.fingerprints = dict(fingerprints)
        self.seam = seam
        self.what = what
        self.fixed_in = fixed_in
        self.diff = diff

    @property
    def key(self):
        return "%s:%s.%s" % (self.dist, self.module, self.attr)

    def __repr__(self):
        return "Target(%s %s)" % (self.key, self.versions)


class Patch:
    """A user-facing patch name and the targets it needs.

    name        what users write in FSDP2_COMPAT_PATCHES
    summary     one line: the symptom it fixes
    families    model families it is for (README / status)
    targets     tuple of ``Target``
    references  upstream issues / PRs
    delete_when when this patch can be removed
    """

    __slots__ = ("name", "summary", "families", "targets", "references", "delete_when")

    def __init__(self, name, summary, families, targets, references, delete_when):
        self.name = name
        self.summary = summary
        self.families = tuple(families)
        self.targets = tuple(targets)
        self.references = tuple(references)
        self.delete_when = delete_when

    def __repr__(self):
        return "Patch(%r, %d targets)" % (self.name, len(self.targets))
