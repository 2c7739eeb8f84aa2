"""Running one ``check`` case: its prints captured, and the 2-rank runs with their gradient verdict.

Shared by ``check`` and the modules that add its rows (``mixed``): a case's
upstream prints are kept per case, and a 2-rank run that completes but misses
the data-parallel average is reported where a crash would be.
"""

import contextlib
import io
import sys

TOL = 1e-5


def captured(fn, *args, **kwargs):
    """``fn(...)`` with Python-level stdout/stderr captured; returns (result, text).

    Logging handlers that hold the process's stdout / stderr (LLaMA-Factory logs
    to a ``StreamHandler(sys.stdout)`` it made at import, AReaL to its own) write
    into the capture too, so ``--json`` output stays JSON; so do handlers made
    while an earlier capture was on (they hold its buffer).
    """
    buf = io.StringIO()
    _buffers.append(buf)
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf), _log_streams_to(buf):
        result = fn(*args, **kwargs)
    return result, buf.getvalue()


_buffers = []  # every capture buffer of this process (a logging handler may have kept one)


@contextlib.contextmanager
def _log_streams_to(buf):
    import logging

    streams = {id(s) for s in (sys.__stdout__, sys.__stderr__, sys.stdout, sys.stderr) + tuple(_buffers)
               if s is not None}
    moved = []
    loggers = [logging.getLogger()] + [v for v in logging.Logger.manager.loggerDict.values()
                                       if isinstance(v, logging.Logger)]
    for logger in loggers:
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler and id(handler.stream) in streams:
                moved.append((handler, handler.setStream(buf)))
    try:
        yield
    finally:
        for handler, stream in reversed(moved):
            handler.setStream(stream)


def two_ranks(fn, *args, **run_options):
    """``fn(rank, 2, *args, steps=1)`` on 2 gloo ranks (separate processes) with different data per rank."""
    from .ranks import run_ranks
    from .scenarios import first_line

    try:
        results = run_ranks(fn, 2, *args, kwargs={"steps": 1}, **run_options)
    except Exception as exc:  # the scenario itself broke: report, do not die
        return {"error": "%s: %s" % (type(exc).__name__, first_line(exc)), "loss_err": None, "output": ""}
    return worst_rank(results)


def worst_rank(results):
    """One row's dict from every rank's result: the first error, else the rank with the worst gradient (an error
    naming the gradient and its distance from the data-parallel average when that misses ``TOL``)."""
    errors = [r for r in results if r["error"] is not None]
    if errors:
        return errors[0]
    worst = max(results, key=lambda r: r["grad_err"])
    out = dict(worst)
    if worst["grad_err"] >= TOL:
        # Runs, but wrong: report it where a crash would go, with the measured size.
        out["error"] = "runs, but the %s gradient misses the data-parallel average by %.2g" % (
            worst["worst_grad"], worst["grad_err"])
    return out


def each_case(rank, world, directory, cases, base, run):
    """``run(rank, world, checkpoint_dir, case)`` for each of ``cases`` (each over the defaults ``base``) in this
    rank process, every patch forgotten and reverted around each; the results so far are written to
    ``directory/rank<N>.json`` after each case (what ``collect``-style readers take from a rank a later case aborted).
    Returns them all."""
    import json
    import os

    import fsdp2_compat

    from . import subset

    out = []
    for number, case in enumerate(cases):
        subset.forget()
        fsdp2_compat.revert()
        out.append(run(rank, world, os.path.join(directory, "ckpt%d" % number), dict(base, **case)))
        with open(os.path.join(directory, "rank%d.json" % rank), "w", encoding="utf-8") as f:
            json.dump(out, f, default=str)
    subset.forget()
    fsdp2_compat.revert()
    return out


def written_cases(directory, world, count):
    """What ``each_case`` wrote, per case: ``[rank 0 result, ...]``, or None for a case some rank did not finish."""
    import json
    import os

    written = []
    for rank in range(world):
        path = os.path.join(directory, "rank%d.json" % rank)
        written.append(json.load(open(path, encoding="utf-8")) if os.path.exists(path) else [])
    return [[w[i] for w in written] if all(len(w) > i for w in written) else None for i in range(count)]
