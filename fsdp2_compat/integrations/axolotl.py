"""axolotl: its fused LoRA kernels read the DoRA magnitude with plain ``full_tensor()``; its KD trainer reads
``lm_head.weight`` after the forward resharded it.

axolotl trains through accelerate's ``Accelerator.prepare`` with its own ``fsdp2_prepare_model``
(``axolotl.monkeypatch.accelerate.fsdp2``, installed by ``patch_accelerate_fsdp2``): every PEFT LoRA layer's
``lora_A`` / ``lora_B`` / ``lora_magnitude_vector`` gets a unit of its own, a LoRA embedding one as a whole.  Its
LoRA kernels (``lora_qkv_kernel``, ``lora_o_kernel``, ``lora_embedding_kernel``) bypass those modules' forwards and
read their parameters through ``axolotl.kernels.lora.get_lora_parameters`` / ``get_embedding_lora_parameters``;
from 0.16.0 (DoRA in the kernels) both read the magnitude with plain ``magnitude.full_tensor()``: each rank trains
the q/k/v/o (and embedding) DoRA magnitudes on its own gradient, never the average, and nothing crashes.  Measured
(0.19.0, 2 CPU gloo ranks, different data, tiny Qwen2, DoRA everywhere): q/k/v/o magnitude gradients off by ~5e-2,
the embedding's by ~2e-2 at the first step; the MLP magnitudes (PEFT's forward: that kernel is CUDA-only Triton)
and every ``lora_A`` / ``lora_B`` exact (``tests/integrations/test_axolotl.py``).  Seams
(``fixes.adapter_reads``): both readers unshard the magnitude's own unit through FSDP first (``gather.gather_param``:
FSDP's post-backward averages the gradient; upstream's ``isinstance(magnitude, DTensor)`` is then false).  The
kernels look the readers up as module globals; ``axolotl.integrations.kernels.libs.dsv4`` imports
``get_lora_parameters`` by name (``INTEGRATION.callers``: rebound there).  Releases: <0.7.0 no ``kernels/lora.py``;
0.7.0-0.15.0 no DoRA in the kernels (0.12.0+ unshard ``lora_A`` / ``lora_B`` through FSDP: right); 0.16.0-0.21.0
one code (0.19.0 proven).  No axolotl issue yet (fsdp2-compat issue #34).  Fails safe: a magnitude that is not
sharded, or not its own unit, is left to upstream's code (the latter with a warning).  Delete when axolotl reads
the magnitude through its unit (``mag_layer.unshard()``, as for ``lora_A``) in every release you run.

KD trainer (``axolotl.integrations.kd.trainer``, 0.17.0+): ``compute_loss`` runs the model (``logits_to_keep=1``,
``output_hidden_states``), then hands ``_resolve_lm_head(model).weight`` to liger's chunked top-k KL loss.  The root
unit holds ``lm_head`` with the embedding and final norm, but axolotl passes the plugin's ``reshard_after_forward``
(true by default) and torch 2.13 then reshards the root after its forward too (it keeps the root unsharded only when
the argument is unset): the read is a sharded DTensor, ``aten.mm.default got mixed torch.Tensor and DTensor`` at the
first step (0.19.0, torch 2.13.0, 2 CPU gloo ranks, tiny untied Qwen2).  Seam ``_resolve_lm_head``
(``fixes.head_reads``): the returned head's weight is unsharded through its unit, whose post-backward averages the
gradient; two steps DP-exact.  Not reproduced: with ``reshard_after_forward: false`` the unpatched read is exact; a
head with a unit of its own cannot be reached through axolotl's policies on torch 2.13 (``SIZE_BASED_WRAP`` fails
at preparation on the layers' ``ModuleList``; ``TRANSFORMER_BASED_WRAP`` selects decoder layers only).  Read, not
run: LoRA on ``lm_head`` gives only ``lora_A`` / ``lora_B`` units; the KD read is then the frozen ``base_layer``
weight in the root unit.  Releases: <0.7.0 no KD trainer; 0.7.0-0.16.1 compute the KD loss inside the forward;
0.17.0-0.21.0 one code (0.19.0 proven).  Delete when axolotl reads the head through its unit in every release.
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
