"""TRL's loss paths on real FSDP2: accelerate's own preparation, TRL's own code, CPU gloo ranks.

``train_trl(rank, world, family, path, patches)`` builds a tiny untied model,
keeps an unsharded deep copy as the reference, prepares the model with the
real ``Accelerator.prepare`` (accelerate's ``fsdp2_prepare_model``) and runs
SGD steps where every rank gets *different* data; the reference trains on the
mean of every rank's loss (the data-parallel average), through
``scenarios.train_against_reference``.  Paths (all TRL's released code):

- ``sft``: ``SFTTrainer.compute_loss`` (default nll loss, through the forward
  ``add_fused_lm_head`` installed as ``SFTTrainer.__init__`` does) on a real
  ``SFTTrainer`` instance whose ``__init__`` is skipped (it needs a dataset and
  a processor); the attributes ``compute_loss`` reads are set as ``__init__``
  sets them.  The reference runs the same fused forward, loss written out.
- ``grpo``: the fused head installed as ``GRPOTrainer.__init__`` does
  (temperature, log-probs and entropy) and a GRPO-style clipped-ratio loss on
  its log-probs.
- ``distill``: ``DistillationTrainer.compute_loss`` -> ``_compute_loss`` ->
  ``_chunked_divergence_loss`` on a real instance (``__init__`` skipped: it
  generates completions), the teacher prepared as ``__init__`` prepares it.

``prepare_for_accumulation`` prepares a model the same way for the
gradient-accumulation proofs (``tests/support/accum_jobs``), which defer the
sync in ``accelerator.no_sync`` as transformers' ``Trainer`` does.

CPU stand-in, the only one (``cpu_fsdp``): accelerate selects
``DistributedType.FSDP`` only inside the branch of ``AcceleratorState.__init__``
for GPU-like devices; on CPU it says ``MULTI_CPU`` and drops the FSDP plugin.
``cpu_fsdp()`` wraps that ``__init__`` and, only when an FSDP plugin was
passed and the result is ``MULTI_CPU``, does what that branch does
(``distributed_type = FSDP``, the plugin's mixed precision, ``fsdp_plugin``);
it restores ``__init__`` on exit.  Nothing of TRL's or accelerate's
preparation and loss code is replaced.
"""

import contextlib
import copy
import os
import tempfile

SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")  # what SFTTrainer.__init__ asks for
COMPLETION = 6  # distillation: the last tokens of a batch are the completion


@contextlib.contextmanager
def cpu_fsdp():
    """Let accelerate select FSDP on CPU, exactly as its GPU branch would (see the module docstring)."""
    import functools

    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = __init__
    try:
        yield
    finally:
        AcceleratorState.__init__ = original


