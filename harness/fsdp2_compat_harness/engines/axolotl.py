"""axolotl's LoRA kernels and KD trainer on its own FSDP2 preparation, 2 CPU gloo ranks.

Used by ``fsdp2-compat check`` (its "axolotl ..." rows: ``check.axolotl``) and by
``tests/integrations/test_axolotl.py``, which runs more cases (other wraps, an
evaluation pass, per-group verdicts).

``kd_cases(rank, world, cases)``: for each ``(family, wrap, patches, evaluate)``
a tiny untied model is prepared by axolotl's ``fsdp2_prepare_model`` under the
real ``Accelerator.prepare`` (``KD_WRAPS``: the plugin's wrap policy and
``reshard_after_forward``) and trained with ``AxolotlKDTrainer.compute_loss``
as released, on a teacher top-k batch per rank, against the unsharded
reference through the same method (its ``_kd_loss_fn`` built as ``__init__``
builds it; see ``kd_trainer``).

``dora_cases(rank, world, cases)``: for each ``(family, patches)`` a tiny text
model becomes a PEFT DoRA model (every attention and MLP projection and the
input embedding), axolotl's own ``patch_self_attn_lora`` and
``apply_lora_kernel_patches`` install its fused QKV / O / embedding kernels
(``lora_mlp_kernel`` is off: its SwiGLU is a Triton kernel, CUDA only, so the
MLP runs PEFT's own DoRA forward), axolotl's ``patch_accelerate_fsdp2`` puts
its ``fsdp2_prepare_model`` into ``accelerate.accelerator`` and the real
``Accelerator.prepare`` shards the model with it (``lora_A`` / ``lora_B`` /
``lora_magnitude_vector[adapter]`` units of their own, the whole LoRA embedding
one unit).  The unsharded reference gets the same PEFT model and kernels and
trains on the mean of every rank's loss (``scenarios.train_against_reference``,
different data per rank).  The result adds, per kind of adapter parameter
(``GROUPS``), the worst gradient error over the steps.

Runs inside ``trl_scenarios.cpu_fsdp()``, the one CPU stand-in (accelerate
selects FSDP only for GPU-like devices).  axolotl's ``utils/callbacks/__init__``
imports evaluate, wandb, datasets and trl, which the pinned set does not
install; ``axolotl.utils.callbacks`` is then registered without running that
``__init__`` so that ``callbacks/models.py`` (transformers only, imported by
``monkeypatch.lora_kernels``) loads as released.  Nothing of axolotl's, PEFT's
or accelerate's code is replaced; the attention class forward axolotl rewrites
and the ``fsdp2_prepare_model`` it installs are restored after each case.
"""

import copy
import tempfile

from .. import subset
from ..scenarios import first_line, full_values, rel_err, train_against_reference
from ..trl_scenarios import cpu_fsdp, make_accelerator, rank_env

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"]
# Adapter parameters by kind: the kernels read the first two groups' magnitudes with plain full_tensor().
GROUPS = {
    "attn_magnitude": lambda n: "lora_magnitude_vector" in n and any(p in n for p in ("q_proj", "k_proj", "v_proj",
                                                                                      "o_proj")),
    "mlp_magnitude": lambda n: "lora_magnitude_vector" in n and any(p in n for p in ("gate_proj", "up_proj",
                                                                                     "down_proj")),
    "embed_magnitude": lambda n: "lora_magnitude_vector" in n and "embed_tokens" in n,
    "lora_ab": lambda n: ".lora_A." in n or ".lora_B." in n,
    "embed_ab": lambda n: "lora_embedding_A" in n or "lora_embedding_B" in n,
}
CALLBACK_DEPS = ("evaluate", "wandb", "datasets", "trl", "pandas", "numpy", "yaml", "tqdm")


def import_axolotl():
    """``(kernels.lora, monkeypatch.lora_kernels, monkeypatch.accelerate.fsdp2, utils.dict)`` as released."""
    import importlib

    from ..frameworks import package_without_init

    package_without_init("axolotl.utils.callbacks", CALLBACK_DEPS)
    lora = importlib.import_module("axolotl.kernels.lora")
    kernels = importlib.import_module("axolotl.monkeypatch.lora_kernels")
    fsdp2 = importlib.import_module("axolotl.monkeypatch.accelerate.fsdp2")
    ddict = importlib.import_module("axolotl.utils.dict")
    return lora, kernels, fsdp2, ddict


