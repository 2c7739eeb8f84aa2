"""Rank functions for lmms-engine's own VLM forwards (``tests/integrations/test_lmms_engine_forwards.py``).

lmms-engine 0.1.4's ``use_rmpad`` forwards are installed by its own Liger monkey patch
(``fsdp2_compat_harness.engines.lmms_forwards``, which names the CUDA-only kernels' stand-ins);
the model is then sharded by its ``apply_fsdp2``.  Both run as released.
"""

def _case(rank, world, family, patches, steps, late=False):
    """One training run of ``family`` through lmms-engine's own forwards and ``apply_fsdp2``; ``late``: the
    patch is requested after lmms-engine's monkey patch assigned its forward (else before, as the bootstrap)."""
    import copy

    import fsdp2_compat
    from fsdp2_compat.fixes import media_merge, mixed_media
    from fsdp2_compat_harness import frameworks, tiny
    from fsdp2_compat_harness.engines.lmms_forwards import install_own_forwards, own_forward_of
    from fsdp2_compat_harness.scenarios import train_against_reference, wrapped_module_names
    from fsdp2_compat_harness.tiny.text import text_only

    if patches and not late:
        fsdp2_compat.apply(patches)  # before lmms-engine's monkey patch, as the bootstrap is
    frameworks.import_fsdp_utils("lmms-engine")
    restore = install_own_forwards(family)
    if patches and late:
        fsdp2_compat.apply(patches)
    try:
        model = tiny.build(family, tie=False, seed=0)
        reference = copy.deepcopy(model)
        frameworks.shard("lmms-engine", model, world, "fp32")
        result = {"wrapped": wrapped_module_names(model), "error": None, "losses": [], "loss_err": 0.0,
                  "grad_err": 0.0, "worst_grad": None, "param_err": 0.0, "grads_checked": 0,
                  "lm_head_grad_err": 0.0, "forward": own_forward_of(model)}
        dummies, merged = mixed_media.STATS["dummy_forwards"], media_merge.STATS["merged_forwards"]

        def batch(kind, seed):
            if kind == "text":
                return text_only(tiny.make_batch(family, reference, seed=seed), seed + 1000)
            return tiny.make_batch(family, reference, seed=seed, media=tuple(kind.split("+")))

        def batches_for(step):
            return [batch(steps[step][r], 1 + 10 * step + r) for r in range(world)]

        def loss_of(module, b):
            out = module(**b)
            return out.loss, out

        train_against_reference(model, reference, rank, world, result, batches_for, loss_of, steps=len(steps))
        result["dummy_forwards"] = mixed_media.STATS["dummy_forwards"] - dummies
        result["merged_forwards"] = media_merge.STATS["merged_forwards"] - merged
        if late:
            from fsdp2_compat.core import engine

            result["outcomes"] = [o.detail for _, o in engine.outcomes(patches) if "lmms_engine" in o.target.module]
        return result
    finally:
        restore()
        fsdp2_compat.revert()


def patched_then_unpatched(rank, world, directory, cases, unpatched):
    """Every patched case ``[(name, family, patches, steps[, late])]``, written to ``directory/rank<N>.json``, then the
    ``unpatched`` case (whose gloo abort ends the process); this rank's stderr in ``directory/rank<N>.err``."""
    from fsdp2_compat_harness.mixed import stderr_to_file
    from support import accum_jobs, mixed_jobs

    stderr_to_file(directory, rank)
    accum_jobs.register_test_patches()
    mixed_jobs.write_patched(directory, rank, {name: _case(rank, world, *rest) for name, *rest in cases})
    name, family, patches, steps = unpatched
    return _case(rank, world, family, patches, steps)