def rank_env(rank, world):
    """The variables ``accelerate launch`` sets; the gloo group itself is already up."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29599")


def make_accelerator(bf16=False, mixed_precision_policy=None):
    """``Accelerator`` with an FSDP2 plugin wrapping the ``_no_split_modules`` layers (call inside ``cpu_fsdp``).

    ``mixed_precision_policy``: given to the plugin as a user's config gives it
    (a dict of dtypes); without one, ``bf16`` makes accelerate derive the policy
    from ``mixed_precision="bf16"`` (bf16 params *and* reduce).
    """
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True,
                                            auto_wrap_policy="transformer_based_wrap",
                                            mixed_precision_policy=mixed_precision_policy)
    acc = Accelerator(cpu=True, fsdp_plugin=plugin, mixed_precision="bf16" if bf16 else "no")
    if not acc.is_fsdp2:
        raise RuntimeError("accelerate did not select FSDP2 (%s)" % acc.distributed_type)
    return acc


def _accumulation_precisions():
    import torch

    return {
        # bf16 params, fp32 reduce: the one policy where torch's deferred accumulation upcasts
        # (set on the plugin, the only way accelerate takes a reduce dtype unlike the params')
        "bf16": (True, {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32,
                        "output_dtype": torch.bfloat16}),
        "bf16-reduce": (True, None),  # accelerate's own policy for mixed_precision="bf16"
        "fp32": (False, None),  # mixed_precision="no": MixedPrecisionPolicy()
    }


ACCUMULATION_PRECISIONS = ("bf16", "bf16-reduce", "fp32")


def prepare_for_accumulation(rank, world, model, precision):
    """``model`` prepared by a fresh ``Accelerator`` (FSDP2 plugin) as TRL's trainers get it; ``(model, accelerator)``.

    ``precision``: one of ``ACCUMULATION_PRECISIONS``.  Gradient accumulation
    then goes as in transformers' ``Trainer`` training loop: every micro-batch
    but a step's last under ``accelerator.no_sync(model)``, which for FSDP2 is
    ``model.set_requires_gradient_sync(False)`` (``True`` again on exit);
    ``accelerator.accumulate`` enters the same ``no_sync``.  accelerate's shared
    state is reset first: it refuses a second ``Accelerator`` with another
    ``mixed_precision`` in one process, and several cases share the rank
    processes (the process group itself stays).
    """
    import torch
    from accelerate.state import AcceleratorState

    bf16, policy = _accumulation_precisions()[precision]
    rank_env(rank, world)
    AcceleratorState._reset_state(reset_partial_state=True)
    with cpu_fsdp():
        acc = make_accelerator(bf16, policy)
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))  # accelerate's FSDP2 needs both
    return model, acc


def grpo_loss(out, advantages, eps=0.2):
    """GRPO's clipped-ratio objective on the fused log-probs (one iteration: ratio 1, gradient kept)."""
    import torch

    mask = out.label_mask.float()
    ratio = torch.exp(out.log_probs - out.log_probs.detach())
    adv = advantages[:, None]
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def distill_inputs(batch):
    """DistillationTrainer's micro-batch layout: prompt (with any image span) + completion."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    split = ids.size(1) - COMPLETION
    inputs = {"prompt_ids": ids[:, :split], "prompt_mask": mask[:, :split],
              "completion_ids": ids[:, split:], "completion_mask": mask[:, split:]}
    inputs.update({k: batch[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids") if k in batch})
    return inputs


def _metrics():
    import collections

    return {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}


def _sft_trainer(model, acc, args):
    from trl.trainer.sft_trainer import SFTTrainer

    trainer = SFTTrainer.__new__(SFTTrainer)
    trainer.model, trainer.accelerator, trainer.args = model, acc, args
    trainer.aux_loss_enabled, trainer.compute_loss_func, trainer.label_smoother = False, None, None
    trainer._metrics, trainer._total_train_tokens, trainer._tp_size = _metrics(), 0, 1
    return trainer


def _distillation_trainer(student, acc, teacher, vlm, convention="instance"):
    import inspect

    from trl.models.utils import _ForwardRedirection
    from trl.trainer.distillation_trainer import DistillationTrainer

    from .conventions import calling

    cls = calling(DistillationTrainer, "_compute_loss", convention)  # how compute_loss reaches _compute_loss
    trainer = cls.__new__(cls)
    trainer.model, trainer.accelerator, trainer.teacher_model = student, acc, teacher
    trainer.beta, trainer.temperature = 0.5, 1.0
    trainer.model_kwarg_keys = inspect.signature(type(student).forward).parameters.keys()  # as __init__
    trainer._is_vlm = vlm
    trainer._forward_redirection = _ForwardRedirection()
    trainer._metrics = _metrics()
    return trainer


@contextlib.contextmanager
def kernel_spy(seen, recording):
    """Record ``(type, dtype)`` of the student weight reaching TRL's kernels while ``recording[0]``.

    Instrumentation only: a subclass of each kernel whose ``apply`` records and
    then calls TRL's own, bound where TRL's code looks it up; restored on exit.
    """
    from trl.trainer import distillation_trainer, utils

    def spy(base):
        class Recording(base):
            @classmethod
            def apply(cls, *args):
                if recording[0]:
                    seen.append((type(args[1]).__name__, str(args[1].dtype)))
                return base.apply(*args)

        return Recording

    kernels = ((utils, "_ChunkedLogProbFunction"), (distillation_trainer, "ChunkedDivergenceFunction"))
    originals = [getattr(m, name) for m, name in kernels]
    for (m, name), base in zip(kernels, originals):
        setattr(m, name, spy(base))
    try:
        yield
    finally:
        for (m, name), base in zip(kernels, originals):
            setattr(m, name, base)


def train_trl(rank, world, family, path, patches, bf16=False, steps=2, lr=0.05, convention="instance"):
    """One TRL path on this rank against the data-parallel reference; returns ``train_against_reference``'s dict
    plus ``head_weight`` (the type of ``lm_head.weight`` after preparation: ``DTensor`` when sharded apart) and
    ``kernel_weights`` (what reached TRL's kernel from the sharded model, see ``kernel_spy``).

    ``convention`` (``distill`` only): how ``compute_loss`` reaches ``_compute_loss``
    (``fsdp2_compat_harness.conventions``: a subclass override calling the base that way)."""
    from fsdp2_compat_harness import subset

    rank_env(rank, world)
    if patches:
        subset.apply(patches)  # patch names, or exact target keys (test_diffs' oracle)
    seen, recording = [], [False]
    with cpu_fsdp(), kernel_spy(seen, recording):
        result = _train(rank, world, family, path, bf16, steps, lr, recording, convention)
    result["kernel_weights"] = sorted(set(seen))
    return result


def _train(rank, world, family, path, bf16, steps, lr, recording, convention):
    import torch
    from trl.trainer import grpo_trainer, sft_trainer

    from fsdp2_compat_harness import tiny as tiny_models

    from .scenarios import train_against_reference, wrapped_module_names

    if path == "sft":
        from trl.trainer.sft_config import SFTConfig

        # Before the Accelerator: setting up TrainingArguments' device resets accelerate's shared state.
        # Nothing is saved there; the folder goes when this function returns (the object's finalizer).
        scratch = tempfile.TemporaryDirectory(prefix="fsdp2_compat_trl_")
        sft_args = SFTConfig(output_dir=scratch.name, report_to=[], use_cpu=True)
        sft_args.device
    acc = make_accelerator(bf16)
    model = tiny_models.build(family, tie=False, seed=0)
    reference = copy.deepcopy(model)  # before add_fused_lm_head: the installed forward is bound to its model
    for m in (model, reference):
        if path == "sft":  # through the trainer modules' by-name imports, as their __init__ calls it
            sft_trainer.add_fused_lm_head(m, outputs=SFT_OUTPUTS)
        elif path == "grpo":
            grpo_trainer.add_fused_lm_head(m, temperature=0.7, outputs=("log_probs", "entropy"))
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=lr))
    if path == "sft":
        trainer = _sft_trainer(model, acc, sft_args)
    elif path == "distill":
        teacher = acc.prepare_model(tiny_models.build(family, tie=False, seed=1), evaluation_mode=True)
        vlm = model.config.get_text_config() is not model.config
        trainers = {id(model): _distillation_trainer(model, acc, teacher, vlm, convention),
                    id(reference): _distillation_trainer(reference, acc, teacher, vlm, convention)}
    result = {
        "wrapped": wrapped_module_names(model),
        "head_weight": type(model.get_output_embeddings().weight).__name__,
        "error": None, "losses": [], "loss_err": 0.0, "grad_err": 0.0, "worst_grad": None,
        "lm_head_grad_err": 0.0, "lm_head_rel_to_max": 0.0, "param_err": 0.0,
        "grad_rel_to_max": 0.0, "worst_rel_to_max": None, "grads_checked": 0,
    }

    def loss_of(module, batch):
        recording[0] = module is model
        try:
            return _loss(module, batch)
        finally:
            recording[0] = False

    def _loss(module, batch):
        if path == "sft":
            if module is model:
                return trainer.compute_loss(module, dict(batch)), None
            out = module(**batch, fused_lm_head=True)  # SFT's default nll loss, written out
            return (-out.log_probs).sum() / out.label_mask.sum().clamp(min=1), None
        if path == "grpo":
            ids = batch["input_ids"]
            advantages = torch.linspace(-1.0, 1.0, ids.size(0)) * (1 + ids[:, 0].float() / 256)
            inputs = {k: v for k, v in batch.items() if k != "labels"}  # GRPO passes labels on their own
            return grpo_loss(module(**inputs, labels=batch["labels"], fused_lm_head=True), advantages), None
        return trainers[id(module)].compute_loss(module, distill_inputs(batch)), None

    def batches_for(step):
        return [tiny_models.make_batch(family, reference, seed=1 + step * world + r) for r in range(world)]

    return train_against_reference(model, reference, rank, world, result, batches_for, loss_of, steps, lr)