def _dora(model, seed=0):
    import peft
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, bias="none", use_dora=True, task_type="CAUSAL_LM",
                                 target_modules=TARGET_MODULES, init_lora_weights="gaussian")
        model = peft.get_peft_model(model, config)
        for name, p in model.named_parameters():  # DoRA's magnitude starts at ||W||: move it so its gradient differs
            if "lora_magnitude_vector" in name or "lora_embedding_B" in name:
                p.data.add_(0.1 * torch.randn_like(p))
    return model


def build_pair(family, base_dir):
    """``(model, reference, restore)``: the same DoRA model twice, each with axolotl's kernels installed;
    ``restore()`` puts back the attention class forward axolotl rewrote."""
    from .. import tiny as tiny_models

    _, kernels, _, ddict = import_axolotl()
    base = tiny_models.build(family, tie=False, seed=0)
    base.config.save_pretrained(base_dir)  # axolotl finds the attention class from cfg.base_model's config
    model = _dora(base)
    reference = copy.deepcopy(model)
    cfg = ddict.DictDefault(base_model=base_dir, lora_qkv_kernel=True, lora_o_kernel=True, lora_mlp_kernel=False,
                            lora_embedding_kernel=True)
    attention_cls = kernels.get_attention_cls_from_config(cfg)
    forward = vars(attention_cls)["forward"]

    def restore():
        attention_cls.forward = forward
        if "_original_forward" in vars(attention_cls):  # axolotl's "already patched" mark (the source text)
            del attention_cls._original_forward

    kernels.patch_self_attn_lora(cfg)  # the attention class forward calls self.apply_qkv / self.apply_o
    try:
        for m in (model, reference):
            kernels.apply_lora_kernel_patches(m, cfg)
    except BaseException:
        restore()
        raise
    return model, reference, restore


def _group_errors(model, reference, result):
    """Append this step's worst gradient error per ``GROUPS`` kind to ``result["by_step"]`` and fold it into
    ``result[kind]`` (step 0 compares gradients of identical parameters: later steps inherit earlier errors)."""
    named = list(model.named_parameters())
    grads = full_values([p.grad for _, p in named])
    step = {g: 0.0 for g in GROUPS}
    for (name, _), grad, q in zip(named, grads, reference.parameters()):
        for group, member in GROUPS.items():
            if member(name) and q.grad is not None:
                step[group] = max(step[group], rel_err(grad, q.grad))
                if not result["by_step"]:
                    result["counts"][group] = result["counts"].get(group, 0) + 1
    result["by_step"].append(step)
    for group, err in step.items():
        result[group] = max(result[group], err)


def dora_steps(rank, world, family, patches, steps=2, lr=0.05):
    """One case: axolotl's preparation and kernels, ``steps`` SGD steps against the DP reference."""
    import accelerate.accelerator
    import torch

    rank_env(rank, world)
    subset.apply(patches)
    _, _, fsdp2, _ = import_axolotl()
    prepare = accelerate.accelerator.fsdp2_prepare_model
    with tempfile.TemporaryDirectory(prefix="fsdp2_compat_axolotl_") as base_dir, cpu_fsdp():
        model, reference, restore = build_pair(family, base_dir)
        try:
            fsdp2.patch_accelerate_fsdp2()  # axolotl's: accelerate.accelerator.fsdp2_prepare_model = its own
            acc = make_accelerator()
            model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=lr))
            result = {"error": None, "losses": [], "loss_err": 0.0, "grad_err": 0.0, "worst_grad": None,
                      "param_err": 0.0, "grads_checked": 0, "counts": {}, "by_step": [],
                      "prepared_by": prepare_model_module(),
                      "units": _adapter_units(model)}
            result.update({g: 0.0 for g in GROUPS})

            def loss_of(module, batch):
                return module(**batch).loss, None

            def batches_for(step):
                from .. import tiny as tiny_models

                return [tiny_models.make_batch(family, reference, seed=1 + step * world + r) for r in range(world)]

            def compare(_out, _ref_out):
                _group_errors(model, reference, result)

            result = train_against_reference(model, reference, rank, world, result, batches_for, loss_of, steps, lr,
                                             compare=compare)
        finally:
            accelerate.accelerator.fsdp2_prepare_model = prepare
            restore()
    return result


