"""One step of the real ``transformers.Trainer`` on FSDP2 (tests/integrations/test_accelerate.py).

``trainer_step``: FSDP2 from ``TrainingArguments.fsdp``, with the model's own
forward or a Liger-style reader of ``self.lm_head.weight``
(``tooling.accelerate_scenarios``); parameters after the step against a
reference stepped on the data-parallel gradient of the batches each rank's
forward really got.  Runs inside ``trl_scenarios.cpu_fsdp()``, the one CPU
stand-in: accelerate selects FSDP only for GPU-like devices, so on CPU it sets
the distributed type to FSDP exactly as accelerate's GPU branch does.  Nothing
of accelerate's or transformers' preparation and training code is replaced.
(The reader scenario itself, which ``fsdp2-compat check`` also runs, lives in
``fsdp2_compat_harness.accelerate_scenarios``.)
"""


import tempfile

from fsdp2_compat_harness import subset
from fsdp2_compat_harness.accelerate_scenarios import build_pair, head_layout
from fsdp2_compat_harness.scenarios import full_value, rel_err
from fsdp2_compat_harness.trl_scenarios import cpu_fsdp, rank_env


def trainer_step(rank, world, family, tie, read, patches, lr=0.1):
    """One optimizer step of ``transformers.Trainer`` with FSDP2; the worst parameter errors after it."""
    rank_env(rank, world)
    subset.apply(patches)
    with cpu_fsdp():
        return _trainer_step(rank, world, family, tie, read, lr)


def _trainer_step(rank, world, family, tie, read, lr):
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from fsdp2_compat_harness import tiny as tiny_models

    model, reference = build_pair(family, tie, read)
    by_ids, seen = {}, []

    def collate(rows):
        batch = tiny_models.make_batch(family, reference, seed=int(rows[0]["idx"]), batch_size=2)
        by_ids[tuple(batch["input_ids"].reshape(-1).tolist())] = int(rows[0]["idx"])
        return batch

    def record(module, args, kwargs):  # the data loader prefetches: which batch did this forward get?
        seen.append((by_ids[tuple(kwargs["input_ids"].reshape(-1).tolist())], kwargs.get("num_items_in_batch")))

    model.register_forward_pre_hook(record, with_kwargs=True)
    scratch = tempfile.TemporaryDirectory(prefix="fsdp2_compat_acc_")  # removed when this function returns
    args = TrainingArguments(
        output_dir=scratch.name, report_to=[], use_cpu=True, max_steps=1,
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
    result.update(head_layout(trainer.model_wrapped), rank_batches=[[i for i, _ in r] for r in got])
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
