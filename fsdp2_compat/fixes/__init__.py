"""The fixes: one ``Fix`` record per mechanism, the unit of the catalogue; each module below is the code.

A ``Fix`` declares the seam callables it installs, what a user sees without
it, its upstream references, when it can be deleted and what proves it.  The
integrations say where each fix goes (``Target.fix``: a release range, the
fingerprints of the code); a patch lists the fixes a family needs, and the
registry joins the two.  A new mechanism is one record here and one module.

Stdlib only, and no module below is imported here: this file is read at
``import fsdp2_compat.auto``, the code when a target module is imported.
"""

from ..core.records import Fix

_F = "fsdp2_compat.fixes."

WRAP_SELECTION = Fix(
    name="wrap-selection",
    what="FSDP2 wrap selection: only layer classes and the untied input embedding get their own unit",
    seams={"inline loop": _F + "inline_selection:seam",
           "inline loop in a method": _F + "inline_selection:method_seam",
           "selection function": _F + "selection:verl_seam"},
    references=("SkyRL issue #2087", "SkyRL PR #2088"),
    delete_when="when every framework release you run selects only layer classes and the untied input embedding "
                "for their own FSDP2 groups (SkyRL PR #2088 released; verl has no fix yet)",
    scenarios=("selection", "verl engine", "skyrl strategy"),
    tests=("tests/integrations/test_wrap_selection.py", "tests/integrations/test_skyrl_strategy.py", "tests/integrations/test_areal.py",
           "tests/integrations/test_llamafactory.py", "tests/fixes/test_selection.py"),
)

LAYER_CLASS_LOOKUP = Fix(
    name="layer-class-lookup",
    what="LLaMA-Factory's FSDP2 layer-class lookup reads a set _no_split_modules",
    seams={"lookup": _F + "selection:layer_class_seam"},
    symptom="LLaMA-Factory 0.9.5 on transformers 5.x: \"Could not identify Transformer Layer class\", the vision "
            "blocks stay in the root unit (Qwen3-VL in bf16: `RuntimeError: mixed dtype (CPU)` in the vision "
            "LayerNorm)",
    references=("LLaMA-Factory PR #10656 (layer-class lookup, main only)",),
    delete_when="when LLaMA-Factory's layer-class lookup reads a set _no_split_modules (main: PR #10656) in your "
                "release",
    tests=("tests/integrations/test_llamafactory.py",),
)

GLM4V_FORWARD = Fix(
    name="verl-glm4v-forward",
    what="verl's own GLM-4.1V forward on the transformers verl admits",
    seams={"vision output": _F + "glm4v_forward:vision_output_seam",
           "position ids": _F + "glm4v_forward:position_ids_seam"},
    references=("verl issue #4095", "verl issue #6814"),
    delete_when="when verl's GLM4V forward unpacks the vision output (and, for transformers 4.x users, drops the "
                "text row) in every release you run",
    scenarios=("verl engine", "fused forward"),
    tests=("tests/integrations/test_verl_engine.py", "tests/integrations/test_fused_forwards.py"),
)

VERL_LM_HEAD = Fix(
    name="verl-lm-head",
    what="verl's fused forwards read lm_head.weight: unshard its unit first (averaged gradient); under Ulysses SP "
         "(0.6.0-0.7.1) they also get the labels rolled over the whole sequence",
    seams={"reader": _F + "gather:lm_head_reader_seam", "sp caller": _F + "gather:sp_caller_seam"},
    references=("verl issue #4756", "verl PR #6659", "verl PR #6268"),
    delete_when="when verl's fused forwards gather lm_head.weight with a data-parallel-averaged gradient (not plain "
                "full_tensor()) and take SP-sliced shift_labels (0.8.0+) in every release you run",
    scenarios=("fused forward", "fused, 2 ranks", "verl engine", "fused, Ulysses SP 2"),
    tests=("tests/integrations/test_fused_forwards.py", "tests/integrations/test_lm_head_release.py",
           "tests/integrations/test_verl_engine.py", "tests/integrations/test_sp_labels.py"),
)

