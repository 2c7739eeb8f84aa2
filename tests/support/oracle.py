"""The patched-source side of the ``patches/`` oracle (tests/test_diffs.py), as rank functions.

They run the *patched upstream source* (a tree first on ``PYTHONPATH``, no
runtime patch) or the installed release with the runtime patches, and report
the same facts for both: the FSDP2 units ``apply_fsdp2`` creates
(``wrap_units``) and the fused-forward losses and gradients against an
unsharded reference (``fused_lm_head``; TRL's loss paths: ``trl_case``).  ``jobs_main`` runs a JSON list of
jobs in a fresh interpreter and prints the results after ``RESULT_MARK``.
"""

import os
import sys

RESULT_MARK = "@@fsdp2-compat-jobs@@"


def _check_mode(tree, patches, modules):
    """Source mode: modules come from ``tree`` and nothing of fsdp2-compat is applied."""
    from fsdp2_compat.core import engine

    info = {"requested": list(engine.requested()), "files": {}}
    for module in modules:
        info["files"][module.__name__] = module.__file__
    if tree is not None:
        bad = [m.__name__ for m in modules if not os.path.realpath(m.__file__).startswith(os.path.realpath(tree))]
        if bad or engine.requested() or engine.active_targets():
            raise RuntimeError("not a clean patched-source run: %r, requested %r" % (bad, engine.requested()))
    return info


def wrap_units(rank, world, framework, families, tree=None, patches=None, unpatched=()):
    """Per family and tying, the FSDP2 units the framework's ``apply_fsdp2`` creates.

    ``tree``: the upstream package is imported from this patched source tree
    (checked); ``patches``: runtime patches to apply first (``"all"`` for all);
    ``unpatched``: families whose plan is also recorded before the runtime
    patches are applied (to show the comparison can tell fix from upstream).
    Returns ``{"units": {"<family>/<tie variant>": [...] or "error: ..."}, "unpatched": {...},
    "mode": {...}}`` (tie variants: ``tie_variants(family)``).
    """
    import fsdp2_compat
    from fsdp2_compat_harness import frameworks, tiny as tiny_models
    from fsdp2_compat_harness.scenarios import first_line, import_fsdp_utils, wrapped_module_names

    fsdp_utils = import_fsdp_utils(framework)

    def plan(families):
        out = {}
        for family in families:
            for tie in tie_variants(family):
                model = tiny_models.build(family, tie=_TIE_ARG[tie])
                key = "%s/%s" % (family, tie)
                try:
                    frameworks.shard(framework, model, world)
                    out[key] = wrapped_module_names(model)
                except Exception as exc:
                    out[key] = "error: %s: %s" % (type(exc).__name__, first_line(exc))
        return out

    result = {"unpatched": plan(unpatched)}
    if patches:
        fsdp2_compat.apply(None if patches == "all" else patches)
    result["mode"] = _check_mode(tree, patches, [fsdp_utils])
    result["units"] = plan(families)
    return result


# variant label -> tiny_models.build(tie=...)
_TIE_ARG = {"untied": False, "tied": True, "tied-weights-only": "weights-only"}
TIE_VARIANTS = tuple(_TIE_ARG)


def tie_variants(family):
    """The variants ``family`` can be built in here: untied only where transformers cannot tie it
    (``tiny.tieable``: e.g. Qwen2-Audio from transformers 5.10, GLM-Image)."""
    from fsdp2_compat_harness import tiny as tiny_models

    return TIE_VARIANTS if tiny_models.untieable(family) is None else ("untied",)


# verl model module -> module-level function its fused forwards call for the
# backbone (stubbed in the harness: verl's vision forwards need real-size
# checkpoints' processors), or None when they call ``self.model`` directly.
FUSED_MODULES = {
    "qwen3_vl": None,
    "glm4v": "glm4v_forward",
    "qwen2_vl": "qwen2_vl_forward",
    "dense_common": None,
    "qwen3_5": None,
}


