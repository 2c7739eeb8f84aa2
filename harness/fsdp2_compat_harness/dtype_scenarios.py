"""fp32-kept MoE routers in a bf16 model under FSDP2 (transformers >= 5.24.0), on real ranks (issue #42 item 4).

transformers 5.24.0 keeps ``mlp.gate.weight`` in fp32 for glm4_moe, glm4v_moe, deepseek_v2 and deepseek_v3
(``_keep_in_fp32_modules_strict``).  ``dtype_cases(rank, world, directory, cases)`` runs every case in one pair
of rank processes: rank 0 saves a tiny model in bf16 (``save_pretrained``), every rank loads it back through
transformers' own ``from_pretrained(path, dtype=torch.bfloat16)`` (bf16 weights, fp32 routers), and an unsharded
copy loaded the same way is the reference trained on the data-parallel average (``scenarios.
train_against_reference``, different data per rank, SGD on both).  A case is a dict:

- ``family``: ``glm4_moe`` / ``deepseek_v3`` / ``deepseek_v2`` (``tiny.moe``), ``glm4v_moe`` (its image batches);
- ``wrap``: ``"per-layer"``: torch's recipe, ``fully_shard`` on each ``_no_split_modules`` layer and then the
  root with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (the loops of verl, SkyRL, AReaL,
  LLaMA-Factory); ``"accelerate"``: accelerate's ``Accelerator.prepare`` with an FSDP2 plugin
  (``transformer_based_wrap``) and ``mixed_precision="no"`` (on CPU through the named stand-in
  ``trl_scenarios.cpu_fsdp``: accelerate selects FSDP as its GPU branch would; the preparation is its own);
- ``patches``: what ``subset.apply`` takes (None: unpatched).

A result holds whether ``fully_shard`` is the patched one where transformers' native FSDP2 imported it by name
before the patch and in ``torch.distributed.fsdp`` (``rebound``), the parameters that loaded fp32, the router
weight's dtype inside each forward (a pre-hook on every ``mlp.gate``: the unsharded parameter the router computes
with), the islands the fix sharded (``fixes.mixed_dtypes.STATS``), the error (``step 0: AssertionError: ...``
unpatched) and the comparison.
"""


CASE = {"family": "glm4_moe", "wrap": "per-layer", "patches": None}


def build(family):
    """The tiny model of ``family`` (a MoE VLM with ``tiny.moe``'s routed experts)."""
    from . import tiny
    from .tiny import moe

    return tiny.build(family, experts=True) if family in moe.VLM_EXPERT_KEYS else tiny.build(family)


def wrap(model, how, rank, world):
    """Shard ``model`` the way ``how`` names (see the module doc); returns the model to train."""
    import torch

    if how == "per-layer":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kwargs = dict(mesh=init_device_mesh("cpu", (world,)),
                      mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        layers = set(model._no_split_modules or ())
        for module in model.modules():
            if type(module).__name__ in layers:
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
        return model
    from .trl_scenarios import cpu_fsdp, make_accelerator, rank_env

    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # one process pair serves every case
    rank_env(rank, world)
    with cpu_fsdp():
        accelerator = make_accelerator(bf16=False)  # mixed_precision="no": accelerate casts nothing
        model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    return model


def dtype_cases(rank, world, directory, cases):
    """Every case in order (see the module doc); each rank writes ``directory/rank<N>.json`` after each case."""
    from .rank_cases import each_case

    return each_case(rank, world, directory, cases, CASE, dtype_case)


def dtype_case(rank, world, path, case):
    """One case on this rank (the module doc says what its result holds)."""
    import importlib

    import torch
    import torch.distributed as dist

    from fsdp2_compat.core.swaps import is_ours
    from fsdp2_compat.fixes import mixed_dtypes

    from . import subset, tiny
    from .scenarios import first_line, train_against_reference

    # a module that imported ``fully_shard`` by name before the patch (transformers' native FSDP2, 5.15.0+)
    early = importlib.import_module("transformers.distributed.fsdp")
    subset.apply(case["patches"])

    model = build(case["family"])
    cls = type(model)
    if rank == 0:
        model.to(torch.bfloat16).save_pretrained(path)
    dist.barrier()
    model = cls.from_pretrained(path, dtype=torch.bfloat16).train()
    reference = cls.from_pretrained(path, dtype=torch.bfloat16).train()
    loaded_fp32 = sorted(n for n, p in model.named_parameters() if p.dtype == torch.float32)
    router_dtypes = set()
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_pre_hook(lambda m, _: router_dtypes.add(str(m.weight.dtype).replace("torch.", "")))
    rebound = [is_ours(early.__dict__.get("fully_shard")), is_ours(torch.distributed.fsdp.fully_shard)]
    result = dict(case, error=None, loaded_fp32=loaded_fp32, rebound=rebound, losses=[], loss_err=0.0, grad_err=0.0,
                  worst_grad=None, grad_rel_to_max=0.0, worst_rel_to_max=None, param_err=0.0, grads_checked=0)
    islands_before = len(mixed_dtypes.STATS["islands"])
    try:
        model = wrap(model, case["wrap"], rank, world)
    except Exception as exc:  # the fix's refusal, or an upstream wrap-time error
        result["error"] = "wrap: %s: %s" % (type(exc).__name__, first_line(exc))
        return result
    result["islands"] = mixed_dtypes.STATS["islands"][islands_before:]

    def batches_for(step):
        return [tiny.make_batch(case["family"], reference, seed=10 + step * world + r) for r in range(world)]

    def loss_of(module, batch):
        return module(**batch).loss, None

    torch.manual_seed(0)
    result = train_against_reference(model, reference, rank, world, result, batches_for, loss_of, steps=2, lr=0.05)
    result["router_dtypes"] = sorted(router_dtypes)
    return result


def collect(cases, pg_timeout=20, timeout=300):
    """``dtype_cases`` on 2 gloo ranks: ``([per case: [rank 0 result, rank 1 result] or None], error or None)``."""
    import tempfile

    from .rank_cases import written_cases
    from .ranks import RankError, run_ranks

    with tempfile.TemporaryDirectory(prefix="f2c_dtypes_") as tmp:
        error = None
        try:
            run_ranks(dtype_cases, 2, tmp, cases, timeout=timeout, retries=0, pg_timeout=pg_timeout)
        except RankError as exc:
            error = str(exc)
        return written_cases(tmp, 2, len(cases)), error
