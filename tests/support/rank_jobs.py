"""Rank functions only the tests and benchmarks run (through ``fsdp2_compat_harness.ranks``).

- ``wrap_plans``: the FSDP2 units a framework creates, unpatched and patched;
- ``glm4v_forward_errors``: verl's GLM4V forward, stock and with the glm4v patch's forward targets;
- ``lm_head_traffic``: the bytes ``lm_head`` moves in one bf16 fused step
  (``benchmarks/lm_head_gather.py``; tests assert the counts);
- ``one_rank_dies``: the last rank exits without reporting, the others keep waiting.

Importable by module name in the rank processes: ``tests/`` is on ``sys.path``
(pytest's rootdir conftest, or the benchmark's own path line).
"""

from fsdp2_compat_harness.scenarios import first_line, fused_loss, import_fsdp_utils, wrapped_module_names


def wrap_plans(rank, world, framework, families, patches):
    """Per family, the FSDP units the framework creates unpatched and patched.

    Returns ``{family: {"unpatched": [...] or "error: ...", "patched": [...],
    "auxiliary": [...]}}``; the auxiliary embeddings are the ones the fix
    keeps in the root group.
    """
    import fsdp2_compat
    from fsdp2_compat_harness import frameworks, tiny as tiny_models
    from fsdp2_compat.fixes.selection import auxiliary_embeddings

    import_fsdp_utils(framework)
    plans = {}
    for family in families:
        plan = plans[family] = {}
        for label in ("unpatched", "patched"):
            model = tiny_models.build(family)
            if label == "patched":
                fsdp2_compat.apply(patches)
            try:
                frameworks.shard(framework, model, world)
                plan[label] = wrapped_module_names(model)
            except Exception as exc:
                plan[label] = "error: %s: %s" % (type(exc).__name__, first_line(exc))
            finally:
                fsdp2_compat.revert()
        model = tiny_models.build(family)
        plan["auxiliary"] = sorted(n for n, m in model.named_modules() if m in auxiliary_embeddings(model))
        plan["layer_lookup"] = list_rule_units(model) if framework == "llamafactory" else []
    return plans


def train_families(rank, world, framework, families, patch_of, **kwargs):
    """``scenarios.train`` per family in this one process, unpatched then with ``patch_of[family]``.

    Returns ``{family: {"unpatched": result, "patched": result}}``; every patch is reverted after
    each run.  Cheaper than a fresh pair of rank processes per run (one rank: no data to differ).
    """
    import fsdp2_compat
    from fsdp2_compat_harness.scenarios import train

    out = {}
    for family in families:
        out[family] = {}
        for label, patches in (("unpatched", None), ("patched", patch_of[family])):
            try:
                out[family][label] = train(rank, world, framework, family, patches, **kwargs)
            finally:
                fsdp2_compat.revert()
    return out


def lf_call_forms(rank, world, family):
    """LLaMA-Factory's ``prepare_model`` reached by each calling convention (``tooling.conventions``: the
    engine gets the subclass whose override calls the base that way; the caller is ``engine.prepare_model(model)``,
    and ``"instance, keywords"`` is ``engine.prepare_model(model=model)``): the units, unpatched and with ``glm4v``."""
    import fsdp2_compat
    from llamafactory.v1.plugins.trainer_plugins.distributed.fsdp2 import FSDP2Engine

    from fsdp2_compat_harness import frameworks, tiny as tiny_models
    from fsdp2_compat_harness.conventions import CONVENTIONS, adopt

    engine = frameworks.llamafactory_engine(world)
    out = {}
    for form in CONVENTIONS + ("instance, keywords",):
        adopt(engine, FSDP2Engine, "prepare_model", form.partition(",")[0])
        out[form] = {}
        for label in ("unpatched", "patched"):
            if label == "patched":
                fsdp2_compat.apply("glm4v")
            try:
                model = tiny_models.build(family)
                if form.endswith("keywords"):
                    engine.prepare_model(model=model)
                else:
                    engine.prepare_model(model)
                out[form][label] = wrapped_module_names(model)
            finally:
                fsdp2_compat.revert()
    return out


