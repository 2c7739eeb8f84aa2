"""The one interface every ``fsdp2-compat check`` scenario has, and the typed records it passes.

A scenario is one module of this package holding ``SCENARIO``, an instance of
a ``Scenario`` subclass: the kinds of row it makes, its cases on the
installed stack, how it runs one side of a case, and the note the table
prints under its rows.  ``check`` finds every scenario module itself
(``scenarios()``), so adding a framework's rows is one module here.

    Case     one row to run: framework (its release), family, patch, kind
    Result   one side of a case, unpatched or patched: the error (None: it ran), the loss error against the
             unsharded data-parallel reference and its tolerance, what upstream printed
    Stack    what the cases are chosen from: the families and frameworks asked for, and the installed
             wrapping frameworks whose FSDP2 module imports here
"""

import importlib
import pkgutil
from collections import namedtuple

TOL = 1e-5  # a patched loss within this of the reference's is "matches"
# Printed under the table once, whichever 2-rank scenarios made rows.
TWO_RANKS_NOTE = ("note: '2 ranks' rows train on two gloo ranks with different data and compare the lm_head gradient "
                  "with the data-parallel average; one rank cannot show that bug.")

Case = namedtuple("Case", "framework version family patch kind")
Stack = namedtuple("Stack", "families frameworks importable")


class Result(namedtuple("Result", "error loss_err tol output wrapped")):
    """One side of a case.  ``error``: None when it ran (else the exact error, or why it is wrong); ``loss_err``:
    against the unsharded reference (None: not compared); ``wrapped``: the modules that got their own unit."""

    __slots__ = ()

    @classmethod
    def of(cls, result):
        """From a rank function's dict (``run_ranks``' results, ``rank_cases.two_ranks``)."""
        return cls(result.get("error"), result.get("loss_err"), result.get("tol", TOL), result.get("output", ""),
                   tuple(result.get("wrapped") or ()))

    @classmethod
    def failed(cls, error):
        return cls(error, None, TOL, "", ())


class Scenario:
    """One kind of ``check`` row (or a few that share their cases).  Subclasses set the class attributes and
    implement ``cases`` and ``run``; the rest has defaults.

    KINDS         the row kinds it makes
    ORDER         when its cases run among the others' (verl's monkey patch rewrites model classes for the whole
                  process: its fused forwards run after every wrap selection)
    BEFORE_GROUP  True: it runs before ``check`` opens its one-rank gloo group (the audit fakes its own)
    NOTE          printed once under the table when it made rows (None: nothing to say)
    """

    KINDS = ()
    ORDER = 50
    BEFORE_GROUP = False
    NOTE = None

    def cases(self, stack):
        """``[Case]`` to run on this stack (``Stack``)."""
        raise NotImplementedError

    def run(self, case, patched, scratch):
        """One side of ``case``: unpatched, or with ``case.patch`` (``patched``); a ``Result``.  ``scratch``: a
        directory the run may write in (model checkpoints), removed after the check."""
        raise NotImplementedError

    def refusal(self, case):
        """Why upstream cannot take ``case`` at all, patched or not (a row, not a run), or None."""
        return None

    def follow_up(self, case, unpatched):
        """More cases that the unpatched side's result calls for (one rank cannot show every bug)."""
        return []

    def fixed(self, case, unpatched, patched):
        """Whether the patch fixes the case: it ran, and its loss matches the reference."""
        return patched.error is None and patched.loss_err is not None and patched.loss_err < patched.tol

    def notes(self, rows):
        """What the table says under its rows."""
        return [self.NOTE] if self.NOTE and any(r["kind"] in self.KINDS for r in rows) else []


class OwnPaths(Scenario):
    """The rows of a framework's own code paths (axolotl's, ms-swift's): its module lists ``(kind, family,
    patch)`` for the stack (``cases(families)``) and runs one side as ``run_case(kind, family, patch or None)``."""

    def __init__(self, dist, kinds, order, note, cases, run_case):
        self.dist, self.KINDS, self.ORDER, self.NOTE = dist, tuple(kinds), order, note
        self._cases, self._run_case = cases, run_case

    def cases(self, stack):
        from fsdp2_compat.core import guards

        version = guards.installed_version(self.dist)
        return [Case(self.dist, version, family, patch, kind) for kind, family, patch in self._cases(stack.families)]

    def run(self, case, patched, scratch):
        return Result.of(self._run_case(case.kind, case.family, case.patch if patched else None))


def row(case, unpatched, patched, fixed):
    """A result row (what ``--json`` prints and the table shows) of ``case``."""
    return {
        "framework": case.framework,
        "version": case.version,
        "family": case.family,
        "kind": case.kind,
        "unpatched": "ok" if unpatched.error is None else unpatched.error,
        "patched": "ok" if patched.error is None else patched.error,
        "loss_match": None if patched.loss_err is None else patched.loss_err < patched.tol,
        "loss_err": patched.loss_err,
        "tol": patched.tol,
        "patch": case.patch,
        "fixed": fixed,
        "output": {"unpatched": unpatched.output, "patched": patched.output},
    }


def run_here(fn, *args, **kwargs):
    """``fn(0, 1, *args, **kwargs)`` in this process (on ``check``'s one-rank group), its prints captured, then
    every patch it requested reverted; a scenario that breaks is reported as the side's error."""
    import fsdp2_compat

    from ..rank_cases import captured
    from ..scenarios import first_line

    try:
        result, output = captured(fn, 0, 1, *args, **kwargs)
    except Exception as exc:  # the scenario itself broke: report, do not die
        result, output = {"error": "%s: %s" % (type(exc).__name__, first_line(exc)), "loss_err": None}, ""
    finally:
        fsdp2_compat.revert()
    return Result.of(dict(result, output=output))


def quiet(rank, world, fn, *args, **kwargs):
    """``fn(rank, world, *args, **kwargs)`` in a rank process, its prints captured into ``result["output"]``
    (``--json`` stays JSON): the rank function every 2-rank scenario hands ``rank_cases.two_ranks``."""
    from ..rank_cases import captured

    result, output = captured(fn, rank, world, *args, **kwargs)
    result["output"] = output
    return result


def scenarios():
    """Every scenario of this package, in ``ORDER``: each module here that holds a ``SCENARIO``."""
    from . import __path__ as here

    found = []
    for info in pkgutil.iter_modules(here):
        module = importlib.import_module("%s.%s" % (__package__, info.name))
        if isinstance(getattr(module, "SCENARIO", None), Scenario):
            found.append(module.SCENARIO)
    return sorted(found, key=lambda s: s.ORDER)


def by_kind(kind):
    """The scenario that makes rows of ``kind``."""
    return next(s for s in scenarios() if kind in s.KINDS)

