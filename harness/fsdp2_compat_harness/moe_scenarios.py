"""MoE experts that the ranks' tokens reach differently, trained on real FSDP2 through each framework's wrapping.

``train_moe(rank, world, framework, family, patches, ...)`` builds a tiny MoE
model (``tiny.moe``: 16 routed experts, one per token, a few dozen tokens per
micro-batch), keeps an unsharded copy as the reference, shards the model the
way ``framework`` does and trains it against the data-parallel average of
every rank's micro-batches (different tokens per rank), like
``scenarios.train_against_reference``, with:

- ``accumulate``: micro-batches per step; all but the last run with gradient
  sync deferred (``set_requires_gradient_sync(False)``, what verl's
  ``no_sync``, SkyRL's and accelerate's ``no_sync`` do for FSDP2);
- ``precision``: None (fp32), or ``"bf16"`` (bf16 parameters, fp32 reduce:
  verl's and SkyRL's default policy), compared within bf16 tolerance
  (``grad_rel_to_max``) against a reference that computes in bf16 as well
  (routing is discrete: an fp32 reference reaches other experts); one step
  is what compares there (after it the references' weights differ by rounding);
- ``hits``: per step, ``{MoE block: experts this rank's micro-batches reached}``
  (``tiny.moe.hits``), so a test can assert that the ranks' expert sets differ.

Frameworks: those of ``frameworks.shard`` (verl, SkyRL, skyrl-train, AReaL,
LLaMA-Factory: their own ``apply_fsdp2`` / engine), ``"accelerate"`` (the real
``Accelerator.prepare`` with an FSDP2 plugin, ``transformer_based_wrap``, as
the HF ``Trainer`` and TRL prepare a model; inside ``trl_scenarios.cpu_fsdp``,
the one CPU stand-in) and ``"fully_shard"`` (each ``_no_split_modules`` layer,
then the root: torch's own recipe).
"""

import copy

from .scenarios import _compare_grads, _param_err, first_line, rel_err, wrapped_module_names

FRAMEWORKS = ("verl", "skyrl", "skyrl-train", "areal", "llamafactory", "accelerate", "fully_shard")


def build(family):
    """The tiny model of ``family`` with the MoE geometry of ``tiny.moe`` (fp32, train mode)."""
    from . import tiny
    from .tiny import moe

    return tiny.build(family, experts=family in moe.VLM_EXPERT_KEYS)


def batch(family, model, seed):
    from . import tiny

    return tiny.make_batch(family, model, seed=seed)


def _fully_shard(model, world, precision):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from .frameworks import mp_policy

    kwargs = {"mesh": init_device_mesh("cpu", (world,))}
    if precision is not None:
        kwargs["mp_policy"] = mp_policy(precision)
    names = set(model._no_split_modules or ())
    for module in model.modules():
        if type(module).__name__ in names:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def shard(framework, model, world, precision=None):
    """``model`` sharded as ``framework`` does it (see the module docstring); returns the FSDP2 root."""
    if framework == "fully_shard":
        return _fully_shard(model, world, precision)
    if framework == "accelerate":
        import torch

        from .trl_scenarios import _accumulation_precisions, cpu_fsdp, make_accelerator

        bf16, policy = _accumulation_precisions()["bf16" if precision == "bf16" else "fp32"]
        with cpu_fsdp():
            accelerator = make_accelerator(bf16=bf16, mixed_precision_policy=policy)
            prepared, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
        return prepared
    from . import frameworks

    return frameworks.shard(framework, model, world, precision)


