"""Run a function on N CPU ranks with a real gloo process group.

``run_ranks(fn, world, *args)`` forks ``world`` processes from a forkserver
that has torch and transformers preloaded (so a rank starts in ~0.1 s instead
of several seconds), rendezvouses them through a ``file://`` store (no ports),
calls ``fn(rank, world, *args)`` in each and returns the per-rank results.
A failure on any rank raises ``RankError`` carrying every rank's traceback.

Each call gets fresh processes: no patch, process group or model state leaks
between scenarios.  ``fn`` must be importable by module and name.
"""

import multiprocessing
import os
import queue as queue_mod
import tempfile
import traceback

# Imported once in the forkserver (which skips only ImportError, so the list
# lives in a module that swallows any failure).  Patches still apply in the
# ranks: the engine patches modules that are already imported.
PRELOAD = ["fsdp2_compat.examples._preload"]

_context = None


class RankError(RuntimeError):
    """One or more ranks raised; ``errors`` maps rank -> (message, traceback)."""

    def __init__(self, errors):
        self.errors = errors
        first = min(errors)
        super().__init__(
            "rank %d failed: %s\n%s" % (first, errors[first][0], errors[first][1])
        )


def _get_context():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _rank_main(fn, rank, world, init_file, args, kwargs, results):
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
            timeout=datetime.timedelta(seconds=120),
        )
        try:
            results.put((rank, True, fn(rank, world, *args, **kwargs)))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # report every failure to the parent
        results.put((rank, False, ("%s: %s" % (type(exc).__name__, exc), traceback.format_exc())))


def run_ranks(fn, world, *args, kwargs=None, timeout=300):
    """Run ``fn(rank, world, *args, **kwargs)`` on ``world`` gloo ranks; return results by rank."""
    ctx = _get_context()
    with tempfile.TemporaryDirectory(prefix="fsdp2_compat_ranks_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        results = ctx.Queue()
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world, init_file, args, kwargs or {}, results)) for r in range(world)]
        for p in procs:
            p.start()
        got, errors = {}, {}
        try:
            for _ in range(world):
                rank, ok, value = results.get(timeout=timeout)
                (got if ok else errors)[rank] = value
                if errors:
                    break  # the other ranks may be stuck in a collective
        except queue_mod.Empty:
            errors[-1] = ("timeout after %ss" % timeout, "")
        finally:
            for p in procs:
                p.join(timeout=5 if errors else 60)
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors:
        raise RankError(errors)
    return [got[r] for r in range(world)]
