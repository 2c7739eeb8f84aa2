"""The rank server: the forkserver ``run_ranks`` forks its ranks from, shared where it can be.

``multiprocessing``'s forkserver imports ``PRELOAD`` once (torch, transformers,
each installed framework: ~10 s of CPU on a small machine) and forks every
rank from that state.  By default each process that calls ``run_ranks``
starts its own.  A test run has several such processes (pytest's workers, the
child that runs ``fsdp2-compat check``), so ``share()`` lets the first one
publish its server's address in ``ENV``; a process started after that, with
the variable in its environment, forks its ranks from the same server
(``context()``) instead of paying for the preload again.

The contract:
- only the address is shared: each client sends its own pipes, so a rank's
  result, exit code and ``kill`` work as with a server of its own, and every
  call still gets fresh processes;
- a rank inherits the server's environment and file descriptors, not its
  client's: ``share()`` points the server's stdout and stderr at
  ``os.devnull`` (a test that reads what a rank prints redirects it itself,
  ``fsdp2_compat_harness.mixed.stderr_to_file``), and a process whose ranks must import
  other code than the sharer's (a patched source tree first on
  ``PYTHONPATH``) drops ``ENV`` from its children's environment;
- it rests on two private attributes of ``multiprocessing.forkserver`` (the
  server's address, the client's end of its "alive" pipe), checked against
  the exact layout of this Python's ``ForkServer``: with any other layout, or
  once the address is gone, a process starts its own server, as before.
"""

import multiprocessing
import os
import sys

# Imported once in the server (which skips only ImportError, so the list lives
# in a module that swallows any failure).  Patches still apply in the ranks:
# the engine patches modules that are already imported.
PRELOAD = ["fsdp2_compat_harness._preload"]

# The address of a shared server (a Unix socket path); F2C_, not FSDP2_COMPAT_: it is not a user setting.
ENV = "F2C_RANK_SERVER"

# The instance attributes of ``multiprocessing.forkserver.ForkServer`` in CPython 3.9-3.12.  Another layout
# (3.13 adds an authentication key) is neither shared nor joined.
_LAYOUT = frozenset(("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_inherited_fds", "_lock",
                     "_preload_modules"))

_context = None
_joined = None  # the address this process forks its ranks from, when it is another process's server


def context():
    """The ``forkserver`` context ``run_ranks`` uses: joined to the server ``ENV`` names if it can be, else one of
    this process's own (started on the first rank, with ``PRELOAD``)."""
    global _context, _joined
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        address = os.environ.get(ENV)
        if _join(address):
            _joined = address
        else:
            ctx.set_forkserver_preload(PRELOAD)
        _context = ctx
    return _context


def _server():
    """This process's ``ForkServer``, or None when its layout is not the one this module knows."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    return server if server is not None and set(vars(server)) == _LAYOUT else None


def _join(address):
    if not address or not os.path.exists(address):
        return False
    server = _server()
    if server is None or server._forkserver_pid is not None or server._forkserver_address is not None:
        return False  # this process already has a server of its own
    from multiprocessing import resource_tracker

    read, alive = os.pipe()  # the ranks hold this end as the server's "alive" pipe; its owner holds the real one
    os.close(read)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive
    # The server runs already and is not this process's child (ForkServer.ensure_running would wait on it as one):
    # only this process's resource tracker, which every client needs, is started here.
    server.ensure_running = resource_tracker.ensure_running
    return True


def share():
    """Start this process's rank server now and publish its address in ``ENV`` for every process started after.

    Returns the address, or None where this Python's forkserver cannot be shared (then nothing changes).
    The server preloads in the background: the first rank waits for it, this call does not.
    """
    context()
    if _joined is not None:
        return _joined  # already another process's server: its address is published
    server = _server()
    if server is None:
        return None
    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = (os.dup(1), os.dup(2))
    try:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        server.ensure_running()  # the server (and this process's resource tracker) start with fds 1 and 2 quiet
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (devnull,) + saved:
            os.close(fd)
    address = server._forkserver_address
    if not isinstance(address, str):  # an abstract socket (no path): it cannot travel in the environment
        return None
    os.environ[ENV] = address
    return address
