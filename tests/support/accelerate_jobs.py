"""Rank functions for accelerate's FSDP2 tail unit (tests/integrations/test_accelerate.py).

- ``reader_steps``: a model prepared by the real ``Accelerator.prepare``
  (accelerate's ``fsdp2_prepare_model``), trained with a loss that reads
  ``self.lm_head.weight`` inside the model's forward, as Liger-Kernel's fused
  linear cross-entropy forwards do (``read="raw"``) or as a custom loss that
  calls ``full_tensor()`` on a DTensor does (``read="full_tensor"``), or with
  the model's own forward (``read=None``), against the data-parallel
  reference (``scenarios.train_against_reference``);
- ``trainer_step``: one optimizer step of the real ``transformers.Trainer``
  (FSDP2 from ``TrainingArguments.fsdp``), parameters after the step against a
  reference stepped on the data-parallel gradient of the batches each rank's
  forward really got.

Both run inside ``trl_scenarios.cpu_fsdp()``, the one CPU stand-in: accelerate
selects FSDP only for GPU-like devices, so on CPU it sets the distributed type
to FSDP exactly as accelerate's GPU branch does.  Nothing of accelerate's or
transformers' preparation and training code is replaced.  The Liger-style
forward is the test's own model code (Liger needs Triton), installed on the
instance the way Liger installs its forward on the class.
"""

import copy
import tempfile
import types

from fsdp2_compat.tooling.scenarios import full_value, rel_err, train_against_reference, wrapped_module_names
from fsdp2_compat.tooling.trl_scenarios import cpu_fsdp, make_accelerator, rank_env


def _head_weight(model, read):
    from torch.distributed.tensor import DTensor

    weight = model.lm_head.weight
    if read == "full_tensor" and isinstance(weight, DTensor):
        return weight.full_tensor()  # a custom loss's "fix" of the crash: the gradient is not averaged
    return weight  # Liger-Kernel 0.8.5: ``lm_head_weight=self.lm_head.weight``


def reader_forward(read):
    """A forward that runs the base model, then the head as ``F.linear(hidden, self.lm_head.weight)``."""

    def forward(self, input_ids=None, labels=None, num_items_in_batch=None, **kwargs):
        import torch.nn.functional as F
        from transformers.modeling_outputs import CausalLMOutputWithPast

        hidden = self.model(input_ids=input_ids, **kwargs)[0]
        logits = F.linear(hidden, _head_weight(self, read))
        shift_logits, shift_labels = logits[:, :-1].float(), labels[:, 1:]
        loss = F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
                               ignore_index=-100, reduction="sum")
        count = num_items_in_batch if num_items_in_batch is not None else shift_labels.ne(-100).sum()
        return CausalLMOutputWithPast(loss=loss / count, logits=logits)

    return forward


# TRL 1.4.0-1.14.2's own forwards that read lm_head.weight after running the base model, installed on the
# instance by TRL's own function (``full_tensor()`` when the weight is a DTensor): SFT's loss_type="chunked_nll"
# and async GRPO's chunked log-probs.
TRL_READERS = ("trl_chunked_nll", "trl_chunked_logps")


def _install(model, read):
    if read == "trl_chunked_nll":
        from trl.trainer.sft_trainer import _patch_chunked_ce_lm_head

        _patch_chunked_ce_lm_head(model, chunk_size=16, is_vlm=model.config.get_text_config() is not model.config)
    elif read == "trl_chunked_logps":
        from trl.trainer.utils import patch_chunked_lm_head

        patch_chunked_lm_head(model, chunk_size=16, temperature=1.0)
    elif read is not None:
        model.forward = types.MethodType(reader_forward(read), model)
    return model


def _loss(module, batch, read):
    if read != "trl_chunked_logps":
        return module(**batch).loss
    labels = batch["labels"]  # log-probs of the real tokens where the batch has labels (the "completion")
    mask = labels.ne(-100)
    out = module(**dict(batch, labels=batch["input_ids"]), completion_mask=mask.long())
    return -(out["log_probs"] * mask[:, 1:]).sum() / mask[:, 1:].sum().clamp(min=1)


def _build(family, tie, read):
    from fsdp2_compat.tooling import tiny as tiny_models

    model = tiny_models.build(family, tie=tie, seed=0)
    reference = copy.deepcopy(model)
    return _install(model, read), _install(reference, read)


def _layout(model):
    """What preparation made of the model's end: tie, units, which modules share lm_head's unit."""
    from torch.distributed.fsdp import FSDPModule

    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    state = head._get_fsdp_state() if isinstance(head, FSDPModule) else None
    unit = sorted(name for name, m in model.named_modules()
                  if state is not None and isinstance(m, FSDPModule) and m._get_fsdp_state() is state)
    return {"tied": embed.weight is head.weight, "wrapped": wrapped_module_names(model), "head_unit": unit,
            "head_weight": type(head.weight).__name__}


def _apply(patches):
    if patches:
        from fsdp2_compat.tooling import subset

        subset.apply(patches)