TRL_HEAD_READS = Fix(
    name="trl-lm-head",
    what="TRL reads lm_head.weight outside its forward: unshard its unit first (averaged gradient)",
    seams={"fused LM head": _F + "head_reads:fused_lm_head_seam", "student": _F + "head_reads:student_head_seam"},
    symptom="TRL (accelerate >= 1.14 FSDP2, untied VLM): silently **unaveraged `lm_head` gradient** in the fused "
            "LM head (SFT, GRPO, RLOO, DPO, KTO) and distillation losses",
    delete_when="when TRL reads lm_head.weight through FSDP (not plain full_tensor()) in every release you run",
    scenarios=("TRL SFT, 2 ranks",),
    tests=("tests/integrations/test_trl.py", "tests/integrations/test_trl_stacks.py"),
)

DORA_MAGNITUDE = Fix(
    name="axolotl-dora-magnitude",
    what="axolotl's LoRA kernels read a DoRA magnitude: unshard its unit, not full_tensor()",
    seams={"reader": _F + "adapter_reads:magnitude_reader_seam"},
    symptom="axolotl 0.16.0+ LoRA kernels with DoRA on FSDP2: the q/k/v/o (and embedding) `lora_magnitude_vector` "
            "gradients are each rank's own, never the data-parallel average (plain `full_tensor()`; no error)",
    delete_when="when axolotl reads the DoRA magnitude through its unit (mag_layer.unshard(), as it does for "
                "lora_A) in every release you run",
    scenarios=("axolotl DoRA kernels, 2 ranks",),
    tests=("tests/integrations/test_axolotl.py",),
)

KD_HEAD = Fix(
    name="axolotl-kd-head",
    what="axolotl's KD trainer reads lm_head.weight after the forward: unshard it first",
    seams={"resolved head": _F + "head_reads:resolved_head_seam"},
    symptom="axolotl 0.17.0+ KD trainer on FSDP2 (reshard_after_forward true, accelerate's default): compute_loss "
            "reads lm_head.weight after the forward resharded the root unit and crashes in liger's chunked loss "
            "(`aten.mm.default got mixed torch.Tensor and DTensor`)",
    delete_when="when axolotl's KD trainer reads the head through its unit in every release you run",
    scenarios=("axolotl KD trainer, 2 ranks",),
    tests=("tests/integrations/test_axolotl.py",),
)

ACCELERATE_TIED_TAIL = Fix(
    name="accelerate-tied-tail",
    what="accelerate's FSDP2 tail unit keeps a tied head with its embedding",
    seams={"prepare": _F + "tail_unit:prepare_model_seam"},
    symptom="accelerate 1.14.0 FSDP2 (HF Trainer, TRL, axolotl), tied embeddings: `ValueError: Parameter "
            "'model.embed_tokens.weight' is shared with a parameter already managed by another FSDP group` at "
            "the first forward",
    references=("accelerate PR #4015", "accelerate PR #4171"),
    delete_when="when every accelerate you run is >= 1.15.0",
    scenarios=("accelerate tied, 2 ranks",),
    tests=("tests/integrations/test_accelerate.py",),
)

ACCELERATE_VLM_NORM = Fix(
    name="accelerate-vlm-norm",
    what="accelerate's FSDP2 tail unit gives a VLM's head its decoder's final norm",
    seams={"final norm": _F + "tail_unit:final_norm_seam"},
    symptom="accelerate 1.14.0-1.16.0 FSDP2, untied VLM: `lm_head` alone in its unit, so a reader of "
            "`lm_head.weight` inside the forward (Liger-Kernel `use_liger_kernel=True`, custom losses) crashes "
            "with `aten.mm.default got mixed torch.Tensor and DTensor` or, with `full_tensor()`, trains `lm_head` "
            "on one rank's gradient",
    references=("accelerate PR #4015",),
    delete_when="when every accelerate you run finds a VLM decoder's final norm (_find_final_norm)",
    scenarios=("accelerate lm_head reader, 2 ranks", "ms-swift GRPO Liger, 2 ranks"),
    tests=("tests/integrations/test_accelerate.py",),
)

