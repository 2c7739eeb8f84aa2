"""What the auditor returns: records, never prose to parse back.

- ``Hazard``: one raw read of a sharded parameter (where FSDP2 would raise);
- ``Finding``: a problem of the plan itself (a nested unit, a tied weight split
  across units) or a note about the run, with a ``kind``, the full
  ``message`` and a ``short`` form for tables;
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
