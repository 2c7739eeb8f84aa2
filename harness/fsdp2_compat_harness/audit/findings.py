"""What the auditor returns: records, never prose to parse back.

- ``Hazard``: one raw read of a sharded parameter (where FSDP2 would raise);
- ``Finding``: a problem of the plan itself (a nested unit, a tied weight split
  across units) or a note about the run, with a ``kind``, the full
  ``message`` and a ``short`` form for tables;
- ``Divergence``: a unit whose collectives differ between two kinds of micro-batch
  (``divergence``: ranks with those micro-batches hang or average wrong gradients);
- ``AuditInputError``: bad input (exit code 2 in the CLI).
"""

ROOT = ""  # the root unit's name

NO_PATCH = "no patch covers this: wrap the reading module instead"


class AuditInputError(ValueError):
    """Bad input (unknown family, plan, module name, config key ...): exit code 2."""


class Hazard:
    """One raw read of a sharded parameter.

    param        parameter name (its first alias in ``named_parameters``)
    owner        the FSDP unit that owns it (``""`` is the root)
    reader       innermost active module when the raw parameter was read
    reader_class that module's class name
    op           the torch function where the sharded value meets a plain
                 tensor (where FSDP2 raises); the read op if it never does
    read_op      the first torch function applied to the raw parameter
    mixed        True when ``op`` mixes the sharded value with a plain tensor
    patch        the fsdp2-compat patch that covers it, or None
    advice       what to do
    """

    __slots__ = ("param", "owner", "reader", "reader_class", "op", "read_op", "mixed", "patch", "advice")

    def __init__(self, param, owner, reader, reader_class, op, read_op, mixed, patch=None, advice=NO_PATCH):
        self.param = param
        self.owner = owner
        self.reader = reader
        self.reader_class = reader_class
        self.op = op
        self.read_op = read_op
        self.mixed = mixed
        self.patch = patch
        self.advice = advice

    def as_dict(self):
        return {k: getattr(self, k) for k in self.__slots__}

    def __repr__(self):
        return "Hazard(%s owned by %s, read by %s (%s), op %s, patch %s)" % (
            self.param, self.owner or "<root>", self.reader or "<root>", self.reader_class, self.op, self.patch)


class Divergence:
    """One FSDP2 unit whose collectives differ between micro-batches (``labels``: their kinds).

    unit      the unit's module path (``""`` is the root)
    labels    the batch kinds compared (``"text"``, ``"image"`` ..., ``"text, tokens N"``)
    gathers   {label: how many times the unit is entered (all-gathered) in forward and backward}
    reduced   {label: how many of its parameters are reduce-scattered (have a gradient)}
    missing   {label: names of parameters another label reduce-scatters and this one does not}
    nccl      what it does on NCCL (a hang, or silently wrong gradients)
    patch     the catalogue patch that removes it, or None (``NO_DIVERGENCE_PATCH``)
    """

    __slots__ = ("unit", "labels", "gathers", "reduced", "missing", "nccl", "patch")

    def __init__(self, unit, labels, gathers, reduced, missing, nccl, patch=None):
        self.unit = unit
        self.labels = tuple(labels)
        self.gathers = dict(gathers)
        self.reduced = dict(reduced)
        self.missing = dict(missing)
        self.nccl = nccl
        self.patch = patch

    @property
    def experts(self):
        """True when every parameter some label lacks is an expert's (MoE routing)."""
        names = [n for ns in self.missing.values() for n in ns]
        return bool(names) and all(".experts." in n or n.split(".")[-2:-1] == ["experts"] for n in names)

    def as_dict(self):
        d = {k: getattr(self, k) for k in self.__slots__}
        d["labels"] = list(self.labels)
        d["experts"] = self.experts
        d["advice"] = ("apply patch '%s'" % self.patch) if self.patch else NO_DIVERGENCE_PATCH
        return d

    def __repr__(self):
        return "Divergence(%s: %s, gathers %s, reduced %s)" % (self.unit or "<root>", "/".join(self.labels),
                                                               self.gathers, self.reduced)


NO_DIVERGENCE_PATCH = "no patch covers this"


class Finding:
    """A plan problem or a note: ``kind`` (machine), ``message`` (people), ``short`` (tables).

    Kinds: ``nested`` (a unit inside one sharded first), ``split-tied`` (a tied
    parameter across units), ``empty-layer-classes`` (verl would assert),
    ``adapted`` (transformers adapted so verl's forward runs), ``text-only``
    (no tiny batch for the model type: towers not exercised).
    """

    __slots__ = ("kind", "message", "short")

    def __init__(self, kind, message, short=None):
        self.kind = kind
        self.message = message
        self.short = short or message

    def as_dict(self):
        return {"kind": self.kind, "message": self.message, "short": self.short}

    def __str__(self):
        return self.message

    def __repr__(self):
        return "Finding(%s: %s)" % (self.kind, self.short)
