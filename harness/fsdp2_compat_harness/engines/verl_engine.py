"""Tiny models through verl's own FSDP training engine, on CPU gloo ranks.

What runs is verl's code end to end: ``EngineRegistry.new("language_model",
"fsdp2", ...)`` builds ``FSDPEngineWithLMHead``
(``verl/workers/engine/fsdp/transformer_impl.py``); ``initialize()`` loads the
model directory with ``from_pretrained`` (rank 0's weights broadcast to the
others by ``fsdp2_load_full_state_dict``), runs ``apply_monkey_patch`` and
``apply_fsdp2`` and builds the optimizer through verl's ``build_optimizer``;
step 0 is ``forward_backward_batch`` (micro-batches with deferred gradient
sync, verl's ``sft_loss``) and ``optimizer_step`` (``fsdp2_clip_grad_norm_``),
step 1 ``train_batch``.  Batches are verl's SFT layout through verl's
``SFTTensorCollator`` (nested ``input_ids`` / ``loss_mask`` / ``position_ids``,
4-row position ids for the VLMs as verl's agent loop builds them, per-sample
``multi_modal_inputs``); every rank gets different samples of different lengths.

The reference is an unsharded copy loaded from the same directory (same class,
so the same verl forward ``apply_monkey_patch`` installed), trained with SGD on
the samples of every rank with verl's DP-average loss
(``-sum(log_prob * loss_mask) / tokens of all ranks``).

Settings (CPU, exact comparison): the CPU platform (``cpu.use_verl_cpu_platform``),
``use_remove_padding=False`` (padding-free needs flash-attn),
``attn_implementation=eager``, fp32 mixed precision (``bf16=True``: verl's
default bf16 policy, compared loosely), SGD, ``clip_grad=1e6``, no
``torch.compile``, no gradient checkpointing.

verl 0.7.x (0.7.0 is the oldest engine run here) computes in bf16 whatever
the policy: its ``FSDPEngineWithLMHead.forward_step`` hard-codes
``torch.autocast(device_type, dtype=torch.bfloat16)`` (0.7.0 and 0.7.1 as
released; 0.8 autocasts to the policy's ``param_dtype`` and skips fp32).  There the reference runs its forward
under the same autocast and ``result["autocast"]`` says so: an fp32 exact
comparison does not exist on that release, the bf16 tolerance applies
(``common.tolerance``).  verl 0.7.0 also gives ``lm_head`` no FSDP unit of its own
(0.7.1+ does): it stays in the root unit.
"""

import time

SAMPLES_PER_RANK = 4
MICRO_BATCH = 2  # two micro-batches per rank: gradient accumulation with deferred sync
LR = 0.05
MODULES = ("verl.utils.fsdp_utils", "verl.models.transformers.")
# Before this release verl's forward_step autocasts to bf16 unconditionally (see the module docstring).
POLICY_AUTOCAST = ">=0.8.0"


def unrunnable():
    """None when verl's FSDP engine can run on CPU here, else why not (imports nothing of verl)."""
    import importlib.util
    import os

    from fsdp2_compat.core import guards

    version = guards.installed_version("verl")
    spec = importlib.util.find_spec("verl")
    if version is None or spec is None or not spec.submodule_search_locations:
        return "verl is not installed"
    root = list(spec.submodule_search_locations)[0]
    if not guards.in_range(version, ">=0.7.0"):
        return "verl %s: the engine harness is written for verl 0.7+'s FSDP engine API" % version
    if not os.path.isfile(os.path.join(root, "workers", "engine", "fsdp", "transformer_impl.py")):
        return "verl %s has no verl.workers.engine.fsdp.transformer_impl" % version
    # What verl.workers.engine imports beyond verl's declared core (tf5.txt lists them).
    missing = [m for m in ("datasets", "codetiming", "PIL", "tensordict") if importlib.util.find_spec(m) is None]
    if missing:
        return "verl %s's training engine needs %s, not installed here" % (version, ", ".join(missing))
    return None


def forced_autocast():
    """The dtype verl's ``forward_step`` autocasts to whatever the policy (verl 0.7.x: bf16), else None."""
    import torch

    from fsdp2_compat.core import guards

    return None if guards.in_range(guards.installed_version("verl"), POLICY_AUTOCAST) else torch.bfloat16