def list_rule_units(model):
    """LLaMA-Factory 0.9.5: the modules of the one layer class its released ``get_transformer_layer_cls``
    picks when ``_no_split_modules`` is a list (transformers 4.x), run unpatched on a list copy."""
    from fsdp2_compat_harness.audit.plans import _unwrapped
    from llamafactory.v1.plugins.trainer_plugins.distributed import fsdp2

    names = getattr(model, "_no_split_modules", None)
    had, saved = "_no_split_modules" in model.__dict__, model.__dict__.get("_no_split_modules")
    model._no_split_modules = sorted(names) if names else names
    try:
        cls = _unwrapped(fsdp2.get_transformer_layer_cls)(model)
    finally:
        if had:
            model._no_split_modules = saved
        else:
            del model._no_split_modules
    return sorted(n for n, m in model.named_modules() if cls is not None and type(m) is cls)




def glm4v_forward_errors(rank, world, fused):
    """verl's GLM4V forward on a tiny unsharded model: stock, then with the glm4v patch's forward targets.

    ``fused``: verl's fused-kernel forward (torch backend), else its plain
    one; both go through verl's ``_get_input_embeds`` and ``process_position_ids``.
    Only the forward targets are requested (``tooling.subset``), not the
    lm_head ones.  Returns ``{"stock": error or None, "patched": error or
    None, "outcomes": {attr: outcome}, "logprob_err": max |verl patched -
    transformers' own forward| over unpadded positions, "vision_grads": every
    vision parameter got a gradient}``.
    """
    import torch

    from fsdp2_compat.core import engine
    from fsdp2_compat.integrations import verl as verl_targets
    from fsdp2_compat_harness import subset, tiny as tiny_models
    from fsdp2_compat_harness.verl_batches import glm4v_verl_batch

    model = tiny_models.build("glm4v", tie=False, seed=0).eval()
    batch = tiny_models.make_batch("glm4v", model, seed=1)
    batch.pop("labels")
    batch["attention_mask"][1, -2:] = 0  # some right padding: the masks must matter
    ids = batch["input_ids"]

    def log_probs(out):
        if getattr(out, "log_probs", None) is not None:  # verl's fused forward
            return out.log_probs
        return torch.log_softmax(out.logits.float(), -1).gather(-1, torch.roll(ids, -1, -1).unsqueeze(-1)).squeeze(-1)

    with torch.no_grad():  # transformers' own forward, before verl replaces the class's
        reference = log_probs(model(**batch, return_dict=True))
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=fused, fused_kernels_backend="torch")
    verl_batch = glm4v_verl_batch(model, batch)
    result = {"stock": None, "patched": None, "logprob_err": None, "vision_grads": False}
    try:
        model(**verl_batch, return_dict=True)
    except Exception as exc:
        result["stock"] = "%s: %s" % (type(exc).__name__, first_line(exc))
    name = subset.request([t.key for t in verl_targets.GLM4V_FORWARD])
    result["outcomes"] = {o.target.attr: o.kind for _, o in engine.outcomes([name])}
    try:
        lp = log_probs(model(**verl_batch, return_dict=True))
        mask = batch["attention_mask"].bool()
        result["logprob_err"] = float((lp.detach() - reference)[mask].abs().max())
        lp[mask].sum().backward()
        result["vision_grads"] = all(p.grad is not None for n, p in model.named_parameters() if ".visual." in n)
    except Exception as exc:
        result["patched"] = "%s: %s" % (type(exc).__name__, first_line(exc))
    return result


