"""axolotl: its fused LoRA kernels read the DoRA magnitude with plain ``full_tensor()``; its KD trainer reads
``lm_head.weight`` after the forward resharded it.

axolotl trains through accelerate's ``Accelerator.prepare`` with its own
``fsdp2_prepare_model`` (``axolotl.monkeypatch.accelerate.fsdp2``, installed
into ``accelerate.accelerator`` by ``patch_accelerate_fsdp2``), which gives every
PEFT LoRA layer's ``lora_A[adapter]``, ``lora_B[adapter]`` and
``lora_magnitude_vector[adapter]`` an FSDP2 unit of its own, and a LoRA
embedding one unit as a whole.  Its LoRA kernels (``lora_qkv_kernel``,
``lora_o_kernel``, ``lora_embedding_kernel``: ``apply_lora_kernel_patches``)
bypass those modules' forwards and read their parameters through
``axolotl.kernels.lora.get_lora_parameters`` / ``get_embedding_lora_parameters``.
From 0.16.0 (DoRA in the kernels) both read the magnitude with plain
``magnitude.full_tensor()``: each rank trains the q/k/v/o (and embedding) DoRA
magnitudes on its own micro-batch's gradient, never the data-parallel average.
Nothing crashes.  Measured (0.19.0, 2 CPU gloo ranks, different data, tiny
Qwen2, DoRA on every projection and the embedding): the q/k/v/o magnitude
gradients off the average by ~5e-2 and the embedding's by ~2e-2 at the first
step; the MLP magnitudes (PEFT's own forward: the MLP kernel is Triton, CUDA
only) and every ``lora_A`` / ``lora_B`` / ``lora_embedding_A`` / ``_B`` exact
(``tests/integrations/test_axolotl.py``).

Seams (``fsdp2_compat.fixes.adapter_reads``): both readers, wrapped to unshard
the magnitude's own unit through FSDP before upstream's code runs
(``gather.gather_param``: FSDP's post-backward then averages the gradient);
upstream's ``isinstance(magnitude, DTensor)`` is then false.  Callers: the
kernels of ``axolotl.kernels.lora`` look the readers up as module globals;
``axolotl.integrations.kernels.libs.dsv4`` imports ``get_lora_parameters`` by
name (``INTEGRATION.callers``: the engine rebinds it there when imported).

Releases: <0.7.0 have no ``kernels/lora.py``; 0.7.0-0.15.0 have no DoRA in the
kernels (0.12.0+ unshard ``lora_A`` / ``lora_B`` through FSDP: right) and no
embedding kernel; 0.16.0-0.21.0 one code (fingerprints below; 0.19.0 proven,
set ``axolotl``).  Upstream: no axolotl issue yet (fsdp2-compat issue #34).

Fails safe: installed only on the fingerprinted code; a magnitude that is not
sharded, or not its own FSDP2 unit, is left to upstream's code (the latter with
a warning).  Delete when axolotl reads the magnitude through its unit
(``mag_layer.unshard()``, as it does for ``lora_A``) in every release you run.

KD trainer (``axolotl.integrations.kd.trainer``, 0.17.0+): ``compute_loss``
runs the model (``logits_to_keep=1``, ``output_hidden_states``), then
``_resolve_lm_head(model)`` and hands ``lm_head.weight`` to its liger chunked
top-k KL loss.  Under axolotl's preparation ``lm_head`` is not a unit of its
own: the root unit holds it with the embedding and the final norm.  But
axolotl's ``fsdp2_prepare_model`` passes the plugin's ``reshard_after_forward``
(true unless ``fsdp_config.reshard_after_forward: false``: the default of
accelerate's plugin and of transformers' ``fsdp_config``) and torch 2.13 then
reshards the root after its forward too (it keeps the root unsharded only
when the argument is left unset), so the read is a sharded
DTensor and liger's loss crashes at the first step: ``aten.mm.default got
mixed torch.Tensor and DTensor``.  Measured (0.19.0, torch 2.13.0, 2 CPU gloo
ranks, different data, tiny untied Qwen2).

Seam: ``_resolve_lm_head`` (``fsdp2_compat.fixes.head_reads``): the head it
returns has its weight unsharded through the FSDP2 unit that manages it, whose
post-backward then averages its gradient.  Patched: two steps DP-exact.

Claims that did not reproduce (``tests/integrations/test_axolotl.py``): with
``reshard_after_forward: false`` the root stays unsharded after the forward
and the unpatched read is exact (its gradient is FSDP's, averaged); a head
with a unit of its own cannot be reached through axolotl's policies on torch
2.13: ``SIZE_BASED_WRAP`` (the one that could select it) fails at preparation
(``fully_shard`` refuses the layers' ``ModuleList``, which the size policy also
selects), and ``TRANSFORMER_BASED_WRAP`` selects decoder layers only.  Read
from code, not run: LoRA on ``lm_head`` gives only ``lora_A`` / ``lora_B``
units of their own, and the KD read is the layer's ``base_layer`` weight (in
the root unit: the same read as above, frozen).
Releases: <0.7.0 have no KD trainer; 0.7.0-0.16.1 compute the KD loss inside
the model's forward (no ``_resolve_lm_head``); 0.17.0-0.21.0 one code (0.19.0 proven).
Delete when axolotl reads the head through its unit in every release you run.
"""

