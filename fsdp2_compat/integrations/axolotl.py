"""axolotl: its fused LoRA kernels read the DoRA magnitude with plain ``full_tensor()``.

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
"""

from ..core.records import Integration, Target

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
SYMPTOM = ("axolotl 0.16.0+ LoRA kernels with DoRA on FSDP2: the q/k/v/o (and embedding) `lora_magnitude_vector` "
           "gradients are each rank's own, never the data-parallel average (plain `full_tensor()`; no error)")

LORA_MAGNITUDE = Target(
    dist="axolotl",
    module=LORA,
    attr="get_lora_parameters",
    versions="==0.19.0",
    fingerprints={"0.16.0-0.21.0": "c1ebdcdadbfc2f56"},  # proven on 0.19.0 (versions); the others: same code
    seam="fsdp2_compat.fixes.adapter_reads:magnitude_reader_seam",
    what="axolotl LoRA kernels read the DoRA magnitude (plain full_tensor)",
    declared={"<0.7.0": _NO_KERNELS, ">=0.7.0,<0.16.0": _NO_DORA},
    symptom=SYMPTOM,
)

EMBEDDING_MAGNITUDE = Target(
    dist="axolotl",
    module=LORA,
    attr="get_embedding_lora_parameters",
    versions="==0.19.0",
    fingerprints={"0.16.0-0.21.0": "6ad594ab40f3df64"},
    seam="fsdp2_compat.fixes.adapter_reads:magnitude_reader_seam",
    what="axolotl LoRA kernels read the DoRA magnitude (embedding, plain full_tensor)",
    declared={"<0.7.0": _NO_KERNELS, ">=0.7.0,<0.16.0": "no embedding LoRA kernel (it arrived in 0.16.0)"},
    symptom=SYMPTOM,
)

TARGETS = (LORA_MAGNITUDE, EMBEDDING_MAGNITUDE)
