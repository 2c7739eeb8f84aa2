"""Mixed text/image micro-batches across ranks (``fsdp2-compat check``'s ``check.mixed_ranks``): rank 0 an image, rank 1 text only.

``train_mixed(rank, world, framework, family, patches, stderr_dir)`` builds a
tiny model, shards it through the framework's own entry point
(``frameworks.shard``), and trains one step against the unsharded
data-parallel reference (``scenarios.train_against_reference``) where rank 0's
batch has an image and every other rank's is text-only
(``tiny.text.text_only``).  Unpatched, the ranks issue different FSDP2
collectives: gloo aborts the rank that sees the mismatch from a C++ thread, so
nothing can be returned; this rank's stderr goes to ``stderr_dir`` and
``gloo_error`` reads the message back.  The tests run the same bug through
every framework and more families (``tests/integrations/test_mixed_ranks.py``).
"""

import os

# The trainers' own forwards that replace transformers' (lmms-engine's use_rmpad forwards: engines.lmms_forwards),
# and the family run through each; the tests run more families (tests/integrations/test_lmms_engine_forwards.py).
OWN_FORWARDS = {"lmms-engine": "qwen3_vl"}
GLOO_MISMATCH = "Received data size doesn't match expected size"
PG_TIMEOUT = 20  # seconds: the surviving rank's wait in a collective its peer never joins


def train_mixed(rank, world, framework, family, patches, stderr_dir, own_forwards=False, steps=1):
    """``own_forwards``: the framework's own forwards replace transformers' first (``OWN_FORWARDS``)."""
    import copy

    import fsdp2_compat

    from . import frameworks, tiny
    from .scenarios import first_line, import_fsdp_utils, train_against_reference, wrapped_module_names
    from .tiny.text import text_only

    stderr_to_file(stderr_dir, rank)
    if patches:
        fsdp2_compat.apply(patches)
    import_fsdp_utils(framework)
    if own_forwards:
        from .engines import lmms_forwards

        lmms_forwards.install_own_forwards(family)  # (a fresh rank process: nothing to restore)
    model = tiny.build(family, tie=False, seed=0)
    reference = copy.deepcopy(model)
    result = {"wrapped": None, "error": None, "losses": [], "loss_err": 0.0, "grad_err": 0.0, "worst_grad": None,
              "param_err": 0.0, "grads_checked": 0}
    try:
        frameworks.shard(framework, model, world)
    except Exception as exc:
        result["error"] = "%s: %s: %s" % (frameworks.entry_name(framework), type(exc).__name__, first_line(exc))
        return result
    result["wrapped"] = wrapped_module_names(model)

    def batches_for(step):
        out = []
        for r in range(world):
            batch = tiny.make_batch(family, reference, seed=1 + step * world + r)
            out.append(batch if r == 0 else text_only(batch, seed=1000 + r))
        return out

    def loss_of(module, batch):
        out = module(**batch)
        return out.loss, out

    return train_against_reference(model, reference, rank, world, result, batches_for, loss_of, steps)


def stderr_to_file(directory, rank):
    """Send this process's fds 2 and 1 to ``directory/rank<N>.err``: what gloo prints before it aborts the
    rank, and whatever the frameworks print straight to the process's stdout (AReaL's platform line), which
    must not reach the check's ``--json`` output."""
    import sys

    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            stream.flush()
    fd = os.open(os.path.join(directory, "rank%d.err" % rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.dup2(fd, 1)
    os.close(fd)


def gloo_error(stderr_dir, world):
    """The first line of any rank's stderr that carries gloo's mismatch message, or None."""
    for rank in range(world):
        path = os.path.join(stderr_dir, "rank%d.err" % rank)
        if os.path.exists(path):
            for line in open(path, encoding="utf-8", errors="replace"):
                if GLOO_MISMATCH in line:
                    return line.strip()
    return None


def gloo_verdict(result, stderr_dir, world=2):
    """``result`` of a failed run whose ranks' stderr (``stderr_dir``) carries gloo's mismatch message: its
    error becomes that message (what aborted the rank; the other rank's error is only the abort's echo)."""
    gloo = gloo_error(stderr_dir, world)
    if result.get("error") is not None and gloo is not None:
        result["error"] = "gloo: " + gloo.split("] ", 1)[-1]
    return result