def prepare_model_module():
    import accelerate.accelerator

    return accelerate.accelerator.fsdp2_prepare_model.__module__


def _adapter_units(model):
    """The kinds of adapter module that are FSDP2 units of their own (``lora_A``, ``lora_magnitude_vector``...)."""
    from torch.distributed.fsdp import FSDPModule

    kinds = set()
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            parts = name.split(".")
            kinds.update(p for p in parts[-2:-1] if p.startswith("lora_"))
            if hasattr(m, "lora_embedding_A"):
                kinds.add("lora_embedding_layer")
    return sorted(kinds)


def dora_cases(rank, world, cases, steps=2):
    """``dora_steps`` for each ``(family, patches)`` of ``cases``, in this rank process, reverting in between."""
    import fsdp2_compat
    from accelerate.state import AcceleratorState

    out = []
    for family, patches in cases:
        subset.forget()
        fsdp2_compat.revert()
        AcceleratorState._reset_state(reset_partial_state=True)
        out.append(dora_steps(rank, world, family, patches, steps=steps))
    subset.forget()
    fsdp2_compat.revert()
    return out


# --- the KD trainer: AxolotlKDTrainer.compute_loss reads lm_head.weight after the forward -------------------------

KD_TOP_K = 4
# The AxolotlKDTrainer arguments (kd_ce_alpha, kd_alpha, kd_temperature, kd_beta, kd_normalize_topk) of the case.
KD_ARGS = {"kd_ce_alpha": 0.3, "kd_alpha": 0.7, "kd_temperature": 1.0, "kd_beta": 0.0, "kd_normalize_topk": True}
# How axolotl's fsdp_config.auto_wrap_policy reaches accelerate's plugin: "transformer" (TRANSFORMER_BASED_WRAP, the
# decoder layers: lm_head stays in the root unit) or "size" (SIZE_BASED_WRAP with min_num_params below the tiny
# model's embedding and head, as 1e8 is below an 8B model's: every layer, the embedding and lm_head a unit each).
KD_WRAPS = {"reshard": {"auto_wrap_policy": "transformer_based_wrap", "reshard_after_forward": True},
            "keep_root": {"auto_wrap_policy": "transformer_based_wrap", "reshard_after_forward": False},
            "size": {"auto_wrap_policy": "size_based_wrap", "min_num_params": 5000, "reshard_after_forward": True}}


def import_kd():
    """``(integrations.kd.trainer, integrations.kd.kernels.liger)`` as released (they import trl, liger-kernel,
    datasets and numba through ``core.trainers.base``: set tf516)."""
    import importlib

    return (importlib.import_module("axolotl.integrations.kd.trainer"),
            importlib.import_module("axolotl.integrations.kd.kernels.liger"))


def kd_trainer():
    """An ``AxolotlKDTrainer`` holding what its ``compute_loss`` reads: ``_kd_loss_fn``, built as its ``__init__``
    builds it from ``KD_ARGS`` (the HF Trainer's ``__init__`` is not run: it would build a second Accelerator).

    ``compiled=False``, the loss's own option: its default compiles liger's chunk loop with inductor, which runs
    on CPU but takes ~16 s per process (the values are the same: measured)."""
    trainer_mod, liger = import_kd()
    trainer = trainer_mod.AxolotlKDTrainer.__new__(trainer_mod.AxolotlKDTrainer)
    trainer._kd_loss_fn = liger.LigerFusedLinearKLTopKLogprobLoss(
        KD_ARGS["kd_ce_alpha"], KD_ARGS["kd_alpha"], KD_ARGS["kd_temperature"], KD_ARGS["kd_beta"] or 0.0,
        compute_ce_loss=bool(KD_ARGS["kd_ce_alpha"]), normalize_topk=KD_ARGS["kd_normalize_topk"], compiled=False)
    return trainer


