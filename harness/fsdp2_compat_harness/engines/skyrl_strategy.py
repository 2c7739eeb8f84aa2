"""Tiny models through SkyRL's ``FSDPStrategy`` + ``HFModelWrapper``, on CPU gloo ranks.

What runs is SkyRL's code as its FSDP policy worker drives it
(``skyrl/backends/skyrl_train/workers/fsdp/fsdp_worker.py``):
``FSDPStrategy(...)``, ``setup_distributed()``, ``HFModelWrapper(model_dir,
meta_init=...)`` (``from_pretrained`` on rank 0, meta on the others, as
``should_use_meta_init`` decides), ``strategy.prepare((model, None, None))``
(``apply_fsdp2``, ``fsdp2_load_full_state_dict``, SkyRL's AdamW and scheduler),
``HFModelWrapper.forward`` (action log-probs; the VLM path lets the model build
its M-RoPE ids), ``strategy.backward`` per micro-batch and
``strategy.optimizer_step`` (``fsdp2_clip_grad_norm_``).

The reference is an unsharded ``HFModelWrapper`` loaded from the same directory,
trained with the same AdamW hyperparameters on every rank's data with the
DP-average loss.  Every rank gets different data.

CPU stand-ins (``cpu``): SkyRL's three CUDA-only helpers, bound for the
duration of the rank and only where their code is the code the copies were
written from; ``flash_attn.bert_padding`` while ``model_wrapper`` imports; on
Python < 3.12 ``skyrl.backends`` without its ``__init__``
(``scenarios.ensure_skyrl_backends_package``).  Settings: fp32 mixed precision,
sdpa attention (SkyRL's non-flash default), AdamW lr 1e-3, ``max_grad_norm=1e6``.
"""

import importlib
import sys
import time

SAMPLES_PER_RANK = 4
MICRO_BATCH = 2
LR = 1e-3
NUM_ACTIONS = 5  # log-probs of the last 5 positions (the response)
DIST = "skyrl"


def modules():
    """(fsdp_strategy, fsdp_utils, model_wrapper) of the installed skyrl, imported (``RuntimeError`` if they cannot be)."""
    from fsdp2_compat import integrations
    from fsdp2_compat_harness.scenarios import ensure_skyrl_backends_package

    from . import cpu

    integration = integrations.get(DIST)
    [strategy_name] = integration.callers
    wrapper_name = strategy_name.replace("distributed.fsdp_strategy", "workers.model_wrapper")
    if sys.version_info < (3, 12):
        ensure_skyrl_backends_package()
    with cpu.bert_padding_during_import():
        strategy = importlib.import_module(strategy_name)
    return strategy, sys.modules[integration.wrap_module], importlib.import_module(wrapper_name)


def unrunnable():
    """None when the installed skyrl's strategy can run on CPU here (see ``cpu.SKYRL_HELPERS``), else why not.

    Reads the released ``fsdp_utils`` source; imports nothing of SkyRL.
    """
    import importlib.util
    import os

    from fsdp2_compat import integrations
    from fsdp2_compat.core import guards

    from . import cpu

    version = guards.installed_version(DIST)
    integration = integrations.get(DIST)
    spec = importlib.util.find_spec(integration.package)
    if version is None or spec is None or not spec.submodule_search_locations:
        return "skyrl is not installed"
    root = os.path.dirname(list(spec.submodule_search_locations)[0])
    path = os.path.join(root, *integration.wrap_module.split(".")) + ".py"
    missing = [m for m in ("jaxtyping", "loguru", "pydantic") if importlib.util.find_spec(m) is None]
    if missing or not os.path.isfile(path):
        return "skyrl %s's FSDPStrategy cannot be imported here (missing: %s)" % (version, ", ".join(missing) or path)
    source = open(path, encoding="utf-8").read()
    for name, known in cpu.SKYRL_HELPERS.items():
        try:
            found = guards.fingerprint_source(source, name)
        except LookupError:
            found = "absent"
        if found != known:
            return "skyrl %s: %s.%s is not the code the CPU stand-ins were written from (%s, expected %s)" % (
                version, integration.wrap_module, name, found, known)
    return None


