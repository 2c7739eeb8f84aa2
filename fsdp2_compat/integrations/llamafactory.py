"""LLaMA-Factory: the v1 trainer's FSDP2 engine, ``FSDP2Engine.prepare_model``.

Module ``llamafactory.v1.plugins.trainer_plugins.distributed.fsdp2`` (first released in 0.9.5; 0.7.1-0.9.3 have no
``v1`` package, 0.9.4 one without an FSDP2 engine).  ``hub.py`` imports ``FSDP2Engine`` at call time and nothing
imports ``prepare_model``, ``fully_shard`` or ``get_transformer_layer_cls`` by name: no aliases to rebind.

1. **Wrap selection** (``FSDP2Engine.prepare_model``), inline as in verl 0.4-0.7: after an optional LoRA pass (every
   leaf with a trainable parameter sharded first) it shards every module whose exact type is the one layer class
   ``get_transformer_layer_cls`` found **and every ``nn.Embedding`` when ``tie_word_embeddings`` is false**, then
   the root.  GLM4V's vision ``position_embedding`` is then read raw while sharded: ``aten.grid_sampler_2d.default
   got mixed torch.Tensor and DTensor`` (other auxiliary-embedding families: ``aten.add.Tensor`` /
   ``aten.copy_.default``).  ``inline_selection.method_seam`` installs ``fixes.inline_selection``'s two wrappers:
   one on the method publishes the model (its ``model`` parameter, found by name: ``core.calls``), one on the
   module's ``fully_shard`` drops the auxiliary embeddings (and a module inside one already sharded).  Its mesh
   (``(mp_replicate, mp_shard)``), mixed precision, offload and reshard arguments are kept; an untied input
   embedding the config flag hid gets a unit with the root call's arguments.
2. **Layer-class lookup** (``get_transformer_layer_cls``) reads ``model._no_split_modules`` only when that is a
   list or tuple; transformers 5.x makes it a set, so the lookup falls back to ``model.model.layers[0]`` and every
   VLM / audio LM (and every ``PeftModel``) logs "Could not identify Transformer Layer class": the whole model is
   one root unit.  ``selection.layer_class_seam`` applies upstream's list rule (the first listed class met in
   ``named_modules()``) to a set; lists, tuples, ``None`` and no match run upstream's code.  That is exactly 0.9.5
   on transformers 4.x, no more: one layer class, for every VLM here the *vision* block, so the decoder layers stay
   in the root unit (real-size GLM-4.5V: 98.8 % of the parameters in the root unit with it, 99.4 % without;
   Qwen2.5-7B text 7.2 % either way).  It fixes ``PeftModel`` text models on 5.x; VLMs get a vision-layer unit.

The crash fix does not need the lookup fix, nor the reverse (with the lookup alone LFM2-VL fails at wrap time: the
first listed class is ``Siglip2VisionEmbeddings`` and upstream then shards its child ``position_embedding``). Every
selection patch carries both; ``qwen3vl``, ``qwen2vl`` and ``qwen35`` carry the lookup alone (without it Qwen3-VL's
vision blocks stay in the root unit and in bf16 its first image forward fails, ``mixed dtype (CPU)`` in a vision
LayerNorm: ``tests/integrations/test_grad_accumulation.py``).

Upstream: main rewrote ``get_transformer_layer_cls`` in PR #10656 (2026-07-31; every ``.layers`` / ``.blocks``
class), in no release.  Main still gives every untied ``nn.Embedding`` a unit: the next release needs the selection
target under a new fingerprint (main's ``prepare_model`` adds ``ignored_params``: check then the arguments of an
untied input embedding the seam adds).  The rule is SkyRL's fix (issue #2087 / PR #2088).

Fails safe: each target applies only on its recorded fingerprint (else refused, nothing touched);
``inline_selection.method_seam`` raises ``Drift`` when ``fully_shard`` is not a module global; outside a
``prepare_model`` call the ``fully_shard`` wrapper is a pass-through.  Delete the selection target when a release
selects only layer classes and the untied input embedding, the lookup target when one accepts any iterable
``_no_split_modules`` (PR #10656 released: its ``fixed_in``).
"""

from ..core.records import Integration, Target
from ..fixes import LAYER_CLASS_LOOKUP as LOOKUP, WRAP_SELECTION as SELECTION

FSDP2 = "llamafactory.v1.plugins.trainer_plugins.distributed.fsdp2"

INTEGRATION = Integration(
    dist="llamafactory",
    package="llamafactory",
    wrap_module=FSDP2,
    callers=(),  # hub.py imports FSDP2Engine inside a function: nothing to rebind
)

_NO_ENGINE = {
    "<0.9.4": "no llamafactory.v1 package (the v0 trainer uses HF Trainer / accelerate FSDP)",
    "==0.9.4": "llamafactory.v1 has no FSDP2 engine (distributed/: accelerate.py, deepspeed.py only)",
}

WRAP_SELECTION = Target(
    dist="llamafactory",
    module=FSDP2,
    attr="FSDP2Engine.prepare_model",
    versions="==0.9.5",
    fingerprints={"0.9.5": "a44f2891e2a82f49"},
    fix=SELECTION,
    via="inline loop in a method",
    what="FSDP2 wrap selection (inline loop in FSDP2Engine.prepare_model)",
    declared=_NO_ENGINE,
    diff="wrap-selection",
)

LAYER_CLASS_LOOKUP = Target(
    dist="llamafactory",
    module=FSDP2,
    attr="get_transformer_layer_cls",
    versions="==0.9.5",
    fingerprints={"0.9.5": "0bc1a37af15029f1"},
    fix=LOOKUP,
    what="FSDP2 layer-class lookup (ignores a set _no_split_modules)",
    declared=_NO_ENGINE,
    diff="wrap-selection",
)

TARGETS = (WRAP_SELECTION, LAYER_CLASS_LOOKUP)
