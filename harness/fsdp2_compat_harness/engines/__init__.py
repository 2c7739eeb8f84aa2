"""The frameworks' own training engines on CPU gloo ranks, against an unsharded DP-average reference.

What users run is not ``apply_fsdp2`` alone but a training engine around it:

- ``verl_engine``     verl's FSDP engine: ``EngineRegistry.new("language_model", "fsdp2")``
                      -> ``FSDPEngineWithLMHead`` (``initialize``, ``forward_backward_batch``,
                      ``optimizer_step``, ``train_batch``), verl >= 0.7;
- ``skyrl_strategy``  SkyRL's ``FSDPStrategy`` + ``HFModelWrapper`` as its FSDP policy
                      worker drives them (``prepare``, ``backward``, ``optimizer_step``);
- ``axolotl``         axolotl's own preparation (``patch_accelerate_fsdp2`` under the real
                      ``Accelerator.prepare``) with its LoRA kernels on a DoRA model, and its
                      KD trainer's ``compute_loss`` (its one stand-in: ``trl_scenarios.cpu_fsdp``);
- ``lmms_forwards``   lmms-engine's own padding-free VLM forwards, installed as its runner does;
- ``ms_swift``        ms-swift's own loader (its Qwen3-VL instance forward) and templates, and
                      GRPO's Liger loss, on accelerate's FSDP2 (``trl_scenarios.cpu_fsdp``; the
                      template's processor: a namespace with transformers' image processor);
- ``cpu``             the CPU stand-ins, each named and narrow: a CPU platform registered
                      through verl's own ``PlatformRegistry``; CPU copies of SkyRL's three
                      CUDA-only helpers (used only where their code is the fingerprinted
                      release code); ``flash_attn.bert_padding`` visible while SkyRL's model
                      wrapper imports.  None replaces code fsdp2-compat patches, none wraps
                      the model;
- ``common``          model directories (``save_pretrained`` of a tiny model), how a rank
                      turns fsdp2-compat on, and the comparisons.

Rank functions return plain dicts (``run_ranks``): the exact error when a step
fails, else the losses and the worst loss / gradient / parameter errors
(``max |a - b| / (1 + |b|)``) against the reference, per step.  Used by the
tests and by ``fsdp2-compat check``.
"""

# The families the engine proofs run: GLM-4.1V, GLM-4.5V (MoE), two controls and a text model.
FAMILIES = ("glm4v", "glm4v_moe", "qwen3_vl", "qwen2_5_vl", "qwen2")
