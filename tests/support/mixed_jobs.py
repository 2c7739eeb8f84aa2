"""Rank functions for the mixed text/image ranks proofs (``tests/integrations/test_mixed_ranks.py``).

The cases themselves are ``accum_jobs.accumulation_cases`` with steps whose
micro-batch kinds differ across ranks (``accum_jobs.rank_kinds``).  A
collective mismatch makes gloo abort the rank process from a C++ thread
(``gloo::EnforceNotMet``, SIGABRT): nothing can be reported back, so
``with_stderr_file`` sends the rank's stderr to a file the test reads.
"""

# Wrapping frameworks whose generic per-layer-class fully_shard the per-release proofs use, the first installed
# one (their outcome depends on torch and transformers only).
PREFERRED = ("verl", "skyrl", "skyrl-train", "llamafactory", "areal")  # (AReaL imports slowest)


def generic_framework():
    """``(framework, None)`` or ``(None, why not)``: the first installed of ``PREFERRED`` (its own
    ``apply_fsdp2`` / ``parallelize_model`` gives every ``_no_split_modules`` class a unit), else accelerate's
    FSDP2 preparation where only TRL is installed."""
    from fsdp2_compat.core import guards

    for dist in PREFERRED:
        if guards.installed_version(dist):
            return dist, None
    if guards.installed_version("trl"):
        return "accelerate", None
    return None, "no wrapping framework (%s) and no TRL in this pinned set" % ", ".join(PREFERRED)


# accelerate's FSDP2 preparation (fsdp_transformer_layer_cls_to_wrap from _no_split_modules) refuses these
# before sharding anything, patched or not: nothing to prove there about mixed ranks.
ACCELERATE_CANNOT_WRAP = {
    "chameleon": "accelerate's FSDP2 preparation raises 'Could not find the transformer layer class "
                 "ChameleonSwinDecoderLayer in the model' (a _no_split_modules class the model builds only with "
                 "swin_norm)",
    "lfm2_vl": "accelerate's FSDP2 preparation raises 'Could not find the transformer layer class "
               "Siglip2MultiheadAttentionPoolingHead in the model' (a _no_split_modules class LFM2-VL never builds)",
}


# SkyRL's apply_fsdp2 (0.4.0) reads model.config.tie_word_embeddings, which these configs lack (5.16.1-5.24.0).
SKYRL_CANNOT_WRAP = {
    "step3p7": "SkyRL's apply_fsdp2 raises AttributeError: 'Step3p7Config' object has no attribute "
               "'tie_word_embeddings'",
}


def cannot_wrap(framework, family):
    """Why ``framework``'s own sharding refuses ``family``'s tiny model before sharding anything (None: it wraps
    it): nothing to prove there about mixed ranks."""
    return {"accelerate": ACCELERATE_CANNOT_WRAP, "skyrl": SKYRL_CANNOT_WRAP}.get(framework, {}).get(family)


def with_stderr_file(rank, world, directory, *args, **kwargs):
    """``per_family(rank, world, *args)`` with this rank's fd 2 in ``directory/rank<N>.err``."""
    from fsdp2_compat_harness.mixed import stderr_to_file

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


