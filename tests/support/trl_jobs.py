"""Rank functions for the TRL proofs that ``fsdp2-compat check`` does not run (tests/integrations/test_trl.py).

- ``sft_train_step``: one optimizer step of the real ``SFTTrainer.train()``
  (FSDP2 through ``TrainingArguments.fsdp``), parameters after the step
  against a reference stepped on the data-parallel average gradient;
- ``async_distill_step``: the real ``AsyncDistillationTrainer.compute_loss``
  (``_compute_loss``, chunked JSD against a sparse teacher top-k) on an
  accelerate-prepared student, gradients against the reference.

Both run inside ``trl_scenarios.cpu_fsdp()``, the one CPU stand-in (accelerate
selects FSDP only for GPU-like devices); nothing of TRL is replaced.
"""

import copy
import tempfile

from fsdp2_compat_harness.scenarios import full_value, rel_err, train_against_reference, wrapped_module_names
from fsdp2_compat_harness.trl_scenarios import SFT_OUTPUTS, cpu_fsdp, make_accelerator, rank_env


def cannot_show_the_bug():
    """Why the installed TRL / accelerate cannot run the TRL proofs on CPU (None when they can): one owner
    for the two test modules that run them (test_trl.py, test_conventions_trl.py)."""
    from fsdp2_compat.core import guards

    trl, accelerate = guards.installed_version("trl"), guards.installed_version("accelerate")
    if not guards.in_range(trl, ">=1.16.0"):
        return "trl %s: the fused head runs on CPU from 1.16.0 (1.15.0 needs Triton)" % trl
    if not guards.in_range(accelerate, ">=1.14.0"):
        return "accelerate %s keeps lm_head in the root unit (the tail unit is 1.14.0+)" % accelerate
    return None


def _rel_to_max(actual, expected):
    actual, expected = actual.detach().float(), expected.detach().float()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12))


def _word_tokenizer():
    """A local WordLevel tokenizer (no downloads) the trainer accepts as ``processing_class``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{"t%d" % i: i for i in range(3, 256)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def sft_train_step(rank, world, family, patches, bf16=False, accum=1, lr=0.1):
    """One optimizer step of ``SFTTrainer.train()``; returns the worst parameter errors after it.

    The data loader prefetches, so a forward pre-hook records which batch each
    rank's training forward really got; the reference then takes one SGD step
    on the DP-average gradient of exactly those batches (SFT's default nll loss,
    normalised as ``Trainer`` + ``SFTTrainer.compute_loss`` do).
    """
    from fsdp2_compat_harness import subset

    rank_env(rank, world)
    subset.apply(patches)  # patch names, or exact target keys (tests/integrations/test_accelerate.py)
    with cpu_fsdp():
        return _sft_train_step(rank, world, family, bf16, accum, lr)


def _sft_train_step(rank, world, family, bf16, accum, lr):
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer
    from trl.trainer.utils import add_fused_lm_head

    from fsdp2_compat_harness import tiny as tiny_models

    model = tiny_models.build(family, tie=False, seed=0)
    reference = copy.deepcopy(model)
    by_ids, seen = {}, []

    def collate(rows):
        batch = tiny_models.make_batch(family, reference, seed=int(rows[0]["idx"]), batch_size=2)
        by_ids[tuple(batch["input_ids"].reshape(-1).tolist())] = int(rows[0]["idx"])
        return batch

    def record(module, args, kwargs):
        seen.append(by_ids[tuple(kwargs["input_ids"].reshape(-1).tolist())])

    model.register_forward_pre_hook(record, with_kwargs=True)
    scratch = tempfile.TemporaryDirectory(prefix="fsdp2_compat_trl_")  # removed when this function returns
    args = SFTConfig(
        output_dir=scratch.name, report_to=[], use_cpu=True, max_steps=1,
        per_device_train_batch_size=1, gradient_accumulation_steps=int(accum), learning_rate=lr, optim="sgd",
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, logging_steps=1,
        save_strategy="no", remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True},
        bf16=bf16, seed=0, fsdp="full_shard auto_wrap",
        fsdp_config={"fsdp_version": 2, "reshard_after_forward": True}, dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"idx": list(range(100, 108))}),
                         processing_class=_word_tokenizer(), data_collator=collate)
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    trainer.train()
    got = [None] * world
    dist.all_gather_object(got, seen)

    add_fused_lm_head(reference, outputs=SFT_OUTPUTS)
    batches = [tiny_models.make_batch(family, reference, seed=i, batch_size=2) for r in got for i in r]
    outs = [reference(**b, fused_lm_head=True) for b in batches]
    if trainer.model_accepts_loss_kwargs:  # num_items_in_batch: every rank's label count, x processes, averaged
        # counted as the installed Trainer counts: transformers 5.24 counts the predicted labels (labels[..., 1:])
        # when the model's loss shifts them (Trainer._loss_shifts_labels); 5.8 counts every label
        shifted = getattr(trainer, "_loss_shifts_labels", False)
        count = sum(int((b["labels"][..., 1:] if shifted else b["labels"]).ne(-100).sum()) for b in batches)
        loss = sum((-o.log_probs).sum() for o in outs) / count
    else:
        loss = sum((-o.log_probs).sum() / o.label_mask.sum() for o in outs) / len(outs)
    loss.backward()
    with torch.no_grad():
        for p in reference.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    sharded = trainer.model_wrapped
    result = {"wrapped": wrapped_module_names(sharded), "distributed_type": str(trainer.accelerator.distributed_type),
              "rank_batches": got, "lm_head_param_err": 0.0, "lm_head_step_err": 0.0, "param_err": 0.0,
              "worst_param": None, "train_loss": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    ref = dict(reference.named_parameters())
    for name, p in sharded.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")  # SFTConfig turns gradient checkpointing on
        full = full_value(p.detach())
        err = rel_err(full, ref[name])
        if name == "lm_head.weight":
            # The step itself, relative to the reference step's largest entry: 1.0 means "as big as the step".
            step = _rel_to_max(full.float() - before[name], ref[name].float() - before[name])
            result["lm_head_param_err"], result["lm_head_step_err"] = err, step
        elif err >= result["param_err"]:
            result["param_err"], result["worst_param"] = err, name
    return result


def _async_batch(seed, vocab, length=12, completion=6, k=4):
    """One padding-free row with a sparse teacher top-k, in the layout AsyncDistillationTrainer's collator makes."""
    import torch

    gen = torch.Generator().manual_seed(int(seed))
    ids = torch.randint(3, 240, (1, length), generator=gen)
    topk = torch.randint(3, vocab, (1, length, k), generator=gen)
    return {
        "input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(length)[None],
        "completion_mask": torch.cat([torch.zeros(1, length - completion), torch.ones(1, completion)], 1).long(),
        "teacher_topk_ids": topk,
        "teacher_topk_logprobs": torch.log_softmax(torch.randn(1, length, k, generator=gen), -1) - 0.1,
    }