def _text_batch(seed, batch_size=2, length=12):
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 240, (batch_size, length), generator=gen)
    mask = torch.ones(batch_size, length, dtype=torch.long)
    mask[0, -3:] = 0  # some padding, so the mask matters
    return {"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(length).expand(batch_size, -1)}


def _train_bound_forward(rank, world, model_module, steps=2, lr=0.05):
    """verl's ``<model_module>.forward_with_torch_backend`` bound to a tiny Qwen2 causal LM.

    The fused forward is installed as the model class's ``forward`` exactly as
    verl's ``patch_forward_with_backends`` does (module attribute read now, so a
    runtime patch or a patched source is what runs).  Backbones that verl calls
    through a module-level helper (GLM-4V, Qwen2-VL) are stubbed to the text
    backbone: the code under test is the read of ``lm_head.weight``.
    """
    import importlib

    module = importlib.import_module("verl.models.transformers." + model_module)
    stub = FUSED_MODULES[model_module]
    if stub is None:
        return _train_bound(rank, world, module, steps, lr)
    # The stub is undone afterwards: ``fused_lm_head`` runs verl's real GLM4V forward next.
    original = module.__dict__[stub]
    setattr(module, stub, lambda self, input_ids, **kwargs: self.model(input_ids=input_ids, **kwargs))
    try:
        return _train_bound(rank, world, module, steps, lr)
    finally:
        setattr(module, stub, original)


def _train_bound(rank, world, module, steps, lr):
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_compat_harness import tiny as tiny_models
    from fsdp2_compat_harness.scenarios import (
        first_line,
        full_value,
        fused_loss,
        rel_err,
        train_against_reference,
        wrapped_module_names,
    )
    from verl.utils import fsdp_utils

    model_module = module.__name__.rsplit(".", 1)[-1]
    base = tiny_models.build("qwen2", tie=False, seed=0)
    cls = type("Fused%s" % model_module.title().replace("_", ""), (type(base),), {"forward": module.forward_with_torch_backend})
    base.__class__ = cls
    model, reference = base, copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    fsdp_utils.apply_fsdp2(model, {"mesh": mesh}, {})
    result = {
        "wrapped": wrapped_module_names(model),
        "error": None,
        "losses": [],
        "loss_err": 0.0,
        "grad_err": 0.0,
        "worst_grad": None,
        "lm_head_grad_err": 0.0,
        "param_err": 0.0,
    }

    def loss_of(module, batch):
        out = module(**batch, return_dict=True)
        return fused_loss(out, batch), out

    def batches_for(step):
        return [_text_batch(seed=1 + step * world + r) for r in range(world)]

    train_against_reference(model, reference, rank, world, result, batches_for, loss_of, steps, lr)
    if result["error"] is not None:
        return result
    # Gradient accumulation: no reduce-scatter on the first micro-batch (as verl
    # does with several micro-batches per step), then one for both.
    micro = [[_text_batch(seed=50 + 10 * r + k) for k in range(2)] for r in range(world)]
    try:
        for k in range(2):
            model.set_requires_gradient_sync(k == 1)
            batch = micro[rank][k]
            (fused_loss(model(**batch, return_dict=True), batch) / 2).backward()
        total = sum(fused_loss(reference(**b, return_dict=True), b) for m in micro for b in m)
        (total / (2 * world)).backward()
        result["accum_grad_err"] = max(
            rel_err(full_value(p.grad), q.grad) for p, q in zip(model.parameters(), reference.parameters())
        )
    except Exception as exc:
        result["accum_error"] = "%s: %s" % (type(exc).__name__, first_line(exc))
    model.zero_grad()
    reference.zero_grad()
    # Log-probs without autograd (rollout): must work and leave lm_head resharded.
    with torch.no_grad():
        try:
            model(**_text_batch(seed=99), return_dict=True)
            from torch.distributed.tensor import DTensor

            result["no_grad_resharded"] = isinstance(model.lm_head.weight, DTensor) or not hasattr(
                model.lm_head, "reshard"
            )
        except Exception as exc:
            result["no_grad_error"] = "%s: %s" % (type(exc).__name__, first_line(exc))
    return result


def fused_lm_head(rank, world, model_modules, families=(), tree=None, patches=None, unpatched=()):
    """Fused-forward training on FSDP2 against an unsharded data-parallel reference.

    ``model_modules``: verl model modules whose ``forward_with_torch_backend``
    runs on a tiny Qwen2 (see ``_train_bound_forward``); ``families``: tiny
    families trained through verl's own ``apply_monkey_patch``
    (``scenarios.train_fused``).  ``tree`` / ``patches`` as in ``wrap_units``;
    ``unpatched``: model modules also run before the runtime patches.  Returns ``{"results": {name: result}, "unpatched": ..., "mode": ...}``.
    """
    import importlib

    import fsdp2_compat
    from fsdp2_compat_harness.scenarios import train_fused

    def run_all(model_modules, families):
        out = {}
        for name in model_modules:
            try:
                importlib.import_module("verl.models.transformers." + name)
            except ImportError as exc:  # e.g. qwen3_5 needs transformers 5
                out["module:" + name] = {"skipped": "%s: %s" % (type(exc).__name__, exc)}
                continue
            out["module:" + name] = _train_bound_forward(rank, world, name)
        for family in families:
            out["family:" + family] = train_fused(rank, world, family, None)
        return out

    result = {"unpatched": run_all(unpatched, ())}
    if patches:
        fsdp2_compat.apply(None if patches == "all" else patches)
    modules = [sys.modules["verl.models.transformers." + m] for m in model_modules
               if "verl.models.transformers." + m in sys.modules]
    modules.append(importlib.import_module("verl.utils.fsdp_utils"))
    result["mode"] = _check_mode(tree, patches, modules)
    result["results"] = run_all(model_modules, families)
    return result


TRL_MODULES = ("trl.trainer.utils", "trl.trainer.distillation_trainer",
               "trl.experimental.async_distillation.async_distillation_trainer")


def trl_case(rank, world, family, path, tree=None, patches=None):
    """One TRL loss path (``trl_scenarios.train_trl``; ``path="async"``: ``trl_jobs.async_distill_step``) on
    accelerate's FSDP2 preparation against the data-parallel reference; ``tree`` / ``patches`` as in
    ``wrap_units``.  Returns ``{"result": ..., "mode": ...}``."""
    import importlib

    from fsdp2_compat_harness.trl_scenarios import train_trl

    if path == "async":
        from support.trl_jobs import async_distill_step

        result = async_distill_step(rank, world, family, patches)
    else:
        result = train_trl(rank, world, family, path, patches)
    modules = [importlib.import_module(m) for m in TRL_MODULES]
    return {"result": result, "mode": _check_mode(tree, patches, modules)}


def run_jobs(jobs):
    """Run ``[(name, rank function name, world, args)]`` with ``run_ranks``, one after another.

    Returns ``{name: {"result": per-rank results} or {"error": message}}``; a
    failing job does not stop the others.  Run in a fresh interpreter with a
    patched tree first on ``PYTHONPATH`` for the source side of the oracle.
    """
    import time

    from fsdp2_compat_harness.ranks import run_ranks

    out = {}
    for name, fn_name, world, args in jobs:
        start = time.monotonic()
        try:
            out[name] = {"result": run_ranks(globals()[fn_name], world, *args)}
        except Exception as exc:
            out[name] = {"error": "%s: %s" % (type(exc).__name__, exc)}
        out[name]["seconds"] = round(time.monotonic() - start, 2)
    return out


def jobs_main():
    """``python -c "from support.oracle import jobs_main; jobs_main()" JOBS_JSON`` (``tests/`` on the path).

    Prints the results of ``run_jobs`` as one JSON line after ``RESULT_MARK``.
    (Not ``python -m``: rank functions must pickle by their module name.)
    """
    import json

    print(RESULT_MARK + json.dumps(run_jobs(json.loads(sys.argv[1]))))