NATIVE_TAIL = Fix(
    name="transformers-native-tail",
    what="transformers' native FSDP2 gives a lone kept head its decoder's final norm",
    seams={"apply": _F + "tail_unit:native_apply_seam"},
    symptom="transformers >= 5.15 native FSDP2 (`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size"
            "=N))`), a final norm not called `norm` (Phi, dbrx, jamba, lfm2): `lm_head` alone in its unit, so an "
            "in-forward reader of `lm_head.weight` (Liger-Kernel, custom losses) crashes with `aten.mm.default got "
            "mixed torch.Tensor and DTensor` or, with `full_tensor()`, trains `lm_head` on one rank's gradient",
    delete_when="when transformers' native FSDP2 pairs a kept lm_head with any decoder final norm in every release "
                "you run",
    scenarios=("native FSDP2 lm_head reader, 2 ranks",),
    tests=("tests/integrations/test_native_fsdp.py",),
)

GRAD_ACCUMULATION = Fix(
    name="grad-accumulation",
    what="torch FSDP2 gradient accumulation over micro-batches that leave a unit unused",
    seams={"guard": _F + "accumulation:guard_seam", "uniform": _F + "accumulation:uniform_seam"},
    symptom="torch FSDP2 with deferred gradient sync and a micro-batch that skips a unit (text-only): "
            "`AttributeError: 'FSDPParam' object has no attribute '_unsharded_param'`",
    references=("pytorch issue #196996", "pytorch PR #194058", "verl PR #7475", "verl issue #7520"),
    delete_when="when every torch you run is >= 2.15.0 (FSDP2 accumulation rewritten around grad_dtype)",
    tests=("tests/integrations/test_grad_accumulation.py", "tests/integrations/test_accumulation_declared.py"),
)

FROZEN_FIRST_FORWARD = Fix(
    name="frozen-first-forward",
    what="a FSDP2 unit whose first forward ran frozen takes its dtypes from its parameters (torch 2.14's rule)",
    seams={"dtypes": _F + "frozen_units:mp_dtypes_seam"},
    symptom="torch 2.8-2.13, a unit whose first step ran with every parameter frozen (LoRA warm-up, a tower "
            "unfrozen later), bf16 parameters / fp32 reduce: `RuntimeError: attempting to assign a gradient with "
            "dtype 'c10::BFloat16' to a tensor with grad_dtype 'Float'`",
    references=("pytorch issue #186998",),
    delete_when="when every torch you run is >= 2.14.0 (a frozen unit's dtypes come from its floating parameters)",
    scenarios=("LoRA tower unfrozen, 2 ranks",),
    tests=("tests/integrations/test_lora_vlm.py",),
)

MIXED_MEDIA = Fix(
    name="mixed-media",
    what="a media tower every rank runs, whatever its micro-batch holds (a zero dummy on a text-only rank; from the "
         "second, a walk of the dummy's recorded units)",
    seams={"forward": _F + "mixed_media:forward_seam"},
    symptom="one rank's micro-batch text-only and another's with an image or audio (any framework but verl's own "
            "forwards): the tower's FSDP2 collectives differ across ranks, NCCL **hangs**, gloo aborts (`Received data "
            "size doesn't match expected size`)",
    references=("TRL issue #3934", "torchtitan issue #4777"),
    delete_when="when transformers keeps every rank in the vision tower's collectives on text-only micro-batches in "
                "every release you run",
    scenarios=("mixed ranks, 2 ranks", "mixed ranks, its own forward, 2 ranks", "ms-swift Qwen3-VL forward, 2 ranks",
               "native FSDP2 mixed ranks, 2 ranks", "audit divergence"),
    tests=("tests/integrations/test_mixed_ranks.py", "tests/integrations/test_mixed_families.py",
           "tests/integrations/test_mixed_media_kinds.py", "tests/integrations/test_lmms_engine_forwards.py",
           "tests/fixes/test_unit_walk.py", "tests/integrations/test_native_fsdp.py"),
)

