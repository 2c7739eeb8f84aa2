"""The declarative records everything else is built from.

A ``Fix`` is one mechanism, the unit of the catalogue: the seam callables it
installs, what a user sees without it, the upstream references, when it can
be deleted, and what proves it.  A ``Target`` is where one fix goes in one
upstream release range: "in distribution D, versions V, module M, the object
``M.attr`` is the code whose fingerprint we know; install the fix's seam
there".  An ``Integration`` says where one upstream framework keeps what we
patch, and lists its targets: data only.  A ``Patch`` is what users name
(``glm4v``, ``qwen3vl``): the fixes a model family needs, and the
transformers ``model_type`` values it is for; ``fsdp2_compat.registry``
derives its targets, references and delete conditions from its fixes by a
join.  Several patches may share a target; it is applied once and reverted
when no active patch needs it.

Supporting a new upstream release is a change to a ``Target``: widen
``versions`` and, if the released function changed, add its fingerprint.

Stdlib only: these records are imported at ``import fsdp2_compat.auto``.
"""


class Fix:
    """One mechanism, as the catalogue lists it (``fsdp2_compat.fixes`` declares one per mechanism).

    name         short name (``wrap-selection``), unique
    what         what it fixes, as a user reads it
    seams        ``{name: "pkg.mod:function"}``: the seam callables it installs (``Target.seam`` is one of them);
                 ``function(module, attr)`` returns ``{attr: replacement, ...}``
    symptom      what a user sees without it, and on which stack, when that is not only the family's own
                 (``Patch.summary`` says that): ``registry.symptoms`` adds it to every patch carrying the fix
    references   upstream issues / PRs
    delete_when  the condition under which the fix can go (one clause; a patch lists those of its fixes)
    scenarios    ``fsdp2-compat check`` kinds that run it unpatched and patched (the harness's scenarios)
    tests        the test modules that prove it on the released code
    """

    __slots__ = ("name", "what", "seams", "symptom", "references", "delete_when", "scenarios", "tests")

    def __init__(self, name, what, seams, delete_when, references=(), symptom=None, scenarios=(), tests=()):
        self.name = name
        self.what = what
        self.seams = dict(seams)
        self.symptom = symptom
        self.references = tuple(references)
        self.delete_when = delete_when
        self.scenarios = tuple(scenarios)
        self.tests = tuple(tests)

    def seam(self, via=None):
        """The dotted seam callable named ``via`` (None: the fix's only one)."""
        if via is None:
            if len(self.seams) != 1:
                raise ValueError("fix %s has %d seams (%s): name one" % (self.name, len(self.seams), ", ".join(self.seams)))
            return next(iter(self.seams.values()))
        return self.seams[via]

    def __repr__(self):
        return "Fix(%s)" % self.name


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
    fix           the ``Fix`` installed here; ``via`` names which of its seams when it has several
    seam          ``"pkg.mod:function"``: the fix's seam (given directly only for a target without a fix, such
                  as the core tests' toys); ``function(module, attr)`` returns
                  ``{attr: replacement, ...}`` for every attribute it swaps
                  (names as ``attr`` is spelled: module globals, or
                  ``Class.method`` on the same class)
    families      the transformers ``model_type`` values whose code this target is (verl's ``qwen3_vl``
                  fused forward: Qwen3-VL and Qwen3-VL-MoE); None: any model.  A patch carrying the fix
                  gets the target when one of its model types is listed (``registry``'s join)
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
    symptom       optional: what a user sees without this target where its code path differs from its
                  fix's (``Fix.symptom`` otherwise); ``registry.symptoms(patch)`` adds it to every patch
                  carrying it
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
                 "unsupported", "diff", "what", "layout", "symptom", "assigned_to", "fix", "families")

    def __init__(self, dist, module, attr, versions, fingerprints, seam=None, what="", fixed_in=None, diff=None,
                 declared=None, unsupported=None, layout=None, symptom=None, assigned_to=(), fix=None, via=None,
                 families=None):
        if (seam is None) == (fix is None):
            raise ValueError("a Target names its fix (or, without one, its seam): %s.%s" % (module, attr))
        self.dist = dist
        self.module = module
        self.attr = attr
        self.versions = versions
        self.fingerprints = dict(fingerprints)
        self.fix = fix
        self.seam = seam if fix is None else fix.seam(via)
        self.families = None if families is None else tuple(families)
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
    """A user-facing patch name and what it installs.

    name         what users write in FSDP2_COMPAT_PATCHES
    summary      one line: the family's own symptom (symptoms its fixes own are added by
                 ``registry.symptoms``, never repeated here)
    model_types  ``{transformers model_type: display name}`` of the model
                 families it is for, in the order users read them; the one
                 map from a model to its patch (check, audit, tests, README)
    targets      tuple of ``Target``: for the catalogue's patches, the registry's join of ``fixes``
                 with the integrations' targets; given directly only for a transient patch (harness, tests)
    references   upstream issues / PRs (the catalogue's: those of its fixes)
    delete_when  the conditions under which it can be removed, one per fix (a string is one condition)
    note         optional: what ``model_types`` does not say (e.g. "and any
                 other text-only model verl serves through dense_common")
    fixes        tuple of ``Fix``: what the family needs (empty for a transient patch)
    """

    __slots__ = ("name", "summary", "model_types", "targets", "references", "delete_when", "note", "fixes")

    def __init__(self, name, summary, model_types, targets, references, delete_when, note="", fixes=()):
        self.name = name
        self.summary = summary
        self.model_types = dict(model_types)
        self.targets = tuple(targets)
        self.references = tuple(references)
        self.delete_when = (delete_when,) if isinstance(delete_when, str) else tuple(delete_when)
        self.note = note
        self.fixes = tuple(fixes)

    @property
    def families(self):
        """Display names of the model families, e.g. ``("GLM-4.1V (glm4v)", ...)``."""
        return tuple("%s (%s)" % (label, mt) for mt, label in self.model_types.items())

    def __repr__(self):
        return "Patch(%r, %d targets)" % (self.name, len(self.targets))


class Integration:
    """One upstream distribution (a framework, or torch), as the harness and the tests need to find it.

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

    Its ``Target`` records are its module's ``TARGETS`` (``integrations.targets()`` lists them all).
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