def _async_trainer(model, acc, convention):
    import collections
    import types

    from trl.experimental.async_distillation.async_distillation_trainer import AsyncDistillationTrainer
    from trl.models.utils import _ForwardRedirection

    from fsdp2_compat_harness.conventions import calling

    cls = calling(AsyncDistillationTrainer, "_compute_loss", convention)  # how compute_loss reaches _compute_loss
    t = cls.__new__(cls)  # __init__ starts rollout workers
    t.model, t.accelerator, t._forward_redirection = model, acc, _ForwardRedirection()
    t.args = types.SimpleNamespace(beta=0.5, teacher_temperature=1.0, add_tail_bucket=True)
    t._teacher_ids, t.current_gradient_accumulation_steps = ["teacher"], 1
    t._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    t._step_forward_tokens = t._step_trained_tokens = t._step_seq_len_weighted = 0.0
    t._step_samples = t._step_forward_s = 0.0
    return t


def async_distill_step(rank, world, family, patches, steps=2, lr=0.05, convention="instance"):
    """``AsyncDistillationTrainer.compute_loss`` on an accelerate-prepared student vs the DP-average reference.

    ``convention``: how ``compute_loss`` reaches ``_compute_loss`` (``tooling.conventions``)."""
    from fsdp2_compat_harness import subset

    rank_env(rank, world)
    if patches:
        subset.apply(patches)  # patch names, or exact target keys (test_diffs' oracle)
    with cpu_fsdp():
        return _async_distill_step(rank, world, family, steps, lr, convention)


def _async_distill_step(rank, world, family, steps, lr, convention):
    import torch

    from fsdp2_compat_harness import tiny as tiny_models

    acc = make_accelerator()
    model = tiny_models.build(family, tie=False, seed=0)
    reference = copy.deepcopy(model)
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=lr))
    vocab = model.config.get_text_config().vocab_size
    completion = 6
    global_tokens = world * completion  # the collator's count of every rank's completion tokens
    trainers = {id(model): _async_trainer(model, acc, convention), id(reference): _async_trainer(reference, acc, convention)}
    result = {"wrapped": wrapped_module_names(model), "head_weight": type(model.get_output_embeddings().weight).__name__,
              "error": None, "losses": [], "loss_err": 0.0, "grad_err": 0.0, "worst_grad": None,
              "lm_head_grad_err": 0.0, "lm_head_rel_to_max": 0.0, "param_err": 0.0, "grads_checked": 0}

    def loss_of(module, batch):
        n = batch["input_ids"].size(1)
        inputs = dict(batch, global_n_tokens=torch.tensor([float(global_tokens)]),
                      global_n_forward_tokens=torch.tensor([float(n * world)]), mean_seq_len=torch.tensor([float(n)]))
        return trainers[id(module)].compute_loss(module, inputs), None

    def batches_for(step):
        return [_async_batch(1 + step * world + r, vocab, completion=completion) for r in range(world)]

    return train_against_reference(model, reference, rank, world, result, batches_for, loss_of, steps, lr)