def lm_head_traffic(rank, world, patches):
    """Bytes ``lm_head`` moves in one bf16 fused-forward step on verl >= 0.9 (see benchmarks/lm_head_gather.py)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import fsdp2_compat
    from fsdp2_compat_harness import tiny as tiny_models

    if patches:
        fsdp2_compat.apply(patches)
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils import fsdp_utils
    from verl.utils.experimental import torch_functional

    model = tiny_models.build("qwen3_vl", tie=False, seed=0)
    lm_numel = model.lm_head.weight.numel()
    apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True, fused_kernels_backend="torch")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fsdp_utils.apply_fsdp2(model, {"mesh": mesh, "mp_policy": mp}, {})

    counts = {"all_gather_bytes": 0, "reduce_scatter_bytes": 0, "kernel_weight_bytes": 0, "error": None}
    originals = (dist.all_gather_single, dist.reduce_scatter_single, funcol.all_gather_single)

    group = model.lm_head._get_fsdp_state()._fsdp_param_group
    inside = [False]  # True while lm_head's own FSDP unit communicates

    def flagged(method):
        def run(*a, **k):
            inside[0] = True
            try:
                return method(*a, **k)
            finally:
                inside[0] = False

        return run

    model.lm_head.unshard = flagged(model.lm_head.unshard)
    group.post_backward = flagged(group.post_backward)

    def fsdp_gather(output, input, *a, **k):
        if inside[0]:
            counts["all_gather_bytes"] += output.numel() * output.element_size()
        return originals[0](output, input, *a, **k)

    def fsdp_scatter(output, input, *a, **k):
        if inside[0]:
            counts["reduce_scatter_bytes"] += input.numel() * input.element_size()
        return originals[1](output, input, *a, **k)

    def dtensor_gather(tensor, gather_dim, group, *a, **k):
        counts["all_gather_bytes"] += tensor.numel() * world * tensor.element_size()
        return originals[2](tensor, gather_dim, group, *a, **k)

    original_kernel = torch_functional.FusedLinearForPPO.forward

    def kernel(self, hidden_states, vocab_weights, *a, **k):
        counts["kernel_weight_bytes"] = max(counts["kernel_weight_bytes"], vocab_weights.numel() * vocab_weights.element_size())
        counts["kernel_weight_dtype"] = str(vocab_weights.dtype)
        return original_kernel(self, hidden_states, vocab_weights, *a, **k)

    dist.all_gather_single, dist.reduce_scatter_single, funcol.all_gather_single = fsdp_gather, fsdp_scatter, dtensor_gather
    torch_functional.FusedLinearForPPO.forward = kernel
    try:
        batch = tiny_models.make_batch("qwen3_vl", model, seed=1 + rank)
        batch.pop("labels", None)
        try:
            out = model(**batch, return_dict=True)
            fused_loss(out, batch).backward()
        except Exception as exc:
            counts["error"] = "%s: %s" % (type(exc).__name__, first_line(exc))
    finally:
        dist.all_gather_single, dist.reduce_scatter_single, funcol.all_gather_single = originals
        torch_functional.FusedLinearForPPO.forward = original_kernel
    counts["lm_head_numel"] = lm_numel
    return counts


def one_rank_dies(rank, world, seconds):
    """The last rank leaves at once without reporting (as gloo's abort does); the others wait ``seconds``.

    A barrier first: every rank's gloo group is fully connected before one leaves (a rank still connecting
    when its peer exits would fail in ``init_process_group`` and report that instead of waiting)."""
    import os
    import time

    import torch.distributed as dist

    dist.barrier()
    if rank == world - 1:
        os._exit(3)
    time.sleep(seconds)
    return rank


def gathered_both_ways(rank, world):
    """``scenarios.full_values`` against ``full_tensor()`` one by one, on DTensors of every layout it meets:
    uneven ``Shard(0)`` rows (a rank with none), two dtypes, a row vector, a ``Replicate`` DTensor, a plain
    tensor and ``None``.  Returns ``(number of tensors, [indexes whose values differ])``."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fsdp2_compat_harness.scenarios import full_values

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # every rank builds the same full tensors
    fulls = [torch.randn(5, 3), torch.randn(1, 4), torch.randn(7).to(torch.bfloat16), torch.randn(4, 2, 2),
             torch.randn(3, 3)]
    tensors = [distribute_tensor(t, mesh, [Shard(0)]) for t in fulls[:4]]
    tensors += [distribute_tensor(fulls[4], mesh, [Replicate()]), torch.ones(2), None]
    one_by_one = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in tensors]
    batched = full_values(tensors)
    differ = [i for i, (a, b) in enumerate(zip(batched, one_by_one))
              if (a is None) != (b is None) or (a is not None and (a.dtype != b.dtype or not torch.equal(a, b)))]
    return len(tensors), differ
