"""Rank functions for the mixed text/image ranks proofs (``tests/integrations/test_mixed_ranks.py``).

The cases themselves are ``accum_jobs.accumulation_cases`` with steps whose
micro-batch kinds differ across ranks (``accum_jobs.rank_kinds``).  A
collective mismatch makes gloo abort the rank process from a C++ thread
(``gloo::EnforceNotMet``, SIGABRT): nothing can be reported back, so
``with_stderr_file`` sends the rank's stderr to a file the test reads.
"""

import os


def with_stderr_file(rank, world, directory, *args, **kwargs):
    """``accum_jobs.accumulation_cases(rank, world, *args)`` with this rank's fd 2 in ``directory/rank<N>.err``."""
    from support import accum_jobs

    fd = os.open(os.path.join(directory, "rank%d.err" % rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    return accum_jobs.accumulation_cases(rank, world, *args, **kwargs)
