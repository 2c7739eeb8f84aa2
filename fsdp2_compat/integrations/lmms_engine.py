"""lmms-engine: the FSDP2 wrap selection (``apply_fsdp2``) and its own VLM forwards (``use_rmpad``).

Forwards: ``trainer_args.use_rmpad`` (with ``use_liger_kernel``, its example configs) makes its Liger monkey patch
(``apply_liger_kernel_to_qwen3_vl`` and siblings, ``MONKEY_PATCHER``) assign its own padding-free base-model forward
over transformers' (``Qwen3VLModel.forward = qwen3_vl_ops.model_forward``; Qwen2.5-VL's ``vl_model_forward``,
Qwen3-VL-MoE's and Qwen3.5's ``model_forward``; Qwen3.5's not covered, see ``MIXED_MEDIA``).  That replaces our
mixed-ranks wrapper on the class and runs the tower only when the micro-batch has ``pixel_values``: a text-only
rank skips every vision unit's collectives, NCCL hangs, gloo aborts.  The targets put the same wrapper
(``fixes.mixed_media.forward_seam``) on lmms-engine's function in its module before the monkey patch imports it
(by name, at call time), so the class holds the wrapped function; a request made after the patch still reaches
the class (``assigned_to``: replaced there too, said in ``status``, restored on revert).  Measured (0.1.4,
transformers 5.8.0, 2 CPU gloo ranks, tiny Qwen3-VL / Qwen3-VL-MoE / Qwen2.5-VL, rank 0 image / rank 1 text-only
and the reverse): unpatched gloo ``Received data size doesn't match expected size``; patched, every gradient equals
the unsharded data-parallel reference (``tests/integrations/test_lmms_engine_forwards.py``); Qwen3-VL with an
image+video rank too (``fixes.media_merge``).  Not fixed: Qwen2.5-VL's forward runs ``self.visual`` once per media
kind (an image+video micro-batch runs the tower twice); ``media_merge`` warns.

Selection: ``lmms_engine.utils.fsdp2_utils.apply_fsdp2(model, fsdp_kwargs, fsdp_transformer_layer_cls_to_wrap=None)``
selects every layer class **and every ``nn.Embedding`` when ``tie_word_embeddings`` is false**, then calls the
module-global ``fully_shard`` per selected module and the root (verl 0.4-0.7's loop): GLM-4.1V's vision
``position_embedding`` gets a unit, its parent reads ``.weight`` raw, ``aten.grid_sampler_2d.default got mixed
torch.Tensor and DTensor`` (every family ``registry.selection_model_types()`` lists fails as
``tests/integrations/test_wrap_selection.py`` records).  ``FSDP2SFTTrainer.prepare_model`` imports ``apply_fsdp2``
by name; the engine rebinds that alias.  Mechanism: AReaL's, SkyRL's and verl 0.4.0-0.7.0's seam
(``fixes.inline_selection``): ``apply_fsdp2`` is wrapped only to publish the model, and the ``fully_shard`` its
loop calls drops the auxiliary embeddings (left in the root unit) and nested layer classes; the rest is its own
code.  Not covered: its ``apply_parallelize`` path (TP/CP/EP, ``MODEL_TO_PARALLEL_METHOD``).  Not changed: with no
layer classes configured it takes ``model._no_split_modules`` (a set on transformers 5.x) and its own ``assert ...
[0]`` raises ``TypeError``; its example configs pass a list, as the tests do.

Importing: ``lmms_engine/utils/__init__.py`` imports deepspeed, datasets and librosa; ``fsdp2_utils`` needs only
torch.  The pinned test set installs lmms-engine ``--no-deps`` and imports the released file with that package
``__init__`` skipped (the harness's ``frameworks.import_fsdp_utils``).

Releases: 0.1.2 and 0.1.4 (the only ones on PyPI) share ``apply_fsdp2``'s code (0.1.4 proven).  No upstream issue;
the rule is SkyRL's fix (issue #2087 / PR #2088).  Fails safe: applied only where ``apply_fsdp2``'s fingerprint is
recorded and ``fully_shard`` is a module global (else refused, nothing touched); outside an ``apply_fsdp2`` call the
``fully_shard`` wrapper is a pass-through.  Delete when lmms-engine selects only layer classes and the untied input
embedding (the fingerprint then changes and the target refuses itself).
"""