def kd_batch(family, model, seed):
    """A tiny batch plus a teacher's top-``KD_TOP_K`` log-probabilities per position (what axolotl's KD collator
    adds: ``target_token_ids`` / ``target_logprobs`` / ``target_mask``), deterministic in ``seed``."""
    import torch

    from .. import tiny as tiny_models

    batch = tiny_models.make_batch(family, model, seed=seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    rows, length = batch["input_ids"].shape
    vocab = model.config.get_text_config().vocab_size
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:KD_TOP_K] for _ in range(rows * length)])
    batch["target_token_ids"] = ids.view(rows, length, KD_TOP_K)
    batch["target_logprobs"] = torch.log_softmax(torch.randn(rows, length, KD_TOP_K, generator=gen), dim=-1)
    mask = torch.ones(rows, length, KD_TOP_K, dtype=torch.long)
    mask[:, :2] = 0  # the prompt's first positions carry no teacher targets
    batch["target_mask"] = mask
    return batch


def kd_steps(rank, world, family, wrap, patches, steps=2, lr=0.05, evaluate=False):
    """One case: a tiny untied model prepared by axolotl's ``fsdp2_prepare_model`` (``wrap``: ``KD_WRAPS``),
    trained with ``AxolotlKDTrainer.compute_loss`` against the unsharded reference through the same method.

    ``evaluate``: before each step's training loss, the same ``compute_loss`` under ``no_grad`` (as the HF
    Trainer's ``prediction_step`` runs it); its loss is folded into ``eval_err`` against the training loss."""
    import accelerate.accelerator
    import torch
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FSDPModule

    from .. import tiny as tiny_models
    from ..scenarios import wrapped_module_names

    rank_env(rank, world)
    subset.apply(patches)
    _, _, fsdp2, _ = import_axolotl()
    trainer_mod, _ = import_kd()
    prepare = accelerate.accelerator.fsdp2_prepare_model
    with cpu_fsdp():
        try:
            fsdp2.patch_accelerate_fsdp2()
            plugin = FullyShardedDataParallelPlugin(fsdp_version=2, **KD_WRAPS[wrap])
            acc = Accelerator(cpu=True, fsdp_plugin=plugin)
            model = tiny_models.build(family, tie=False, seed=0)
            reference = copy.deepcopy(model)
            model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=lr))
        except ValueError as exc:  # SIZE_BASED_WRAP: fully_shard refuses the layers' ModuleList (no forward)
            return {"error": "prepare: %s: %s" % (type(exc).__name__, first_line(exc)), "prepared_by": fsdp2.__name__}
        finally:
            accelerate.accelerator.fsdp2_prepare_model = prepare
    trainer = kd_trainer()
    # Resolved before any forward, through the (patched) function: the fix must leave a not yet initialised root
    # unit alone (unsharding it there measurably desynchronised the root's parameters from the optimizer).
    head = trainer_mod._resolve_lm_head(model)
    result = {"error": None, "losses": [], "loss_err": 0.0, "grad_err": 0.0, "worst_grad": None, "param_err": 0.0,
              "lm_head_grad_err": 0.0, "grads_checked": 0, "prepared_by": fsdp2.__name__,
              "units": wrapped_module_names(model), "head_is_unit": isinstance(head, FSDPModule), "head_read": [],
              "eval_err": 0.0}

    def loss_of(module, batch):
        if evaluate and module is model:
            with torch.no_grad():
                evaluated = trainer.compute_loss(module, batch)
        loss = trainer.compute_loss(module, batch)
        if evaluate and module is model:
            result["eval_err"] = max(result["eval_err"], rel_err(evaluated, loss.detach()))
        if module is model:  # what compute_loss read, still as it read it (nothing ran in between)
            result["head_read"].append(type(trainer_mod._resolve_lm_head(module).weight).__name__)
        return loss, None

    def batches_for(step):
        return [kd_batch(family, reference, seed=1 + step * world + r) for r in range(world)]

    return train_against_reference(model, reference, rank, world, result, batches_for, loss_of, steps, lr)


def kd_cases(rank, world, cases, steps=2):
    """``kd_steps`` for each ``(family, wrap, patches, evaluate)`` of ``cases`` in this rank process, reverting in
    between."""
    import fsdp2_compat
    from accelerate.state import AcceleratorState

    out = []
    for family, wrap, patches, evaluate in cases:
        subset.forget()
        fsdp2_compat.revert()
        AcceleratorState._reset_state(reset_partial_state=True)
        out.append(kd_steps(rank, world, family, wrap, patches, steps=steps, evaluate=evaluate))
    subset.forget()
    fsdp2_compat.revert()
    return out
