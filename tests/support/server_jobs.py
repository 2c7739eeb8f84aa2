"""A rank function that imports nothing (``tests/tooling/test_ranks.py``'s shared-server test runs it in
processes that never import torch themselves)."""


def server_of(rank, world):
    """The pid of the process this rank was forked from (its rank server), and a line on its stdout."""
    import os

    print("rank %d of %d speaks" % (rank, world), flush=True)
    return os.getppid()