def _position_ids(model, batch):
    """(4, b, s) as verl's agent loop builds them (text row on top of ``get_rope_index``), or (b, s) for text."""
    import inspect

    import torch

    text = (batch["attention_mask"].long().cumsum(-1) - 1).clamp_min(0)
    get_rope_index = getattr(getattr(model, "model", model), "get_rope_index", None)
    if get_rope_index is None:  # a text model; a VLM's text-only samples get their M-RoPE rows too
        return text
    accepted = inspect.signature(get_rope_index).parameters
    rope, _ = get_rope_index(**{k: v for k, v in batch.items() if k in accepted})
    return torch.cat([text.unsqueeze(0), rope], 0)


def make_samples(family, model, seed, text=False, media=("image",)):
    """Per-sample dicts for verl's ``SFTTensorCollator``; odd samples are two tokens shorter.

    ``text``: without their images (``tiny.text.text_only``: the text-only samples of a mixed dataset,
    same lengths and loss masks).  ``media``: the kinds each sample carries (``tiny.make_batch``).
    """
    import torch

    from fsdp2_compat_harness import tiny
    from fsdp2_compat_harness.tiny.text import text_only

    batch = tiny.make_batch(family, model, seed=seed, batch_size=SAMPLES_PER_RANK, media=media)
    labels = batch.pop("labels", None)
    if text:
        batch = text_only(batch, seed=seed)
        batch.pop("labels")
    n = batch["input_ids"].shape[1]
    lengths = [n - 2 * (i % 2) for i in range(SAMPLES_PER_RANK)]
    for i, length in enumerate(lengths):
        batch["attention_mask"][i, length:] = 0
    pos = _position_ids(model, batch)
    # The prompt: 5 text tokens and the media spans (tiny.make_batch's layout; labels mask the spans).
    prompt = 5 + (int((labels[0] == -100).sum()) if labels is not None else 0)
    rows = {k: batch[k].shape[0] // SAMPLES_PER_RANK for k in ("pixel_values", "pixel_values_videos") if k in batch}
    samples = []
    for i, length in enumerate(lengths):
        loss_mask = torch.zeros(length, dtype=torch.long)
        loss_mask[prompt:] = 1
        sample = {
            "input_ids": batch["input_ids"][i, :length].clone(),
            "loss_mask": loss_mask,
            "position_ids": (pos[:, i, :length] if pos.dim() == 3 else pos[i, :length]).clone(),
        }
        for pixels, n in rows.items():
            grid = "image_grid_thw" if pixels == "pixel_values" else "video_grid_thw"
            sample.setdefault("multi_modal_inputs", {}).update({
                pixels: batch[pixels][i * n:(i + 1) * n].clone(), grid: batch[grid][i:i + 1].clone()})
        samples.append(sample)
    return samples


def to_tensordict(samples, fused, pad_token_id):
    """verl's SFT data: ``SFTTensorCollator(NO_PADDING)`` plus the meta the engine reads."""
    from tensordict import NonTensorData

    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode, SFTTensorCollator

    data = SFTTensorCollator(DatasetPadMode.NO_PADDING)(samples)
    meta = {
        "use_remove_padding": False,
        "use_fused_kernels": fused,
        "use_dynamic_bsz": False,
        "micro_batch_size_per_gpu": MICRO_BATCH,
        "max_token_len_per_gpu": 4096,
        "temperature": 1.0,
        "pad_mode": DatasetPadMode.NO_PADDING,
        "pad_token_id": pad_token_id,
    }
    td = tu.get_tensordict(tensor_dict=data, non_tensor_dict=meta)
    tu.assign_non_tensor(td, global_token_num=NonTensorData([len(s["input_ids"]) for s in samples]))
    return td


def reference_loss(model, samples, fused, autocast=None):
    """verl's DP-average SFT loss of ``samples`` on the unsharded ``model``: (total, per-sample terms).

    ``autocast``: the dtype the forward runs under (what verl 0.7.0's engine does), or None.  Samples
    with and without images (a mixed dataset) go through separate forwards, the loss normalised by
    every sample's tokens.
    """
    import itertools

    tokens = sum(int(s["loss_mask"].sum()) for s in samples)
    terms = []
    for _, run in itertools.groupby(samples, key=lambda s: sorted(s.get("multi_modal_inputs", ()))):
        terms += _reference_terms(model, list(run), fused, autocast, tokens)
    return sum(terms), terms


def _reference_terms(model, samples, fused, autocast, tokens):
    import contextlib

    import torch

    lengths = [len(s["input_ids"]) for s in samples]
    n, b = max(lengths), len(samples)
    vlm = samples[0]["position_ids"].dim() == 2
    ids = torch.zeros(b, n, dtype=torch.long)
    att = torch.zeros(b, n, dtype=torch.long)
    pos = torch.zeros((4, b, n) if vlm else (b, n), dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, :lengths[i]] = s["input_ids"]
        att[i, :lengths[i]] = 1
        if vlm:
            pos[:, i, :lengths[i]] = s["position_ids"]
        else:
            pos[i, :lengths[i]] = s["position_ids"]
    kwargs = {"input_ids": ids, "attention_mask": att, "position_ids": pos, "use_cache": False}
    if "multi_modal_inputs" in samples[0]:
        for key in samples[0]["multi_modal_inputs"]:
            kwargs[key] = torch.cat([s["multi_modal_inputs"][key] for s in samples])
    if fused:
        kwargs.update(temperature=1.0, return_dict=True)
    with torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext():
        out = model(**kwargs)
    terms = []
    for i, s in enumerate(samples):
        length = lengths[i]
        if fused:
            lp = out.log_probs[i, :length]
        else:
            logits = out.logits[i, :length].float()
            lp = torch.log_softmax(logits, -1).gather(-1, torch.roll(s["input_ids"], -1).unsqueeze(-1)).squeeze(-1)
        mask = torch.roll(s["loss_mask"], -1).to(lp.dtype)
        mask[-1] = 0  # verl rolls the packed batch: a sample's last position meets the next one's prompt
        terms.append(-(lp * mask).sum() / tokens)
    return terms


def _engine(model_dir, fused, bf16):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    model_config = HFModelConfig(
        path=model_dir,
        use_remove_padding=False,
        use_fused_kernels=fused,
        fused_kernel_options={"impl_backend": "torch"} if fused else {},
        enable_gradient_checkpointing=False,
        override_config={"attn_implementation": "eager"},
    )
    engine_config = FSDPEngineConfig(
        strategy="fsdp2",
        forward_only=False,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=MICRO_BATCH,
        use_remove_padding=False,
        use_fused_kernels=fused,
        use_torch_compile=False,
        mixed_precision=None if bf16 else {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
    )
    optimizer_config = FSDPOptimizerConfig(optimizer="SGD", lr=LR, weight_decay=0.0, clip_grad=1e6,
                                           total_training_steps=10)
    engine = EngineRegistry.new("language_model", "fsdp2", model_config=model_config, engine_config=engine_config,
                                optimizer_config=optimizer_config, checkpoint_config=CheckpointConfig())
    return engine, model_config


def train_verl_engine(rank, world, family, model_dir, patches, fused=False, bf16=False, steps=2, mixed=False,
                      kinds=None):
    """Train ``family`` from ``model_dir`` through verl's FSDP engine on this rank; see the module docstring.

    ``patches``: how fsdp2-compat is turned on (``common.activate``).  ``mixed``: on each step one rank
    (``common.text_only_rank``) gets text-only samples, the others images (a mixed dataset).  ``kinds``:
    the media each rank's samples carry on step 0, e.g. ``(("image", "video"), ("image",))``; each later
    step hands them on to the next rank.  Returns
    ``{"error": "<where>: <type>: <message>" or None, "losses" (verl's, per step: in bf16 where it
    autocasts, so two ranks' may coincide), "reference_losses" (the reference's for this rank's samples),
    "loss_err",
    "step<k>_grad_err" / "_worst_grad" / "_lm_head_grad_err" / "_grads_checked",
    "param_err_after_step<k>", "grad_norm_err", "units", "forward",
    "engine_class", "device", "activation", "autocast", "dummy_forwards" / "merged_forwards" (fsdp2-compat's),
    "init_s", "step_s"}``;
    ``common.tolerance(result)`` is the bound its errors are held to.
    """
    import copy
    from functools import partial

    from . import common, cpu
    from fsdp2_compat.fixes import media_merge, mixed_media
    from fsdp2_compat_harness.scenarios import first_line

    start = time.perf_counter()
    result = {"family": family, "fused": fused, "bf16": bf16, "patches": patches, "error": None, "losses": [],
              "reference_losses": [], "loss_err": 0.0, "autocast": None}
    device = cpu.use_verl_cpu_platform()  # before verl.workers.engine is imported
    common.activate(patches)
    import torch

    from verl.utils.model import get_hf_auto_model_class
    from verl.workers.utils.losses import sft_loss

    cpu.register_verl_engine_for_cpu()
    autocast = forced_autocast()
    result["autocast"] = None if autocast is None else str(autocast).replace("torch.", "")
    engine, model_config = _engine(model_dir, fused, bf16)
    result.update(engine_class=type(engine).__name__, device=device)
    try:
        engine.initialize()
    except Exception as exc:
        result["error"] = "initialize: %s: %s" % (type(exc).__name__, first_line(exc))
        return result
    result["init_s"] = round(time.perf_counter() - start, 2)
    result["activation"] = common.activation_report(_modules())
    module = engine.module
    result["units"] = common.units(module)
    result["forward"] = type(module).forward.__module__
    auto = get_hf_auto_model_class(model_config.hf_config)
    reference = auto.from_pretrained(model_config.local_path, config=copy.deepcopy(model_config.hf_config),
                                     torch_dtype=torch.float32)
    reference.train()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    loss_fn = partial(sft_loss, config=None)
    dummies_before, merged_before = mixed_media.STATS["dummy_forwards"], media_merge.STATS["merged_forwards"]
    t0 = time.perf_counter()
    for step in range(steps):
        per_rank = [make_samples(family, reference, seed=1000 + step * world + r,
                                 text=mixed and r == common.text_only_rank(step, world),
                                 media=kinds[(r - step) % world] if kinds else ("image",)) for r in range(world)]
        data = to_tensordict(per_rank[rank], fused, model_config.tokenizer.pad_token_id)
        # Everything inside train_mode: verl 0.7 and 0.8 zero the gradients when it exits.
        with engine.train_mode(disable_auto_offload=True, zero_grad_on_exit=False):
            try:
                if step == 0:
                    engine.optimizer_zero_grad()
                    out = engine.forward_backward_batch(data, loss_fn, forward_only=False)
                else:
                    out = engine.train_batch(data, loss_fn)  # steps the optimizer itself; gradients kept
            except Exception as exc:
                result["error"] = "step %d: %s: %s" % (step, type(exc).__name__, first_line(exc))
                return result
            loss = sum(out["loss"]) if isinstance(out["loss"], list) else float(out["loss"])
            ref_optimizer.zero_grad()
            total, terms = reference_loss(reference, [s for samples in per_rank for s in samples], fused, autocast)
            total.backward()
            # verl reports this rank's loss times dp_size (sft_loss): the reference terms of its samples, likewise.
            mine = float(sum(terms[rank * SAMPLES_PER_RANK:(rank + 1) * SAMPLES_PER_RANK]).detach()) * world
            result["losses"].append(round(loss, 7))
            result["reference_losses"].append(mine)
            result["loss_err"] = max(result["loss_err"], abs(loss - mine) / (1 + abs(mine)))
            common.compare(module, reference, result, "step%d" % step)
            if step == 0:
                grad_norm = engine.optimizer_step()
                ref_norm = float(torch.linalg.vector_norm(torch.stack(
                    [torch.linalg.vector_norm(p.grad) for p in reference.parameters() if p.grad is not None])))
                result["grad_norm_err"] = abs(float(grad_norm) - ref_norm) / (1 + ref_norm)
        ref_optimizer.step()
        result["param_err_after_step%d" % step] = common.param_err(module, reference)
    result["step_s"] = round(time.perf_counter() - t0, 2)
    result["dummy_forwards"] = mixed_media.STATS["dummy_forwards"] - dummies_before
    result["merged_forwards"] = media_merge.STATS["merged_forwards"] - merged_before
    return result


def _modules():
    """The modules of the targets that matter in verl's engine: wrap selection and verl's model forwards."""
    import sys

    return {m for m in sys.modules if m == MODULES[0] or m.startswith(MODULES[1])}
