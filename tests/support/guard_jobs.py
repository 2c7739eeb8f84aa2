"""Rank functions for the collective guard's proofs (``tests/guard/test_guard.py``).

Each scenario gives the two ranks micro-batches that make FSDP2 issue different collectives: rank 0 an image
and rank 1 text only, rank 0 an image and a video and rank 1 an image, or two ranks whose tokens reach
different MoE experts (transformers 4.x).  The model is sharded as the frameworks do it generically: one
``fully_shard`` per unit of the audit's ``fixed`` plan (layer classes, the untied input embedding), then the
root.  Unguarded, gloo aborts the rank from a C++ thread, so each rank's stderr goes to a file the test reads.
"""

CASES = {
    "text-only": ("qwen2_5_vl", ("image",), ()),  # family, rank 0's media, rank 1's media (() = text only)
    "image+video": ("qwen2_5_vl", ("image", "video"), ("image",)),
    "experts": ("qwen3_moe", None, None),  # text MoE: different tokens per rank
}


def shard(model, world, mp=None):
    """One ``fully_shard`` per unit of the audit's ``fixed`` plan, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdp2_compat_harness.audit.plans import plan_modules

    mesh = init_device_mesh("cpu", (world,))
    kwargs = {"mesh": mesh}
    if mp is not None:
        kwargs["mp_policy"] = mp
    modules = dict(model.named_modules())
    for name in plan_modules(model, "fixed"):
        fully_shard(modules[name], **kwargs)
    fully_shard(model, **kwargs)
    return model


def batch_for(case, model, rank):
    from fsdp2_compat_harness import tiny
    from fsdp2_compat_harness.tiny.text import text_only

    family, media0, media1 = CASES[case]
    if case == "experts":
        return tiny.moe.make_batch(model, seed=1 + rank)
    media = media0 if rank == 0 else media1
    if not media:
        return text_only(tiny.make_batch(family, model, seed=1 + rank), seed=1000 + rank)
    return tiny.make_batch(family, model, seed=1 + rank, media=media)


def expert_sets(model, batch):
    """``{block: sorted experts}`` this rank's batch reaches, on an unsharded copy (the model is not changed)."""
    import copy

    from fsdp2_compat_harness import tiny

    probe = copy.deepcopy(model)
    with tiny.moe.hits(probe) as seen:
        probe(**batch)
    return {name: sorted(s) for name, s in seen.items()}


def step(rank, world, directory, case, guard_on, patches=None):
    """One forward + backward of ``case`` on this rank; ``{"error", "type", "seconds", "experts", "checks"}``."""
    import time

    import fsdp2_compat
    from fsdp2_compat import guard
    from fsdp2_compat.guard import agree
    from fsdp2_compat_harness import tiny
    from fsdp2_compat_harness.mixed import stderr_to_file

    stderr_to_file(directory, rank)
    if guard_on:
        guard.install()
    if patches:
        fsdp2_compat.apply(patches)
    model = tiny.build(CASES[case][0], tie=False, seed=0)
    batch = batch_for(case, model, rank)
    experts = expert_sets(model, batch) if case == "experts" else None
    shard(model, world)
    result = {"error": None, "type": None, "experts": experts}
    start = time.monotonic()
    try:
        model(**batch).loss.backward()
    except Exception as exc:  # the guard's error is the outcome under test
        result.update(error=str(exc), type=type(exc).__name__)
    result["seconds"] = time.monotonic() - start
    result["checks"] = agree.STATS["checks"]
    return result


def accumulate(rank, world, guard_on, patch):
    """Deferred sync over a text-only and an image micro-batch on each rank (in opposite orders), bf16 params
    with an fp32 reduce, the family's patch applied (its accumulation fix wraps ``FSDPParamGroup.post_backward``):
    ``{"grads": {name: full gradient}, "checks", "wrapped"}``."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import fsdp2_compat
    from fsdp2_compat import guard
    from fsdp2_compat.guard import agree, collectives
    from fsdp2_compat_harness import tiny
    from fsdp2_compat_harness.scenarios import full_values
    from fsdp2_compat_harness.tiny.text import text_only

    if guard_on:
        guard.install()
    fsdp2_compat.apply(patch)
    family = "qwen2_5_vl"
    model = tiny.build(family, tie=False, seed=0)
    image = tiny.make_batch(family, model, seed=1 + rank)
    text = text_only(tiny.make_batch(family, model, seed=11 + rank), seed=100 + rank)
    shard(model, world, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg_mod

    wrapped = {"post_backward": type(vars(pg_mod.FSDPParamGroup)["post_backward"]).__name__,
               "foreach_reduce": bool(getattr(pg_mod.foreach_reduce, "fsdp2_compat_guard", False))}
    batches = (text, image) if rank == 0 else (image, text)
    for i, batch in enumerate(batches):
        model.set_requires_gradient_sync(i == len(batches) - 1)
        model(**batch).loss.backward()
    names = [n for n, _ in model.named_parameters()]
    grads = full_values([p.grad for _, p in model.named_parameters()])
    # numpy, not tensors: a tensor crosses the result queue as a shared file the exiting rank takes with it
    out = {"grads": {n: (g.float().numpy() if g is not None else None) for n, g in zip(names, grads)},
           "checks": agree.STATS["checks"], "wrapped": wrapped, "listeners": len(collectives.listening())}
    return out
