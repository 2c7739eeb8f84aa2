"""The two declarative records everything else is built from.

An ``Integration`` says where one upstream framework keeps what we patch.
A ``Target`` is one seam in one upstream release range: "in distribution D,
versions V, module M, the object ``M.attr`` is the code whose fingerprint we
know; install what ``seam`` returns".  A ``Patch`` is what users name
(``glm4v``, ``qwen3vl``): a family-level bundle of targets, and the
transformers ``model_type`` values it is for.  Several patches may share a
target; it is applied once and reverted when no active patch needs it.

Supporting a new upstream release is a change to a ``Target``: widen
``versions`` and, if the released function changed, add its fingerprint.

Stdlib only: these records are imported at ``import fsdp2_compat.auto``.
"""


class Target:
    """One replaceable object in one upstream distribution.

    dist          distribution name as pip knows it (``verl``, ``skyrl-train``)
    module        module holding the object (``verl.utils.fsdp_utils``)
    attr          the object replaced, and the one whose code is fingerprinted:
                  a module global (``apply_fsdp2``) or a method of a module-level
                  class (``FSDP2Engine.prepare_model``)
    versions      the proven range: PEP 440 specifier of the releases the fix was
                  proven on (tests on real FSDP2).  The gate is the code, not
                  this range: see ``fsdp2_compat.core.policy``
    fingerprints  {release label: source fingerprint of ``module.attr``}
                  (see ``fsdp2_compat.core.guards.fingerprint``); a label names
                  the releases with that code (``"0.6.0-0.7.1"``)
    seam          ``"pkg.mod:function"``; ``function(module, attr)`` returns
                  ``{attr: replacement, ...}`` for every attribute it swaps
                  (names as ``attr`` is spelled: module globals, or
                  ``Class.method`` on the same class)
    fixed_in      specifier of releases that carry the fix (patch not needed)
    declared      {specifier: reason} for releases known to have nothing to patch
                  here (the module or function does not exist, or upstream's
                  code there is already right)
    unsupported   {specifier: reason} for releases known to have the bug in code
                  this target does not fit (a requested patch is refused there,
                  with a warning).  The release census requires every published
                  release to be fingerprinted, fixed, declared or unsupported
    diff          stem of the equivalent source diff: the file for release X is
                  ``patches/<dist>/<X>/<diff>.diff`` in the repository
    symptom       optional: what a user sees without this target, and on which stack, when
                  the bug is not the family's own (TRL's reads, torch's accumulation): owned
                  here once; ``registry.symptoms(patch)`` adds it to every patch carrying it
    assigned_to   optional ``("pkg.mod:Class.method", ...)``: class attributes a trainer assigns this module
                  function to (lmms-engine: ``Qwen3VLModel.forward = qwen3_vl_ops.model_forward``).  A request
                  made after that assignment also replaces the function there (and revert restores it)
    layout        optional name shared by targets that are alternative code layouts
                  of one fix in one module (verl's selection moved from
                  ``apply_fsdp2`` to ``_select_fsdp2_wrap_targets`` in 0.7.1): a
                  release's code fits one of them, and the others then report
                  "other seam" instead of a refusal.  Targets without it stand alone
    """

    __slots__ = ("dist", "module", "attr", "versions", "fingerprints", "seam", "fixed_in", "declared",
                 "unsupported", "diff", "what", "layout", "symptom", "assigned_to")

    def __init__(self, dist, module, attr, versions, fingerprints, seam, what, fixed_in=None, diff=None,
                 declared=None, unsupported=None, layout=None, symptom=None, assigned_to=()):
        self.dist = dist
        self.module = module
        self.attr = attr
        self.versions = versions
        self.fingerprints = dict(fingerprints)
        self.seam = seam
        self.what = what
        self.fixed_in = fixed_in
        self.declared = dict(declared or {})
        self.unsupported = dict(unsupported or {})
        self.layout = layout
        self.diff = diff
        self.symptom = symptom
        self.assigned_to = tuple(assigned_to)

    @property
    def key(self):
        return "%s:%s.%s" % (self.dist, self.module, self.attr)

    def __repr__(self):
        return "Target(%s %s)" % (self.key, self.versions)


class Patch:
    """A user-facing patch name and the targets it needs.

    name         what users write in FSDP2_COMPAT_PATCHES
    summary      one line: the family's own symptom (symptoms its shared targets own are
                 added by ``registry.symptoms``, never repeated here)
    model_types  ``{transformers model_type: display name}`` of the model
                 families it is for, in the order users read them; the one
                 map from a model to its patch (check, audit, tests, README)
    targets      tuple of ``Target``
    references   upstream issues / PRs
    delete_when  when this patch can be removed
    note         optional: what ``model_types`` does not say (e.g. "and any
                 other text-only model verl serves through dense_common")
    """

    __slots__ = ("name", "summary", "model_types", "targets", "references", "delete_when", "note")

    def __init__(self, name, summary, model_types, targets, references, delete_when, note=""):
        self.name = name
        self.summary = summary
        self.model_types = dict(model_types)
        self.targets = tuple(targets)
        self.references = tuple(references)
        self.delete_when = delete_when
        self.note = note

    @property
    def families(self):
        """Display names of the model families, e.g. ``("GLM-4.1V (glm4v)", ...)``."""
        return tuple("%s (%s)" % (label, mt) for mt, label in self.model_types.items())

    def __repr__(self):
        return "Patch(%r, %d targets)" % (self.name, len(self.targets))


class Integration:
    """One upstream distribution (a framework, or torch), as the tooling and the tests need to find it.

    dist         distribution name as pip knows it (``skyrl-train``)
    package      its top-level import package (``skyrl_train``), for reading wheels
    wrap_module  the module whose ``apply_fsdp2`` wraps a model for FSDP2; None when the
                 framework leaves the wrapping to another package (TRL: accelerate), and
                 for torch (FSDP2 itself: patched, wrapping nothing)
    callers      modules that import a target by name (aliases the engine rebinds):
                 ``apply_fsdp2``, or TRL's ``add_fused_lm_head``
    covered      ``Covered`` records: the framework's own code paths, proven through its code,
                 that no target of its own patches (shared targets fix them, or nothing can);
                 ``status`` and ``list`` report them (``core.covered``)
    """

    __slots__ = ("dist", "package", "wrap_module", "callers", "covered")

    def __init__(self, dist, package, wrap_module, callers=(), covered=()):
        self.dist = dist
        self.package = package
        self.wrap_module = wrap_module
        self.callers = tuple(callers)
        self.covered = tuple(covered)

    def __repr__(self):
        return "Integration(%s)" % self.dist


class Covered:
    """One code path of a framework, proven through its own code, that the framework's integration does not patch.

    module, attr  the framework's function or ``Class.method`` on that path
    fingerprints  {release label: fingerprint} of the code the proof ran on
    by            what makes it right: the shared targets that fix it ("the model's patch:
                  transformers_media"), "right as released", or why nothing does
    fixed         False where the path stays broken (an upstream bug no fix here reaches)
    """

    __slots__ = ("module", "attr", "fingerprints", "by", "fixed")

    def __init__(self, module, attr, fingerprints, by, fixed=True):
        self.module = module
        self.attr = attr
        self.fingerprints = dict(fingerprints)
        self.by = by
        self.fixed = fixed

    def __repr__(self):
        return "Covered(%s.%s)" % (self.module, self.attr)