def make_batch(family, model, seed):
    """Right-padded sequences (prompt + image span + response); odd rows two response tokens shorter."""
    from fsdp2_compat_harness import tiny

    batch = tiny.make_batch(family, model, seed=seed, batch_size=SAMPLES_PER_RANK)
    ids, att = batch["input_ids"], batch["attention_mask"]
    for i in range(SAMPLES_PER_RANK):
        att[i, ids.shape[1] - 2 * (i % 2):] = 0
        ids[i, att[i] == 0] = 0
    return {"sequences": ids, "attention_mask": att, "pixel_values": batch.get("pixel_values"),
            "image_grid_thw": batch.get("image_grid_thw")}


def _text_only(batch, seed):
    """``batch`` without its images: a text-only rank's micro-batches (same lengths and padding)."""
    from fsdp2_compat_harness.tiny.text import text_only

    plain = text_only({"input_ids": batch["sequences"]}, seed)
    ids = plain["input_ids"] * batch["attention_mask"]
    return dict(batch, sequences=ids, pixel_values=None, image_grid_thw=None)


def _micro_batches(batch):
    n = batch["sequences"].shape[0]
    per = batch["pixel_values"].shape[0] // n if batch["pixel_values"] is not None else 0
    out = []
    for k in range(n // MICRO_BATCH):
        rows = slice(k * MICRO_BATCH, (k + 1) * MICRO_BATCH)
        mb = dict(batch, sequences=batch["sequences"][rows], attention_mask=batch["attention_mask"][rows])
        if per:
            mb["pixel_values"] = batch["pixel_values"][rows.start * per:rows.stop * per]
            mb["image_grid_thw"] = batch["image_grid_thw"][rows]
        out.append(mb)
    return out


def _tokens(batch):
    return float(batch["attention_mask"][:, -NUM_ACTIONS:].sum())


def _loss(wrapper, mb, tokens):
    """Masked mean of the action log-probs over the rank's response tokens (one micro-batch's share)."""
    lp = wrapper(mb["sequences"], NUM_ACTIONS, attention_mask=mb["attention_mask"],
                 pixel_values=mb["pixel_values"], image_grid_thw=mb["image_grid_thw"])
    mask = mb["attention_mask"][:, -NUM_ACTIONS:].to(lp.dtype)
    return -(lp * mask).sum() / tokens


def _configs(model_dir):
    from skyrl.train.config import FSDPConfig, ModelConfig, OptimizerConfig
    from skyrl.train.config.config import MixedPrecisionConfig

    fsdp = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32", reduce_dtype="fp32"))
    optim = OptimizerConfig(lr=LR, weight_decay=0.0, max_grad_norm=1e6, scheduler="constant")
    return fsdp, optim, ModelConfig(path=model_dir)


def train_skyrl_strategy(rank, world, family, model_dir, patches, steps=2, mixed=False):
    """Train ``family`` from ``model_dir`` through SkyRL's FSDPStrategy on this rank; see the module docstring.

    ``patches``: as ``common.activate``.  ``mixed``: on each step one rank
    (``common.text_only_rank``) gets a text-only batch (``tiny.text.text_only``), the
    others images: a mixed dataset's micro-batches (the reference trains on the
    same batches).  Returns ``{"error", "losses", "loss_err", "grad_err",
    "worst_grad", "lm_head_grad_err", "param_err", "grad_norm_err", "units",
    "skyrl", "activation", "dummy_forwards", "init_s", "step_s"}``.
    """
    import torch
    import torch.distributed as dist

    from fsdp2_compat.core import guards
    from fsdp2_compat.fixes import mixed_media
    from fsdp2_compat_harness.scenarios import first_line

    from . import common, cpu

    start = time.perf_counter()
    result = {"family": family, "patches": patches, "error": None, "losses": [], "loss_err": 0.0,
              "grad_err": 0.0, "worst_grad": None, "lm_head_grad_err": 0.0, "skyrl": guards.installed_version(DIST)}
    common.activate(patches)
    strategy_mod, utils_mod, wrapper_mod = modules()
    result["activation"] = common.activation_report({utils_mod.__name__})
    with cpu.skyrl_cpu_helpers(strategy_mod, utils_mod):
        fsdp_config, optim_config, model_config = _configs(model_dir)
        strategy = strategy_mod.FSDPStrategy(
            fsdp_config=fsdp_config, optimizer_config=optim_config, model_config=model_config,
            fsdp_strategy="fsdp", seed=42, micro_train_batch_size_per_gpu=MICRO_BATCH, num_training_steps=10,
        )
        strategy.setup_distributed()
        meta = utils_mod.should_use_meta_init(use_meta_tensor=True, mesh=strategy.device_mesh)
        wrapped = wrapper_mod.HFModelWrapper(model_dir, use_flash_attention_2=False, bf16=False, meta_init=meta)
        reference = wrapper_mod.HFModelWrapper(model_dir, use_flash_attention_2=False, bf16=False)
        reference.train()
        try:
            model, optimizer, scheduler = strategy.prepare((wrapped, None, None))
        except Exception as exc:
            result["error"] = "prepare: %s: %s" % (type(exc).__name__, first_line(exc))
            return result
        model.train()
        result["units"] = common.units(model.model)
        result["init_s"] = round(time.perf_counter() - start, 2)
        dummies_before = mixed_media.STATS["dummy_forwards"]
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, betas=optim_config.adam_betas,
                                          weight_decay=0.0)
        t0 = time.perf_counter()
        for step in range(steps):
            batches = [make_batch(family, reference.model, seed=2000 + step * world + r) for r in range(world)]
            if mixed:
                text = common.text_only_rank(step, world)
                batches[text] = _text_only(batches[text], seed=3000 + step)
            mine = batches[rank]
            try:
                total = 0.0
                for mb in _micro_batches(mine):
                    loss = _loss(model, mb, _tokens(mine))
                    strategy.backward(loss, model, optimizer)
                    total += float(loss.detach())
            except Exception as exc:
                result["error"] = "step %d: %s: %s" % (step, type(exc).__name__, first_line(exc))
                return result
            ref_losses = [sum(_loss(reference, mb, _tokens(b)) for mb in _micro_batches(b)) for b in batches]
            (sum(ref_losses) / world).backward()
            expected = float(ref_losses[rank].detach())
            result["losses"].append(round(total, 7))
            result["loss_err"] = max(result["loss_err"], abs(total - expected) / (1 + abs(expected)))
            step_result = {}
            common.compare(model.model, reference.model, step_result, "s")
            if step_result["s_grad_err"] > result["grad_err"]:
                result["grad_err"], result["worst_grad"] = step_result["s_grad_err"], step_result["s_worst_grad"]
            result["lm_head_grad_err"] = max(result["lm_head_grad_err"], step_result["s_lm_head_grad_err"])
            result["grads_checked"] = step_result["s_grads_checked"]
            grad_norm = strategy.optimizer_step(optimizer, model, scheduler)
            ref_norm = float(torch.linalg.vector_norm(torch.stack(
                [q.grad.norm() for q in reference.parameters() if q.grad is not None])))
            result["grad_norm_err"] = max(result.get("grad_norm_err", 0.0),
                                          abs(float(grad_norm) - ref_norm) / (1 + ref_norm))
            ref_optimizer.step()
            ref_optimizer.zero_grad()
        result["param_err"] = common.param_err(model.model, reference.model)
        result["dummy_forwards"] = mixed_media.STATS["dummy_forwards"] - dummies_before
        result["step_s"] = round(time.perf_counter() - t0, 2)
        dist.barrier()
        return result