VERL_MEDIA = Fix(
    name="verl-media",
    what="verl's own Qwen-VL forwards run the vision tower once per micro-batch",
    seams={"qwen2_vl": _F + "verl_media:qwen2_vl_seam", "qwen3_vl": _F + "verl_media:qwen3_vl_seam"},
    symptom="verl's own Qwen-VL forwards (0.6.0+): a micro-batch with an image and a video runs the vision tower "
            "twice, a rank with one kind once: FSDP2's collectives differ, NCCL **hangs**, gloo aborts",
    delete_when="when verl's _get_input_embeds runs the tower once per micro-batch in every release you run",
    scenarios=("verl engine",),
    tests=("tests/integrations/test_verl_engine.py", "tests/fixes/test_verl_media.py"),
)

MOE_EXPERTS = Fix(
    name="moe-experts",
    what="MoE experts no token on this rank reached: every rank reduce-scatters every expert",
    seams={"block": _F + "experts:block_seam"},
    symptom="a MoE expert one rank's tokens reach and another's do not (transformers 4.x, any framework): gloo "
            "`Received data size doesn't match expected size`, NCCL hangs or reduces the wrong gradients",
    references=("pytorch issue #171355", "SkyRL issue #1297", "SkyRL PR #1370"),
    delete_when="when every transformers you train MoE models with is >= 5.0 (3-D experts: every rank has every "
                "gradient)",
    scenarios=("MoE experts, 2 ranks", "audit divergence"),
    tests=("tests/integrations/test_moe_experts.py", "tests/integrations/test_moe_3d_experts.py"),
)

MIXED_DTYPES = Fix(
    name="mixed-dtypes",
    what="an FSDP2 unit mixing parameter dtypes: each fp32-kept module (a MoE router) gets a unit of its own",
    seams={"fully_shard": _F + "mixed_dtypes:seam"},
    symptom="transformers >= 5.24.0 MoE routers kept fp32 in a bf16 model (GLM-4.5/4.6, GLM-4.5V, DeepSeek-V2/V3 "
            "loaded with dtype=bf16), FSDP2 per-layer units (torch's recipe; accelerate with mixed_precision=\"no\"):"
            " `AssertionError: FSDP expects uniform original parameter dtype but got {torch.bfloat16, torch.float32}`"
            " at the first forward",
    references=("transformers 5.24.0 _keep_in_fp32_modules_strict (gate.weight)", "accelerate PR #3985",
                "NeMo AutoModel #1677"),
    delete_when="when torch's FSDP2 accepts mixed parameter dtypes in one unit, or no model you train keeps a "
                "trainable module in another dtype (transformers < 5.24.0 keeps no MoE router in fp32)",
    scenarios=("fp32 routers, 2 ranks",),
    tests=("tests/integrations/test_mixed_dtypes.py",),
)

# Every fix, in the order the catalogue reads them.
FIXES = (WRAP_SELECTION, LAYER_CLASS_LOOKUP, GLM4V_FORWARD, VERL_LM_HEAD, TRL_HEAD_READS, DORA_MAGNITUDE, KD_HEAD,
         ACCELERATE_TIED_TAIL, ACCELERATE_VLM_NORM, NATIVE_TAIL, GRAD_ACCUMULATION, FROZEN_FIRST_FORWARD,
         MIXED_MEDIA, VERL_MEDIA, MOE_EXPERTS, MIXED_DTYPES)