def root_unit_only(rank, world, directory, patches):
    """Qwen2.5-VL with one FSDP2 unit for the whole model (``fully_shard(model)``, no layer units): rank 0 an
    image, rank 1 text only, one step against the DP reference; this rank's stderr in ``directory``."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fsdp2_compat
    from fsdp2_compat.fixes import mixed_media
    from fsdp2_compat_harness import tiny
    from fsdp2_compat_harness.mixed import stderr_to_file
    from fsdp2_compat_harness.scenarios import train_against_reference, wrapped_module_names
    from fsdp2_compat_harness.tiny.text import text_only

    stderr_to_file(directory, rank)
    if patches:
        fsdp2_compat.apply(patches)
    model = tiny.build("qwen2_5_vl", tie=False, seed=0)
    reference = copy.deepcopy(model)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    result = {"wrapped": wrapped_module_names(model), "error": None, "losses": [], "loss_err": 0.0,
              "grad_err": 0.0, "worst_grad": None, "param_err": 0.0, "grads_checked": 0, "lm_head_grad_err": 0.0}
    before = mixed_media.STATS["dummy_forwards"]

    def batches_for(step):
        batches = [tiny.make_batch("qwen2_5_vl", reference, seed=1 + r) for r in range(world)]
        return [b if r == 0 else text_only(b, seed=1000 + r) for r, b in enumerate(batches)]

    def loss_of(module, batch):
        out = module(**batch)
        return out.loss, out

    torch.manual_seed(0)
    train_against_reference(model, reference, rank, world, result, batches_for, loss_of, steps=1)
    result["dummy_forwards"] = mixed_media.STATS["dummy_forwards"] - before
    return result


def patched_then_unpatched(rank, world, directory, framework, families, cases, unpatched):
    """Every family's patched ``cases`` (``per_family``), then one unpatched case, in one pair of rank processes.

    The patched results are written to ``directory/rank<N>.json`` before the unpatched case starts, because
    gloo aborts the process that sees the collective mismatch (nothing can be returned after it); this
    rank's stderr goes to ``directory/rank<N>.err`` (``with_stderr_file``).  ``unpatched``:
    ``(family, case)``, the case's patches ``"user-without-mixed"``.  Returns the unpatched result, if the
    rank lived to report it.
    """
    from fsdp2_compat_harness.mixed import stderr_to_file

    stderr_to_file(directory, rank)
    write_patched(directory, rank, per_family(rank, world, framework, families, cases))
    family, case = unpatched
    return per_family(rank, world, framework, [family], [case])[family]


def write_patched(directory, rank, results):
    """``results`` to ``directory/rank<N>.json``, before an unpatched case whose gloo abort ends the rank
    (``collect_patched_then_unpatched`` reads them back)."""
    import json
    import os

    with open(os.path.join(directory, "rank%d.json" % rank), "w", encoding="utf-8") as out:
        json.dump(results, out, default=str)


def run_patched_then_unpatched(framework, families, cases, unpatched, pg_timeout, prefix):
    """Run ``patched_then_unpatched`` on 2 gloo ranks (from the test process) and collect what it left.

    ``({family: [rank results]}, [(unpatched outcome, stderr)] per rank)``: see ``collect_patched_then_unpatched``.
    """
    patched, ranks = collect_patched_then_unpatched(
        patched_then_unpatched, (framework, families, cases, unpatched), lambda r: r["unpatched"]["error"],
        pg_timeout, prefix)
    return {f: [p[f] for p in patched] for f in families}, ranks


def collect_patched_then_unpatched(fn, args, unpatched_error, pg_timeout, prefix):
    """Run ``fn(rank, 2, directory, *args)`` on 2 gloo ranks: it writes its patched results first
    (``write_patched``), its stderr to ``directory/rank<N>.err``, then runs an unpatched case whose outcome
    ``unpatched_error(returned)`` reads.  ``([patched results per rank], [(unpatched outcome, stderr)] per
    rank)``: the patched results come from the files (the unpatched case's abort ends the ranks); a rank that
    died before writing them fails here, with every rank's outcome and stderr.
    """
    import json
    import os
    import tempfile

    from fsdp2_compat_harness.ranks import RankError, run_ranks

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        try:
            got = run_ranks(fn, 2, tmp, *args, timeout=pg_timeout + 240, retries=0, pg_timeout=pg_timeout)
            outcomes = [unpatched_error(r) for r in got]
        except RankError as exc:
            outcomes = [exc.errors.get(rank, ("reported nothing else", ""))[0] for rank in range(2)]
        patched, stderr = [], []
        for rank in range(2):
            path = os.path.join(tmp, "rank%d.json" % rank)
            patched.append(json.load(open(path, encoding="utf-8")) if os.path.exists(path) else None)
            path = os.path.join(tmp, "rank%d.err" % rank)
            stderr.append(open(path, encoding="utf-8", errors="replace").read() if os.path.exists(path) else "")
    assert None not in patched, "a rank died before its patched results were written: %s %s" % (outcomes, stderr)
    return patched, list(zip(outcomes, stderr))


def strategy_with_stderr_file(rank, world, directory, *args, **kwargs):
    """``tooling.engines.skyrl_strategy.train_skyrl_strategy`` with this rank's fd 2 in ``directory/rank<N>.err``
    (gloo prints the collective mismatch there before it aborts the rank)."""
    from fsdp2_compat_harness.engines import skyrl_strategy
    from fsdp2_compat_harness.mixed import stderr_to_file

    stderr_to_file(directory, rank)
    return skyrl_strategy.train_skyrl_strategy(rank, world, *args, **kwargs)


def verl_engine_with_stderr_file(rank, world, directory, *args, **kwargs):
    """``verl_engine.train_verl_engine(rank, world, *args)`` with this rank's fd 2 in ``directory/rank<N>.err``."""
    from fsdp2_compat_harness.engines import verl_engine
    from fsdp2_compat_harness.mixed import stderr_to_file

    stderr_to_file(directory, rank)
    return verl_engine.train_verl_engine(rank, world, *args, **kwargs)
