"""accelerate's FSDP2 tail unit on real FSDP2: a reader of ``self.lm_head.weight`` inside the model's forward.

``reader_steps(rank, world, family, tie, read, patches)`` prepares a tiny model
with the real ``Accelerator.prepare`` (accelerate's ``fsdp2_prepare_model``)
and trains it against the data-parallel reference
(``scenarios.train_against_reference``, different data per rank), with:

- ``read="raw"``: a forward that runs the base model and then
  ``F.linear(hidden, self.lm_head.weight)``, as Liger-Kernel's fused linear
  cross-entropy forwards read the head (``use_liger_kernel=True`` in the HF
  Trainer and axolotl; Liger needs Triton, so the forward is the harness's
  own), installed on the instance the way Liger installs its forward on the class;
- ``read="full_tensor"``: the same, calling ``full_tensor()`` on a DTensor
  (what a custom loss does to get past the crash); ``read="gather"``: through
  ``fsdp2_compat.gather_param``;
- ``read`` in ``TRL_READERS``: TRL 1.4.0-1.14.2's own chunked forwards,
  installed by TRL's own functions;
- ``read=None``: the model's own forward.

The result adds to ``train_against_reference``'s dict what preparation made of
the model's end (``tied``: ``embed.weight is lm_head.weight`` after preparation;
``head_unit``: the modules sharing ``lm_head``'s FSDP unit).  Runs inside
``trl_scenarios.cpu_fsdp()``, the one CPU stand-in (accelerate selects FSDP
only for GPU-like devices).  ``fsdp2-compat check`` runs it as
"accelerate reader, 2 ranks"; tests/integrations/test_accelerate.py runs every case.
"""

import copy
import types

from . import subset
from .scenarios import train_against_reference, wrapped_module_names
from .trl_scenarios import cpu_fsdp, make_accelerator, rank_env


def _head_weight(model, read):
    from torch.distributed.tensor import DTensor

    weight = model.lm_head.weight
    if read == "full_tensor" and isinstance(weight, DTensor):
        return weight.full_tensor()  # a custom loss's "fix" of the crash: the gradient is not averaged
    if read == "gather":  # the package's public API for one's own raw reads (its unit unsharded)
        import fsdp2_compat

        return fsdp2_compat.gather_param(model.lm_head)
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


def build_pair(family, tie, read):
    """``(model, reference)``: a tiny model and its unsharded copy, each with the ``read`` forward."""
    from fsdp2_compat_harness import tiny as tiny_models

    model = tiny_models.build(family, tie=tie, seed=0)
    reference = copy.deepcopy(model)
    return _install(model, read), _install(reference, read)


def head_layout(model):
    """What preparation made of the model's end: tie, units, which modules share lm_head's unit."""
    from torch.distributed.fsdp import FSDPModule

    import torch.distributed.fsdp as fsdp
    from torch.distributed.fsdp._fully_shard import fully_shard

    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    state = head._get_fsdp_state() if isinstance(head, FSDPModule) else None
    unit = sorted(name for name, m in model.named_modules()
                  if state is not None and isinstance(m, FSDPModule) and m._get_fsdp_state() is state)
    return {"tied": embed.weight is head.weight, "wrapped": wrapped_module_names(model), "head_unit": unit,
            "head_weight": type(head.weight).__name__,
            "fully_shard_restored": fsdp.fully_shard is fully_shard}  # torch's name, after a tied preparation


def reader_cases(rank, world, cases, steps=1, lr=0.05):
    """``reader_steps`` for each ``(family, tie, read, patches)`` of ``cases`` in this rank process, in order.

    Between cases every patch is reverted and accelerate's shared state reset
    (one process pair serves every case: a rank process costs more than a case).
    """
    import fsdp2_compat
    from accelerate.state import AcceleratorState

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
    subset.apply(patches)  # patch names, or exact target keys
    with cpu_fsdp():
        import torch

        acc = make_accelerator()
        model, reference = build_pair(family, tie, read)
        model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=lr))
        result = dict(head_layout(model), error=None, losses=[], loss_err=0.0, grad_err=0.0, worst_grad=None,
                      lm_head_grad_err=0.0, lm_head_rel_to_max=0.0, param_err=0.0, grads_checked=0)

        def loss_of(module, batch):
            return _loss(module, batch, read), None

        def batches_for(step):
            from fsdp2_compat_harness import tiny as tiny_models

            return [tiny_models.make_batch(family, reference, seed=1 + step * world + r) for r in range(world)]

        result = train_against_reference(model, reference, rank, world, result, batches_for, loss_of, steps, lr)
    result["seconds"] = round(time.monotonic() - start, 2)
    return result