from ..core.records import Integration, Target
from ..fixes import MIXED_MEDIA as MIXED, WRAP_SELECTION as SELECTION

FSDP2_UTILS = "lmms_engine.utils.fsdp2_utils"

INTEGRATION = Integration(
    dist="lmms-engine",
    package="lmms_engine",
    wrap_module=FSDP2_UTILS,
    callers=("lmms_engine.train.fsdp2.fsdp2_trainer",),  # FSDP2SFTTrainer.prepare_model
)

WRAP_SELECTION = Target(
    dist="lmms-engine",
    module=FSDP2_UTILS,
    attr="apply_fsdp2",
    versions="==0.1.4",
    fingerprints={"0.1.2-0.1.4": "40512dfcfb7c0aca"},
    fix=SELECTION,
    via="inline loop",
    what="FSDP2 wrap selection (inline loop)",
    diff="wrap-selection",
)


# --- its own padding-free VLM forwards (use_rmpad) ---------------------------------------------------------------

_OPS_SYMPTOM = ("lmms-engine use_rmpad: one rank's micro-batch text-only and another's with an image: its own forward "
                "skips the vision tower, NCCL **hangs**, gloo aborts (`Received data size doesn't match expected size`)")
_OLDER = ("0.1.2 has the same text-only skip in other code (it pins transformers 4.57.1): not proven here; "
          "use 0.1.4")


def _ops(family, attr, fingerprint, base, older=_OLDER):
    """lmms-engine 0.1.4's padding-free base-model forward of ``family`` (``lmms_engine.models.<family>.<family>_ops``);
    0.1.2 has the same skip in other code (``older``), or no such module (``older=None``)."""
    return Target(
        dist="lmms-engine",
        module="lmms_engine.models.%s.%s_ops" % (family, family),
        attr=attr,
        versions="==0.1.4",
        fingerprints={"0.1.4": fingerprint},
        fix=MIXED,
        families=(family,),
        what="media tower skipped on a text-only micro-batch (lmms-engine's own %s forward)" % family,
        unsupported={"==0.1.2": older} if older else None,
        declared=None if older else {"<0.1.4": "no lmms_engine.models.%s (it arrived in 0.1.4)" % family},
        symptom=_OPS_SYMPTOM,
        # what its monkey patch assigns the function to: a request made after that still reaches the class
        assigned_to=("transformers.models.%s.modeling_%s:%s.forward" % (family, family, base),),
    )


QWEN3_VL_OPS = _ops("qwen3_vl", "model_forward", "b035bc80e4c8cd69", "Qwen3VLModel")
QWEN2_5_VL_OPS = _ops("qwen2_5_vl", "vl_model_forward", "16d59531d1d03640", "Qwen2_5_VLModel")
QWEN3_VL_MOE_OPS = _ops("qwen3_vl_moe", "model_forward", "9a9a004cf46bafcf", "Qwen3VLMoeModel", older=None)
# Not here: Qwen3.5's qwen3_5_ops.model_forward (0.1.4, fingerprint 44ff74d6063c727f) has the same skip, but its
# packed linear attention needs flash-linear-attention's CUDA kernels, so the fix was never run on it: no target
# until it is proven (docs/enable.md says so).
MIXED_MEDIA = (QWEN3_VL_OPS, QWEN2_5_VL_OPS, QWEN3_VL_MOE_OPS)
TARGETS = (WRAP_SELECTION,) + MIXED_MEDIA
