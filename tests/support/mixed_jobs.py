"""Rank functions for the mixed text/image ranks proofs (``tests/integrations/test_mixed_ranks.py``).

The cases themselves are ``accum_jobs.accumulation_cases`` with steps whose
micro-batch kinds differ across ranks (``accum_jobs.rank_kinds``).  A
collective mismatch makes gloo abort the rank process from a C++ thread
(``gloo::EnforceNotMet``, SIGABRT): nothing can be reported back, so
``with_stderr_file`` sends the rank's stderr to a file the test reads.
"""

def with_stderr_file(rank, world, directory, *args, **kwargs):
    """``per_family(rank, world, *args)`` with this rank's fd 2 in ``directory/rank<N>.err``."""
    from fsdp2_compat.tooling.mixed import stderr_to_file

    stderr_to_file(directory, rank)
    return per_family(rank, world, *args, **kwargs)


def per_family(rank, world, framework, families, cases, **kwargs):
    """``{family: accum_jobs.accumulation_cases(...)}``: every family in one pair of rank processes
    (the framework is imported once).  In ``cases``, the patches ``"user"`` are the family's catalogue
    patch and ``"user-without-mixed"`` that patch without its mixed-ranks targets."""
    from fsdp2_compat import registry
    from support import accum_jobs

    out = {}
    for family in families:
        name = registry.for_model_type(family).name
        named = {"user": [name], "user-without-mixed": ["t-%s-without-mixed" % name]}
        out[family] = accum_jobs.accumulation_cases(
            rank, world, framework, family, [(n, named.get(p, p), *rest) for n, p, *rest in cases], **kwargs)
    return out
