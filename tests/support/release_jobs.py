"""When the gathered lm_head unit is released in backward (``benchmarks/lm_head_release.py``; tests assert it).

``lm_head_release(rank, world, early)``: tiny untied Qwen3-VL through verl's
own fused forward (``apply_monkey_patch(use_fused_kernels=True)``, torch
backend) and ``apply_fsdp2`` with the ``qwen3vl`` patch, bf16 params / fp32
reduce; a ``no_grad`` forward (rollout log-probs), then one optimizer step
of two micro-batches with an image each, the first with sync deferred.
``early=False`` runs the same with ``fsdp2_compat.fixes.gather``'s early
release switched off (its hook never armed): the behaviour before it, where
FSDP's root post-backward callback releases the unit after the whole
backward.  Recorded per micro-batch, on this rank:

- ``events``: FSDP units' ``pre_backward`` / ``post_backward`` and the
  collectives (all-gather, reduce-scatter, all-reduce, attributed to the unit
  whose unshard / post-backward issued them), in order;
- ``layers_while_unsharded`` / ``blocks_while_unsharded``: decoder layers /
  vision blocks whose backward starts while the lm_head unit is unsharded;
- ``held``: the most lm_head bytes held at such a start (unsharded weight,
  its gradient, the reduce-dtype accumulated gradient);

and ``grads`` (the final sharded gradients, gathered), ``early_releases``,
``resharded_after_no_grad``, ``pending_after_no_grad``.

``real_size(family)``: the real-size lm_head and the number of decoder layers
and vision blocks (meta device, ``support.real_size``), for the bytes a rank
holds through their backward.

The instruments are instance attributes on FSDP's own objects (spies that
call the original), never changes of the code under test.
"""

from fsdp2_compat_harness.scenarios import full_value, fused_loss


def _lm_head_bytes(group):
    held = {"weight": 0, "grad": 0, "accumulated_grad": 0}
    for fp in group.fsdp_params:
        param = getattr(fp, "_unsharded_param", None)
        if param is None:
            continue
        if group.is_unsharded:
            held["weight"] += param.numel() * param.element_size()
        if param.grad is not None:
            held["grad"] += param.grad.numel() * param.grad.element_size()
        if fp.unsharded_accumulated_grad is not None:
            acc = fp.unsharded_accumulated_grad
            held["accumulated_grad"] += acc.numel() * acc.element_size()
    return held


def _unit_groups(model):
    """``[(unit name, FSDPParamGroup)]`` of every FSDP2 unit of ``model``."""
    from torch.distributed.fsdp import FSDPModule

    from fsdp2_compat.fixes.gather import _groups

    return [(name or "<root>", g) for name, m in model.named_modules() if isinstance(m, FSDPModule)
            for g in _groups(m._get_fsdp_state())]


def lm_head_release(rank, world, early=True):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import fsdp2_compat
    from fsdp2_compat.fixes import gather
    from fsdp2_compat_harness import tiny

    fsdp2_compat.apply("qwen3vl")
    if not early:
        gather._release_when_complete = lambda group, fsdp_param: None  # before the change: never armed
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils import fsdp_utils

    model = tiny.build("qwen3_vl", tie=False, seed=0)
    apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True, fused_kernels_backend="torch")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fsdp_utils.apply_fsdp2(model, {"mesh": mesh, "mp_policy": mp}, {})
    units = _unit_groups(model)
    lm_group = dict(units)["lm_head"]
    out = {"micro_batches": [], "early_releases": 0}
    stack, current = [], [None]  # the unit issuing collectives now; the micro-batch record

    def spy_pre_backward(name, group, original):
        def pre_backward(*a, **k):
            mb = current[0]
            if mb is not None and group._training_state.name != "PRE_BACKWARD":
                mb["events"].append(("pre_backward", name))
                kind = "layers" if ".layers." in name else "blocks" if ".blocks." in name else None
                if kind:
                    if lm_group.is_unsharded:
                        mb["%s_while_unsharded" % kind].append(name)
                    held = _lm_head_bytes(lm_group)
                    mb["held"] = {k: max(v, held[k]) for k, v in mb["held"].items()}
            return original(*a, **k)

        return pre_backward

    def spy_issuer(name, method, label):
        def call(*a, **k):
            if current[0] is not None and label:
                current[0]["events"].append((label, name))
            stack.append(name)
            try:
                return method(*a, **k)
            finally:
                stack.pop()

        return call

    for name, group in units:
        group.pre_backward = spy_pre_backward(name, group, group.pre_backward)
        group.post_backward = spy_issuer(name, group.post_backward, "post_backward")
        group.unshard = spy_issuer(name, group.unshard, None)
    originals = {op: getattr(dist, op) for op in ("all_gather_single", "reduce_scatter_single", "all_reduce")}

    def spy_collective(op):
        def call(*a, **k):
            if current[0] is not None:
                current[0]["events"].append((op, stack[-1] if stack else "?"))
            return originals[op](*a, **k)

        return call

    for op in originals:
        setattr(dist, op, spy_collective(op))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        before = gather.STATS["early_releases"]
        rollout = tiny.make_batch("qwen3_vl", model, seed=99 + rank)
        rollout.pop("labels", None)
        with torch.no_grad():
            model(**rollout, return_dict=True)
        out["resharded_after_no_grad"] = lm_group.is_sharded
        out["pending_after_no_grad"] = len(gather._PENDING)
        n = 2
        for i in range(n):
            model.set_requires_gradient_sync(i == n - 1)
            batch = tiny.make_batch("qwen3_vl", model, seed=1 + 10 * i + rank)
            batch.pop("labels", None)
            loss = fused_loss(model(**batch, return_dict=True), batch) / n
            mb = {"sync": i == n - 1, "events": [], "layers_while_unsharded": [], "blocks_while_unsharded": [],
                  "held": {"weight": 0, "grad": 0, "accumulated_grad": 0}}
            current[0] = mb
            try:
                loss.backward()
            finally:
                current[0] = None
            mb["lm_head_sharded_after"] = lm_group.is_sharded
            out["micro_batches"].append(mb)
        out["grads"] = {name: full_value(p.grad).detach().float().numpy().copy() for name, p in model.named_parameters()}
        optimizer.step()
    finally:
        for op, fn in originals.items():
            setattr(dist, op, fn)
        model.set_requires_gradient_sync(True)
    out["early_releases"] = gather.STATS["early_releases"] - before
    out["layers"] = sorted(n for n, _ in units if ".layers." in n)
    out["blocks"] = sorted(n for n, _ in units if ".blocks." in n)
    out["lm_head_numel"] = model.lm_head.weight.numel()
    return out


def first(events, op, pred):
    """Index of the first ``(op, unit)`` event whose unit satisfies ``pred`` (None if none)."""
    return next((i for i, (o, unit) in enumerate(events) if o == op and pred(unit)), None)


def real_size(family):
    """``{"lm_head": (rows, cols), "numel", "layers", "blocks"}`` of the real-size model (meta device)."""
    import torch
    import transformers

    from fsdp2_compat_harness.tiny.configs import CLASSES
    from support.real_size import real_size_config

    config = real_size_config(family)
    with torch.device("meta"):
        model = getattr(transformers, CLASSES[family][0])(config)
    head = model.lm_head.weight
    text = getattr(config, "text_config", config)
    return {"lm_head": tuple(head.shape), "numel": head.numel(), "layers": text.num_hidden_layers,
            "blocks": config.vision_config.depth}
