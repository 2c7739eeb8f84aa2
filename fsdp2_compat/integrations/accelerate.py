"""accelerate: the FSDP2 preparation under the HF Trainer, TRL, axolotl (``fsdp2_prepare_model``).

``accelerate.utils.fsdp_utils.fsdp2_prepare_model`` shards a model for ``Accelerator.prepare`` whenever the FSDP
plugin says ``fsdp_version=2``: transformers' ``Trainer`` (``TrainingArguments.fsdp``), every TRL trainer, axolotl
and LLaMA-Factory's v0 trainer go through it.  From 1.14.0 (PR #4015) it gives the model's end a unit of its own,
``[final_norm, head]`` with ``reshard_after_forward=False``, so that the norm's forward unshards the head and code
reading ``lm_head.weight`` inside the model's forward gets a full weight whose gradient FSDP averages.  Two bugs,
each fixed by one target here (mechanisms in ``fsdp2_compat.fixes.tail_unit``):

- ``TIED_TAIL`` (1.14.0): tied embeddings get the unit ``[final_norm,
  input_embed]`` and the tied head stays in the root unit: one parameter in
  two FSDP groups.  torch 2.13: ``ValueError: Parameter
  'model.embed_tokens.weight' is shared with a parameter already managed by
  another FSDP group`` at the first forward (tied Qwen3 / Qwen2.5-VL /
  Qwen3-VL / Llama-3.2 / Gemma-3 shapes); older torches untie them silently.
  Fixed in 1.15.0 (PR #4171), whose unit ``[norm, embed, head]`` the seam
  builds.  accelerate 1.6.0-1.13.0 have no tail unit (everything but the
  layers is in the root unit): nothing to fix.
- ``VLM_FINAL_NORM`` (1.14.0-1.15.0 proven; 1.16.0 has the same ``_find_final_norm``
  and tail unit, so the seam applies there as unproven): ``_find_final_norm`` looks only at the
  base model's direct children; a VLM's base has none, so the head is alone
  in its unit and a direct reader (Liger-Kernel's fused linear
  cross-entropy with ``use_liger_kernel=True``, TRL's fused LM head, a custom
  loss) gets a sharded DTensor: ``aten.mm.default got mixed torch.Tensor and
  DTensor``, or with ``full_tensor()`` an unaveraged ``lm_head`` gradient.
  The seam adds the decoder's final norm (``get_decoder()`` /
  ``language_model``), the norm a text model's unit already holds.

Callers import ``fsdp2_prepare_model`` by name (``accelerate.utils``, ``accelerate.accelerator``): the engine
rebinds them.  ``_find_final_norm`` is looked up as a module global at call time.

Upstream: accelerate PR #4015, PR #4171; no accelerate issue for the VLM norm
yet.  Delete when every accelerate you run is >= 1.15.0 (``TIED_TAIL``) and
finds a VLM decoder's final norm (``VLM_FINAL_NORM``).
"""

from ..core.records import Integration, Target
from ..fixes import ACCELERATE_TIED_TAIL, ACCELERATE_VLM_NORM

FSDP_UTILS = "accelerate.utils.fsdp_utils"

INTEGRATION = Integration(
    dist="accelerate",
    package="accelerate",
    # accelerate prepares models through fsdp2_prepare_model(accelerator, model), not an
    # apply_fsdp2(model, ...) the wrap-selection harness could call: no wrap_module.
    wrap_module=None,
    callers=("accelerate.utils", "accelerate.accelerator"),  # import fsdp2_prepare_model by name
)

_NO_FSDP2 = "no fsdp2_prepare_model: FSDP2 preparation arrived in 1.6.0"
_NO_TAIL = ("no tail unit: fsdp2_prepare_model shards the auto-wrap policy's modules (the layers) and then the root, "
            "so the embeddings, the norm and lm_head share the root unit, unsharded for the whole forward "
            "(read: every release 1.6.0-1.13.0)")


TIED_TAIL = Target(
    dist="accelerate",
    module=FSDP_UTILS,
    attr="fsdp2_prepare_model",
    versions="==1.14.0",
    fingerprints={"1.14.0": "2c04da10a742c231"},
    fix=ACCELERATE_TIED_TAIL,
    what="accelerate FSDP2 tail unit (tied lm_head left in the root unit)",
    fixed_in=">=1.15.0",
    declared={"<1.6.0": _NO_FSDP2, ">=1.6.0,<1.14.0": _NO_TAIL},
)

VLM_FINAL_NORM = Target(
    dist="accelerate",
    module=FSDP_UTILS,
    attr="_find_final_norm",
    versions=">=1.14.0,<=1.15.0",
    fingerprints={"1.14.0-1.16.0": "0428d06c1e0fac6e"},  # proven to 1.15.0 (versions); 1.16.0: same code
    fix=ACCELERATE_VLM_NORM,
    what="accelerate FSDP2 tail unit (a VLM's lm_head alone, without its decoder's norm)",
    declared={"<1.6.0": _NO_FSDP2, ">=1.6.0,<1.14.0": "no _find_final_norm; " + _NO_TAIL},
)

TARGETS = (TIED_TAIL, VLM_FINAL_NORM)
