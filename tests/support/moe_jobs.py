"""Rank jobs for tests/integrations/test_moe_experts.py (test-only harness; never in the wheel)."""


def run(framework, family, patches, precision=None, accumulate=1, steps=2, pg_timeout=20, fn=None, checkpointing=None):
    """``moe_scenarios.train_moe`` (or ``fn``, with its arguments) on 2 gloo ranks: ``(results or None, stderr per
    rank, experts that differ)``.

    gloo aborts the rank that sees a collective mismatch, so the ranks' stderr and the experts each reached
    are read from the files ``train_moe`` writes; ``results`` is None when a rank died.
    """
    import os
    import tempfile

    from fsdp2_compat_harness import moe_scenarios
    from fsdp2_compat_harness.ranks import RankError, run_ranks

    with tempfile.TemporaryDirectory(prefix="moe_experts_") as tmp:
        try:
            kwargs = {"stderr_dir": tmp}
            if checkpointing is not None:
                kwargs["checkpointing"] = checkpointing
            results = run_ranks(fn or moe_scenarios.train_moe, 2, framework, family, patches, precision, accumulate, steps,
                                kwargs=kwargs, timeout=pg_timeout + 120, retries=0,
                                pg_timeout=pg_timeout)
        except RankError as exc:
            results, died = None, str(exc)
        else:
            died = ""
        stderr = []
        for rank in range(2):
            path = os.path.join(tmp, "rank%d.err" % rank)
            stderr.append(open(path, encoding="utf-8", errors="replace").read() if os.path.exists(path) else "")
        differ = moe_scenarios.differing_experts(moe_scenarios.read_hits(tmp, 2))
    return results, stderr + [died], differ


def train_on_older_torch_path(rank, world, *args, **kwargs):
    """``train_moe`` with ``fixes.experts`` taking the path it takes on a torch without
    ``reduce_scatter_unused_params`` (2.6-2.12): zero gradients given before ``post_backward``.
    Returns the result and whether any group's own flag was set (it must not be)."""
    from fsdp2_compat.fixes import experts
    from fsdp2_compat_harness import moe_scenarios

    marked = []
    original = experts.zero_grads_first

    def record(group):
        marked.append(group)
        return original(group)

    experts.reduce_unused = record
    result = moe_scenarios.train_moe(rank, world, *args, **kwargs)
    result["groups"] = len(marked)
    result["flag_set"] = any(getattr(g, "reduce_scatter_unused_params", False) for g in marked)
    result["zero_grads_given"] = experts.STATS["zero_grads_given"]
    return result