def train_moe(rank, world, framework, family, patches, precision=None, accumulate=1, steps=2, lr=0.05,
              stderr_dir=None, checkpointing=None):
    """One scenario on this rank; the result dict of ``scenarios.train_against_reference`` plus ``hits``.

    ``checkpointing``: None, ``"reentrant"`` or ``"non-reentrant"``: transformers' own
    ``gradient_checkpointing_enable`` before sharding (what verl, SkyRL, TRL and LLaMA-Factory call), the
    reference too; ``result["recomputes"]`` then counts the MoE block forwards run inside a backward.

    ``stderr_dir``: this rank's stderr goes to ``stderr_dir/rank<N>.err`` (gloo prints a collective
    mismatch there, then aborts the process) and, after every forward, the experts reached so far to
    ``rank<N>.hits.json`` (``read_hits``): what an aborted rank cannot return.
    """
    import torch

    from .trl_scenarios import rank_env

    if stderr_dir is not None:
        from .mixed import stderr_to_file

        stderr_to_file(stderr_dir, rank)

    from . import subset

    subset.apply(patches)  # patch names, or exact target keys (``-key`` drops one)
    if framework == "accelerate":
        rank_env(rank, world)
    model = build(family)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    reference = copy.deepcopy(model)
    if precision == "bf16":
        # The reference computes in bf16 too: routing is a discrete choice, and an fp32 reference would send a
        # token to another expert than the bf16 forward did.  Same ops on the same bf16 values route alike.
        reference = reference.to(torch.bfloat16)
    result = {"wrapped": None, "error": None, "losses": [], "loss_err": 0.0, "grad_err": 0.0, "worst_grad": None,
              "param_err": 0.0, "grads_checked": 0, "hits": []}
    if precision == "bf16":
        result.update(grad_rel_to_max=0.0, worst_rel_to_max=None)
    try:
        model = shard(framework, model, world, precision)
    except Exception as exc:
        result["error"] = "wrapping: %s: %s" % (type(exc).__name__, first_line(exc))
        return result
    result["wrapped"] = wrapped_module_names(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    from .tiny import moe

    if checkpointing is not None:
        result["recomputes"] = 0

        def count_recompute(_module, _args):  # a block forward inside a backward: the checkpoint's recompute
            result["recomputes"] += int(torch._C._current_graph_task_id() != -1)

        for _, block in moe.moe_blocks(model):
            block.register_forward_pre_hook(count_recompute)

    for step in range(steps):
        # every rank's micro-batches (the reference trains on all of them): different tokens per rank
        micro = [[batch(family, reference, seed=1 + (step * world + r) * accumulate + i) for i in range(accumulate)]
                 for r in range(world)]
        with moe.hits(model) as hits:
            try:
                for i, b in enumerate(micro[rank]):
                    if accumulate > 1:
                        model.set_requires_gradient_sync(i == accumulate - 1)
                    loss = model(**b).loss
                    if stderr_dir is not None:
                        _write_hits(stderr_dir, rank, result["hits"] + [hits])
                    (loss / accumulate).backward()
            except Exception as exc:
                result["error"] = "step %d: %s: %s" % (step, type(exc).__name__, first_line(exc))
            finally:  # recorded on a failing step too: which experts each rank reached is the cause
                result["hits"].append({name: sorted(seen) for name, seen in hits.items()})
        if result["error"]:
            return result
        ref_losses = [reference(**b).loss for mb in micro for b in mb]
        (sum(ref_losses) / (world * accumulate)).backward()
        result["losses"].append(float(loss))
        result["loss_err"] = max(result["loss_err"], rel_err(loss, ref_losses[(rank + 1) * accumulate - 1]))
        _compare_grads(model, reference, result)
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    result["param_err"] = _param_err(model, reference)
    return result


def _write_hits(directory, rank, hits):
    import json
    import os

    with open(os.path.join(directory, "rank%d.hits.json" % rank), "w", encoding="utf-8") as out:
        json.dump([{name: sorted(seen) for name, seen in step.items()} for step in hits], out)


def read_hits(directory, world):
    """Per rank, what ``train_moe`` wrote to ``directory`` (``{"hits": [...]}``, for ``differing_experts``)."""
    import json
    import os

    out = []
    for rank in range(world):
        path = os.path.join(directory, "rank%d.hits.json" % rank)
        out.append({"hits": json.load(open(path, encoding="utf-8")) if os.path.exists(path) else []})
    return out


def differing_experts(results):
    """``{block: [experts reached on some rank and not on another]}`` over every step of ``results`` (one per rank)."""
    out = {}
    steps = min(len(r["hits"]) for r in results)
    for step in range(steps):
        blocks = results[0]["hits"][step]
        for block in blocks:
            sets = [set(r["hits"][step][block]) for r in results]
            diff = sorted(set.union(*sets) - set.intersection(*sets))
            if diff:
                out.setdefault(block, set()).update(diff)
    return {block: sorted(v) for block, v in out.items()}