from ..core.records import Integration, Target
from ..fixes import DORA_MAGNITUDE, KD_HEAD

LORA = "axolotl.kernels.lora"

INTEGRATION = Integration(
    dist="axolotl",
    package="axolotl",
    wrap_module=None,  # axolotl prepares models through accelerate (its own fsdp2_prepare_model), not an apply_fsdp2
    callers=("axolotl.integrations.kernels.libs.dsv4.lora_mlp", "axolotl.integrations.kernels.libs.dsv4.lora_fp8"),
)

_NO_KERNELS = "no axolotl.kernels.lora: the LoRA kernels arrived in 0.7.0"
_NO_DORA = ("no DoRA magnitude read: the kernels of these releases have no DoRA (0.12.0+ unshard lora_A / lora_B "
            "through FSDP, whose gradients FSDP averages)")

LORA_MAGNITUDE = Target(
    dist="axolotl",
    module=LORA,
    attr="get_lora_parameters",
    versions="==0.19.0",
    fingerprints={"0.16.0-0.21.0": "c1ebdcdadbfc2f56"},  # proven on 0.19.0 (versions); the others: same code
    fix=DORA_MAGNITUDE,
    what="axolotl LoRA kernels read the DoRA magnitude (plain full_tensor)",
    declared={"<0.7.0": _NO_KERNELS, ">=0.7.0,<0.16.0": _NO_DORA},
)

EMBEDDING_MAGNITUDE = Target(
    dist="axolotl",
    module=LORA,
    attr="get_embedding_lora_parameters",
    versions="==0.19.0",
    fingerprints={"0.16.0-0.21.0": "6ad594ab40f3df64"},
    fix=DORA_MAGNITUDE,
    what="axolotl LoRA kernels read the DoRA magnitude (embedding, plain full_tensor)",
    declared={"<0.7.0": _NO_KERNELS, ">=0.7.0,<0.16.0": "no embedding LoRA kernel (it arrived in 0.16.0)"},
)



KD_LM_HEAD = Target(
    dist="axolotl",
    module="axolotl.integrations.kd.trainer",
    attr="_resolve_lm_head",
    versions="==0.19.0",
    fingerprints={"0.17.0-0.21.0": "8d14073b6071ed10"},  # proven on 0.19.0 (versions); the others: same code
    fix=KD_HEAD,
    what="axolotl KD trainer reads lm_head.weight after the forward",
    declared={"<0.7.0": "no axolotl.integrations.kd.trainer: the KD trainer arrived in 0.7.0",
              ">=0.7.0,<0.17.0": ("no _resolve_lm_head: the KD loss runs inside the model's forward (the logits, "
                                  "or kd/kernels/models.py reading self.lm_head.weight while the root unit is "
                                  "unsharded), nothing reads the head after it")},
)

TARGETS = (LORA_MAGNITUDE, EMBEDDING_MAGNITUDE, KD_LM_HEAD)