def reader_cases(rank, world, cases, steps=1, lr=0.05):
    """``reader_steps`` for each ``(family, tie, read, patches)`` of ``cases`` in this rank process, in order.

    Between cases every patch is reverted and accelerate's shared state reset
    (one process pair serves every case: a rank process costs more than a case).
    """
    import fsdp2_compat
    from accelerate.state import AcceleratorState

    from fsdp2_compat.tooling import subset

    out = []
    for family, tie, read, patches in cases:
        subset.forget()
        fsdp2_compat.revert()
        AcceleratorState._reset_state(reset_partial_state=True)
        out.append(reader_steps(rank, world, family, tie, read, patches, steps=steps, lr=lr))
    subset.forget()
    fsdp2_compat.revert()
    return out


def reader_steps(rank, world, family, tie, read, patches, steps=1, lr=0.05):
    """``Accelerator.prepare`` then ``steps`` SGD steps with the ``read`` forward, against the DP reference."""
    import time

    start = time.monotonic()
    rank_env(rank, world)
    _apply(patches)
    with cpu_fsdp():
        import torch

        acc = make_accelerator()
        model, reference = _build(family, tie, read)
        model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=lr))
        result = dict(_layout(model), error=None, losses=[], loss_err=0.0, grad_err=0.0, worst_grad=None,
                      lm_head_grad_err=0.0, lm_head_rel_to_max=0.0, param_err=0.0, grads_checked=0)

        def loss_of(module, batch):
            return _loss(module, batch, read), None

        def batches_for(step):
            from fsdp2_compat.tooling import tiny as tiny_models

            return [tiny_models.make_batch(family, reference, seed=1 + step * world + r) for r in range(world)]

        result = train_against_reference(model, reference, rank, world, result, batches_for, loss_of, steps, lr)
    result["seconds"] = round(time.monotonic() - start, 2)
    return result


def trainer_step(rank, world, family, tie, read, patches, lr=0.1):
    """One optimizer step of ``transformers.Trainer`` with FSDP2; the worst parameter errors after it."""
    rank_env(rank, world)
    _apply(patches)
    with cpu_fsdp():
        return _trainer_step(rank, world, family, tie, read, lr)


def _trainer_step(rank, world, family, tie, read, lr):
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from fsdp2_compat.tooling import tiny as tiny_models

    model, reference = _build(family, tie, read)
    by_ids, seen = {}, []

    def collate(rows):
        batch = tiny_models.make_batch(family, reference, seed=int(rows[0]["idx"]), batch_size=2)
        by_ids[tuple(batch["input_ids"].reshape(-1).tolist())] = int(rows[0]["idx"])
        return batch

    def record(module, args, kwargs):  # the data loader prefetches: which batch did this forward get?
        seen.append((by_ids[tuple(kwargs["input_ids"].reshape(-1).tolist())], kwargs.get("num_items_in_batch")))

    model.register_forward_pre_hook(record, with_kwargs=True)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="fsdp2_compat_acc_"), report_to=[], use_cpu=True, max_steps=1,
        per_device_train_batch_size=1, learning_rate=lr, optim="sgd", lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, save_strategy="no", remove_unused_columns=False,
        average_tokens_across_devices=True, seed=0, fsdp="full_shard auto_wrap",
        fsdp_config={"fsdp_version": 2, "reshard_after_forward": True}, dataloader_num_workers=0,
        disable_tqdm=True, logging_steps=1,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_dict({"idx": list(range(100, 108))}),
                      data_collator=collate)
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    result = {"error": None, "distributed_type": str(trainer.accelerator.distributed_type)}
    try:
        trainer.train()
    except Exception as exc:
        result["error"] = "%s: %s" % (type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
    got = [None] * world
    dist.all_gather_object(got, seen)
    result.update(_layout(trainer.model_wrapped), rank_batches=[[i for i, _ in r] for r in got])
    if result["error"]:
        return result

    # The DP reference: every rank's batch, each loss normalised by the count the Trainer handed the forward.
    loss = sum(reference(**tiny_models.make_batch(family, reference, seed=i, batch_size=2),
                         **({"num_items_in_batch": n} if n is not None else {})).loss
               for r in got for i, n in r)
    if got[0][0][1] is None:  # no token count: the Trainer averages per-rank mean losses
        loss = loss / world
    loss.backward()
    with torch.no_grad():
        for p in reference.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    # lm_head_*: None when the head has no parameter of its own (tied: it is the embedding's, checked as that)
    result.update(lm_head_param_err=None, lm_head_step_err=None, param_err=0.0, worst_param=None,
                  num_items=[[n if n is None else int(n) for _, n in r] for r in got])
    ref = dict(reference.named_parameters())
    for name, p in trainer.model_wrapped.named_parameters():
        full = full_value(p.detach())
        err = rel_err(full, ref[name])
        if name == "lm_head.weight":
            step, ref_step = full.float() - before[name], ref[name].detach().float() - before[name]
            result["lm_head_param_err"] = err
            result["lm_head_step_err"] = float((step - ref_step).abs().max() / ref_step.abs().max().clamp_min(1e-12))
        elif err >= result["param_err"]:
            result["param_err"], result["worst_param"] = err, name
    return result
