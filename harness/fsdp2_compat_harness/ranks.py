"""Run a function on N CPU ranks with a real gloo process group.

``run_ranks(fn, world, *args)`` forks ``world`` processes from a forkserver
that has torch, transformers and the frameworks preloaded (so a rank starts
in ~0.1 s instead of several seconds; ``rank_server``: shared by the
processes of a test run), rendezvouses them through a ``file://`` store (no ports),
calls ``fn(rank, world, *args)`` in each and returns the per-rank results.
A failure on any rank raises ``RankError`` carrying every rank's traceback.

Each call gets fresh processes: no patch, process group or model state leaks
between scenarios.  ``fn`` must be importable by module and name.  A rank
that dies without reporting is named with its exit code, and such a
transport failure (not an assertion or exception of ``fn``) is retried once.
Once a rank has died that way, the others get ``DEAD_RANK_GRACE`` seconds to
report and are then killed: they would only wait in a collective the dead rank
never joins until the process group's timeout.
"""

import os
import queue as queue_mod
import sys
import tempfile
import time
import traceback

from . import rank_server


class RankError(RuntimeError):
    """One or more ranks raised; ``errors`` maps rank -> (message, traceback)."""

    def __init__(self, errors):
        self.errors = errors
        first = min(errors)
        others = "".join("\nrank %d: %s" % (r, errors[r][0]) for r in sorted(errors) if r != first)
        super().__init__("rank %d failed: %s%s\n%s" % (first, errors[first][0], others, errors[first][1]))


def _rank_main(fn, rank, world, init_file, args, kwargs, results, pg_timeout=120):
    import datetime

    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    try:
        dist.init_process_group(
            "gloo",
            init_method="file://" + init_file,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        try:
            results.put((rank, True, fn(rank, world, *args, **kwargs)))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # report every failure to the parent
        results.put((rank, False, ("%s: %s" % (type(exc).__name__, exc), traceback.format_exc())))


# Seconds the other ranks get to report after one died without reporting (see ``_run_once``).
DEAD_RANK_GRACE = 5
# Failures of the transport rather than of the code under test: a rank that
# died without a word takes its peers' sockets with it.
_TRANSPORT = ("Connection reset by peer", "Connection closed by peer", "no report; process exit code")


def run_ranks(fn, world, *args, kwargs=None, timeout=300, retries=1, pg_timeout=120):
    """Run ``fn(rank, world, *args, **kwargs)`` on ``world`` gloo ranks; return results by rank.

    ``pg_timeout``: the process group's timeout in seconds (a run that is expected
    to stall in a collective sets it short, so the stall surfaces as gloo's error).

    A run that fails only because a rank process vanished (gloo then reports
    "Connection reset by peer" on the others) is retried ``retries`` times,
    with a note on stderr; any other failure is raised at once.
    """
    for attempt in range(retries + 1):
        try:
            return _run_once(fn, world, args, kwargs, timeout, pg_timeout)
        except RankError as exc:
            transport = all(any(t in msg for t in _TRANSPORT) for msg, _ in exc.errors.values())
            if not transport or attempt == retries:
                raise
            print("run_ranks: retrying %s after a transport failure: %s" % (fn.__name__, str(exc).splitlines()[0]),
                  file=sys.stderr)


def _run_once(fn, world, args, kwargs, timeout, pg_timeout=120):
    ctx = rank_server.context()
    with tempfile.TemporaryDirectory(prefix="fsdp2_compat_ranks_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        results = ctx.Queue()
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world, init_file, args, kwargs or {}, results, pg_timeout)) for r in range(world)]
        for p in procs:
            p.start()
        got, errors, dead_since = {}, {}, None
        deadline = time.monotonic() + timeout
        try:
            while len(got) + len(errors) < world:
                if time.monotonic() > deadline:
                    if not errors and dead_since is None:
                        errors[-1] = ("timeout after %ss" % timeout, "")
                    break
                try:
                    rank, ok, value = results.get(timeout=1)
                except queue_mod.Empty:
                    pending = [p for r, p in enumerate(procs) if r not in got and r not in errors]
                    # Ranks that died without reporting (a crash, a signal) never will.
                    if not any(p.is_alive() for p in pending):
                        break
                    if dead_since is None and any(not p.is_alive() for p in pending):
                        # gloo aborts the rank that sees a collective mismatch: the others then wait in a
                        # collective it never joins, until the process group's timeout.  Give them a moment
                        # to report what they saw, then stop waiting (they are killed below).
                        dead_since = time.monotonic()
                        deadline = min(deadline, dead_since + DEAD_RANK_GRACE)
                    continue
                (got if ok else errors)[rank] = value
                if errors:
                    # Give the other ranks a moment to report theirs (they
                    # may be stuck in a collective instead).
                    deadline = min(deadline, time.monotonic() + 10)
        finally:
            for p in procs:
                p.join(timeout=5 if errors or dead_since is not None else 60)
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors or len(got) < world:
        # A rank killed by a signal (negative exit code) never reports: say so.
        for rank, p in enumerate(procs):
            if rank not in got and rank not in errors:
                errors[rank] = ("no report; process exit code %s" % p.exitcode, "")
        raise RankError(errors)
    return [got[r] for r in range(world)]
