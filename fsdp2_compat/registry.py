"""The catalogue: every patch users can name, the model types it is for, and its targets.

Read top to bottom, this file is the product's feature list.  Patches are
named after the model family a user trains, because that is what they know
when they hit the crash; families that fail for the same reason share the
same targets, which are applied once.

Each patch lists the transformers ``model_type`` values it covers: the one
map from a model to its patch.  ``fsdp2-compat list`` and ``check``, the
auditor's advice, the tests' parametrisations and the README table are
derived from it (``for_model_type``, ``selection_model_types``).

Rules that need the whole catalogue live here too (``siblings``).
"""

from .integrations import (accelerate, areal, axolotl, llamafactory, lmms_engine, skyrl, torch_fsdp,
                           transformers_media, transformers_moe, trl, verl)
from .core.records import Patch

# LLaMA-Factory 0.9.5's layer-class lookup, which ignores transformers 5.x's set _no_split_modules:
# no layer class is found, so a VLM's vision blocks stay in the root unit (Qwen3-VL in bf16 then
# stops at its first image forward).  Carried with the selection, and by the VLM patches without it.
LF_LAYER_LOOKUP = (llamafactory.LAYER_CLASS_LOOKUP,)

# The corrected FSDP2 wrap selection, in every framework release that has the bug
# (LLaMA-Factory: with its layer-class lookup).
SELECTION = (verl.WRAP_SELECTION_INLINE, verl.WRAP_SELECTION, skyrl.SKYRL, skyrl.SKYRL_TRAIN,
             areal.WRAP_SELECTION, llamafactory.WRAP_SELECTION, lmms_engine.WRAP_SELECTION)
WRAP_SELECTION = SELECTION + LF_LAYER_LOOKUP

# torch FSDP2's gradient accumulation when a micro-batch leaves a unit unused
# (a text-only micro-batch of a VLM; an lm_head read with full_tensor()):
# carried by every multimodal patch.
GRAD_ACCUMULATION = torch_fsdp.GRAD_ACCUMULATION

_LF_REFS = ("LLaMA-Factory PR #10656 (layer-class lookup, main only)",)
_SELECTION_REFS = ("SkyRL issue #2087", "SkyRL PR #2088") + _LF_REFS
_SELECTION_DELETE = (
    "when every framework release you run selects only layer classes and the untied "
    "input embedding for their own FSDP2 groups (SkyRL PR #2088 released; verl has no fix yet)"
)

_LM_HEAD_REFS = ("verl issue #4756", "verl PR #6659")
_LM_HEAD_DELETE = (
    "when verl's fused forwards gather lm_head.weight with a data-parallel-averaged "
    "gradient (not plain full_tensor()) in every release you run"
)


# Mixed text/image micro-batches across ranks: the transformers forwards that skip the vision tower
# on a text-only micro-batch, per family (fsdp2_compat.fixes.mixed_media).  Every target, for the tooling:
# transformers' forwards, and the trainers' own forwards that replace them without a dummy (lmms-engine's)
MIXED_MEDIA = transformers_media.TARGETS + lmms_engine.MIXED_MEDIA
_MIXED_REFS = ("TRL issue #3934", "torchtitan issue #4777")
_MIXED_DELETE = ("when transformers keeps every rank in the vision tower's collectives on text-only micro-batches in "
                 "every release you run")

# MoE experts one rank's tokens never reach (transformers 4.x keeps experts in a loop that skips them):
# FSDP2's units that hold them reduce every expert (fsdp2_compat.fixes.experts).  With a bf16 policy and
# deferred sync the zeros meet accumulated fp32 gradients, so torch's accumulation fix comes with them.
MOE_EXPERTS = transformers_moe.TARGETS
_MOE_REFS = ("pytorch issue #171355", "SkyRL issue #1297", "SkyRL PR #1370")
_MOE_DELETE = "when every transformers you train MoE models with is >= 5.0 (3-D experts: every rank has every gradient)"

_ACCUM_REFS = ("pytorch issue #196996", "pytorch PR #194058", "verl PR #7475", "verl issue #7520")
_ACCUM_DELETE = "when every torch you run is >= 2.15.0 (FSDP2 accumulation rewritten around grad_dtype)"

# TRL's reads of lm_head.weight outside its forward (fused LM head, distillation): the
# unaveraged gradient on every untied VLM whose tail unit accelerate leaves without a norm.
TRL = trl.TARGETS
_TRL_DELETE = "when TRL reads lm_head.weight through FSDP (not plain full_tensor()) in every release you run"

# axolotl's fused LoRA kernels read a DoRA magnitude with plain full_tensor() (any model axolotl trains with DoRA and
# its qkv / o / embedding kernels on FSDP2): carried with TRL's reads, by every patch whose families train through
# accelerate (the trainers axolotl, TRL and the HF Trainer share).  Its delete condition is in its integration module.
AXOLOTL = axolotl.TARGETS

# accelerate's FSDP2 tail unit (under the HF Trainer, TRL, axolotl): 1.14.0 leaves a tied head in the root unit
# (every tied model: textlm too), 1.14.0-1.15.0 leave a VLM's head alone without its decoder's norm.
ACCELERATE_TIED = (accelerate.TIED_TAIL,)
ACCELERATE = accelerate.TARGETS
_ACC_REFS = ("accelerate PR #4015", "accelerate PR #4171")
_ACC_DELETE = ("when every accelerate you run is >= 1.15.0 and its _find_final_norm finds a VLM decoder's norm")

_LF_DELETE = "when LLaMA-Factory's layer-class lookup reads a set _no_split_modules (main: PR #10656) in your release"


def _selection_patch(name, summary, model_types, extra=(), delete_when=_SELECTION_DELETE, mixed=()):
    """A multimodal family whose problem is the wrap selection (plus ``extra`` targets, torch's
    accumulation fix, and its ``mixed`` text/image ranks targets, if the fix knows its tower)."""
    return Patch(name, summary, model_types, WRAP_SELECTION + tuple(extra) + GRAD_ACCUMULATION + tuple(mixed),
                 _SELECTION_REFS + _ACCUM_REFS + (_MIXED_REFS if mixed else ()),
                 delete_when + "; and " + _ACCUM_DELETE + ("; and " + _MIXED_DELETE if mixed else ""))


PATCHES = (
    Patch(
        name="glm4v",
        summary="`aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor` at the first forward (the "
        "vision `position_embedding` is read raw); with verl's `use_fused_kernels`, also its sharded `lm_head.weight` read; "
        "and verl's own GLM-4.1V forward fails outside transformers 5.0.0rc0-rc3 (`'BaseModelOutputWithPooling' object "
        "has no attribute 'shape'` on 5.x, a 3-vs-4 size mismatch on 4.x)",
        model_types={"glm4v": "GLM-4.1V", "glm4v_moe": "GLM-4.5V", "glm46v": "GLM-4.6V"},
        # verl serves GLM-4.5V / GLM-4.6V (glm4v_moe) through dense_common's fused forward.
        # verl's own GLM-4.1V forward runs on the transformers verl admits only with GLM4V_FORWARD.
        targets=(WRAP_SELECTION + verl.GLM4V_FORWARD + verl.GLM4V_FUSED + verl.DENSE_FUSED + TRL + AXOLOTL + ACCELERATE
                 + GRAD_ACCUMULATION + transformers_media.GLM4V + transformers_moe.GLM4V_MOE),
        references=_SELECTION_REFS + _LM_HEAD_REFS + _ACC_REFS + _ACCUM_REFS + _MIXED_REFS + _MOE_REFS,
        delete_when=(_SELECTION_DELETE + "; and " + _LM_HEAD_DELETE + "; and " + _TRL_DELETE + "; and " + _ACC_DELETE
                     + "; and " + _ACCUM_DELETE + "; and " + _MIXED_DELETE + "; and, for GLM-4.5V, " + _MOE_DELETE),
    ),
    Patch(
        name="qwen3vl",
        summary="verl fused kernels: `aten.mm.default` mixed Tensor/DTensor (0.7.1-0.8.0); silently **unaveraged "
        "`lm_head` gradient** from plain `full_tensor()` (0.9.x), and with a bf16 policy a dtype-mismatch crash",
        model_types={"qwen3_vl": "Qwen3-VL", "qwen3_vl_moe": "Qwen3-VL-MoE"},
        targets=(verl.QWEN3_VL_FUSED + TRL + AXOLOTL + ACCELERATE + LF_LAYER_LOOKUP + GRAD_ACCUMULATION
                 + transformers_media.QWEN3_VL + verl.QWEN3_VL_FORWARD
                 + (lmms_engine.QWEN3_VL_OPS, lmms_engine.QWEN3_VL_MOE_OPS)),
        references=_LM_HEAD_REFS + _ACC_REFS + _LF_REFS + _ACCUM_REFS + _MIXED_REFS,
        delete_when=(_LM_HEAD_DELETE + "; and " + _TRL_DELETE + "; and " + _ACC_DELETE + "; and " + _LF_DELETE + "; and "
                     + _ACCUM_DELETE + "; and " + _MIXED_DELETE),
    ),
    Patch(
        name="qwen2vl",
        summary="verl fused kernels: `aten.mm.default` mixed Tensor/DTensor (the sharded `lm_head.weight` is read "
        "raw)",
        model_types={"qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL"},
        targets=(verl.QWEN2_VL_FUSED + TRL + AXOLOTL + ACCELERATE + LF_LAYER_LOOKUP + GRAD_ACCUMULATION
                 + transformers_media.QWEN2_VL + verl.QWEN2_VL_FORWARD + (lmms_engine.QWEN2_5_VL_OPS,)),
        references=_LM_HEAD_REFS + _ACC_REFS + _LF_REFS + _ACCUM_REFS + _MIXED_REFS,
        delete_when=(_LM_HEAD_DELETE + "; and " + _TRL_DELETE + "; and " + _ACC_DELETE + "; and " + _LF_DELETE + "; and "
                     + _ACCUM_DELETE + "; and " + _MIXED_DELETE),
    ),
    Patch(
        name="qwen35",
        summary="verl fused kernels: unaveraged `lm_head` gradient (plain `full_tensor()`)",
        model_types={"qwen3_5": "Qwen3.5", "qwen3_5_moe": "Qwen3.5-MoE"},
        targets=(verl.QWEN3_5_FUSED + TRL + AXOLOTL + ACCELERATE + LF_LAYER_LOOKUP + GRAD_ACCUMULATION
                 + transformers_media.QWEN3_5),
        references=_LM_HEAD_REFS + _ACC_REFS + _LF_REFS + _ACCUM_REFS + _MIXED_REFS,
        delete_when=(_LM_HEAD_DELETE + "; and " + _TRL_DELETE + "; and " + _ACC_DELETE + "; and " + _LF_DELETE + "; and "
                     + _ACCUM_DELETE + "; and " + _MIXED_DELETE),
    ),
    Patch(
        name="textlm",
        summary="verl fused kernels: `aten.mm.default` mixed Tensor/DTensor (the sharded `lm_head.weight` is read raw)",
        model_types={"qwen2": "Qwen2 / Qwen2.5", "qwen3": "Qwen3", "llama": "Llama"},
        note="and any other text-only causal LM verl serves through its dense_common fused forward; TRL's "
        "lm_head reads are gathered too (text models are already right under accelerate, whose tail unit holds "
        "the final norm)",
        targets=verl.DENSE_FUSED + TRL + AXOLOTL + ACCELERATE_TIED,
        references=_LM_HEAD_REFS + _ACC_REFS,
        delete_when=_LM_HEAD_DELETE + "; and " + _TRL_DELETE + "; and when every accelerate you run is >= 1.15.0",
    ),
    Patch(
        name="moe",
        summary="transformers 4.x: a MoE expert one rank's tokens never reach has no gradient there, so the ranks' "
        "reduce-scatters differ in size inside its FSDP2 unit (gloo `Received data size doesn't match expected "
        "size`; NCCL hangs, or completes with wrong gradients)",
        model_types={"qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE / Qwen1.5-MoE", "mixtral": "Mixtral",
                     "deepseek_v2": "DeepSeek-V2", "deepseek_v3": "DeepSeek-V3", "glm4_moe": "GLM-4.5 / GLM-4.6"},
        note="the text MoE families; GLM-4.5V's experts come with the glm4v patch, and Qwen3-VL-MoE and "
        "Qwen3.5-MoE keep 3-D experts in every release (nothing to fix). Also carries textlm's targets (verl's fused "
        "text forward, TRL's reads, accelerate 1.14.0's tied tail)",
        targets=transformers_moe.TEXT + GRAD_ACCUMULATION + verl.DENSE_FUSED + TRL + AXOLOTL + ACCELERATE_TIED,
        references=_MOE_REFS + _ACCUM_REFS + _LM_HEAD_REFS + _ACC_REFS,
        delete_when=(_MOE_DELETE + "; and " + _ACCUM_DELETE + "; and " + _LM_HEAD_DELETE + "; and " + _TRL_DELETE
                     + "; and when every accelerate you run is >= 1.15.0"),
    ),
    _selection_patch(
        "lfm2vl",
        "wrap-time `RuntimeError: Cannot concatenate overlapping meshes` (transformers 5.x), or a mixed "
        "Tensor/DTensor read of the SigLIP2 `position_embedding` (untied checkpoints)",
        {"lfm2_vl": "LFM2-VL"},
        TRL + AXOLOTL + ACCELERATE,
        _SELECTION_DELETE + "; and " + _TRL_DELETE + "; and " + _ACC_DELETE,
        mixed=transformers_media.LFM2_VL,
    ),
    _selection_patch(
        "qwen2audio",
        "wrap-time overlapping-mesh error (nested layer classes), then an `aten.add.Tensor` mixed read of "
        "`embed_positions.weight`",
        {"qwen2_audio": "Qwen2-Audio"},
        mixed=transformers_media.QWEN2_AUDIO,
    ),
    _selection_patch(
        "voxtral",
        "`aten.add.Tensor got mixed torch.Tensor and DTensor` (audio `embed_positions` read raw)",
        {"voxtral": "Voxtral"},
        mixed=transformers_media.VOXTRAL,
    ),
    _selection_patch(
        "audioflamingo3",
        "as Qwen2-Audio: wrap-time overlapping-mesh error, then an `aten.add.Tensor` mixed read",
        {"audioflamingo3": "AudioFlamingo3"},
        mixed=transformers_media.AUDIOFLAMINGO3,
    ),
    _selection_patch(
        "paddleocrvl",
        "`aten.add.Tensor got mixed torch.Tensor and DTensor` (vision `position_embedding` read raw; transformers "
        "< 5.15, from 5.15.0 it is called as a module)",
        {"paddleocr_vl": "PaddleOCR-VL"},
        TRL + AXOLOTL + ACCELERATE,
        _SELECTION_DELETE + "; and " + _TRL_DELETE + "; and " + _ACC_DELETE,
        mixed=transformers_media.PADDLEOCR_VL,
    ),
    # Families new in transformers 5.1x (tiny models: fsdp2_compat/tooling/tiny/recent.py).
    _selection_patch(
        "hunyuanvl",
        "`aten.add.Tensor got mixed torch.Tensor and DTensor` (untied checkpoints: the vision "
        "`position_embedding.weight` is sliced raw in `interpolate_pos_encoding`)",
        {"hunyuan_vl": "HunYuan-VL / HunyuanOCR"},
        mixed=transformers_media.HUNYUAN_VL,
    ),
    _selection_patch(
        "step3p7",
        "`aten.add.Tensor got mixed torch.Tensor and DTensor` (the vision tower always interpolates its "
        "`position_embedding.weight`); SkyRL cannot take its config at all (it reads a top-level "
        "`tie_word_embeddings` the config class lacks: `AttributeError`, patched or not)",
        {"step3p7": "Step-3.7"},
        mixed=transformers_media.STEP3P7,
    ),
    _selection_patch(
        "glmimage",
        "wrap-time `RuntimeError: Cannot concatenate overlapping meshes` (the VQ codebook inside a layer class) "
        "and, on one rank, `aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor` (GLM4V-style "
        "`position_embedding`)",
        {"glm_image": "GLM-Image"},
        mixed=transformers_media.GLM_IMAGE,
    ),
    _selection_patch(
        "cosmos3",
        "`aten.add.Tensor got mixed torch.Tensor and DTensor` (SigLIP2-style vision `position_embedding` read raw)",
        {"cosmos3_edge": "Cosmos-3 Edge"},
        mixed=transformers_media.COSMOS3_EDGE,
    ),
    _selection_patch(
        "deepseekocr2",
        "`aten.cat.default got mixed torch.Tensor and DTensor` (the vision encoder's query tables are read raw)",
        {"deepseek_ocr2": "DeepSeek-OCR-2"},
        mixed=transformers_media.DEEPSEEK_OCR2,
    ),
    _selection_patch(
        "chameleon",
        "wrap-time `RuntimeError: Cannot concatenate overlapping meshes` (transformers 5.x: the VQ codebook "
        "inside a layer class); on 4.57 `aten.add.Tensor got mixed torch.Tensor and DTensor` (the codebook read raw)",
        {"chameleon": "Chameleon"},
        mixed=transformers_media.CHAMELEON,
    ),
)

_BY_NAME = {p.name: p for p in PATCHES}


def symptoms(p):
    """What ``p`` fixes, each symptom once: the family's own summary, then the symptoms its shared
    targets own (TRL's reads, LLaMA-Factory's lookup, torch's accumulation), in target order."""
    out = [p.summary]
    for t in p.targets:
        if t.symptom and t.symptom not in out:
            out.append(t.symptom)
    return out


def names():
    return tuple(p.name for p in PATCHES)


def patch(name):
    return _BY_NAME[name]


def register(p):
    """Add ``p`` to the catalogue for this process (tooling and tests: a transient patch, e.g.
    an exact subset of targets); returns it.  ``ValueError`` if the name is taken."""
    global PATCHES
    if p.name in _BY_NAME:
        raise ValueError("a patch named %r is already in the catalogue" % p.name)
    PATCHES = PATCHES + (p,)
    _BY_NAME[p.name] = p
    return p


def unregister(name):
    """Remove a patch ``register`` added (no error if it is not there)."""
    global PATCHES
    if _BY_NAME.pop(name, None) is not None:
        PATCHES = tuple(p for p in PATCHES if p.name != name)


def targets():
    """Every distinct target, in catalogue order."""
    seen, out = set(), []
    for p in PATCHES:
        for t in p.targets:
            if t.key not in seen:
                seen.add(t.key)
                out.append(t)
    return out


def import_installed_targets(keys=None):
    """Import the module of every target (only ``keys``, when given) whose distribution is installed.

    What ``status`` does so that each outcome is real, not "waiting".  Returns ``(modules imported,
    {module: "Type: message"} for each that raised)``; never raises.
    """
    import sys

    from .core import guards

    imported, errors = [], {}
    for target in targets():
        if keys is not None and target.key not in keys:
            continue
        if guards.installed_version(target.dist) is None or target.module in errors:
            continue
        if target.module not in sys.modules:
            try:
                __import__(target.module)
            except Exception as exc:  # reported, never raised: status must always print
                errors[target.module] = "%s: %s" % (type(exc).__name__, exc)
                continue
        if target.module not in imported:
            imported.append(target.module)
    return imported, errors


def for_model_type(model_type):
    """The patch listed for ``model_type`` (a transformers ``config.model_type``), or None.

    transformers spells a few types with a hyphen in some releases (``lfm2-vl``
    in 4.57, ``lfm2_vl`` in 5.x); the catalogue uses underscores.
    """
    key = (model_type or "").replace("-", "_")
    for p in PATCHES:
        if key in p.model_types:
            return p
    return None


def fixes_selection(p):
    """True when patch ``p`` carries the corrected wrap selection (the lookup alone is not one)."""
    keys = {t.key for t in SELECTION}
    return any(t.key in keys for t in p.targets)


def selection_model_types():
    """``{model_type: patch name}`` for every model type whose patch corrects the wrap selection."""
    return {mt: p.name for p in PATCHES if fixes_selection(p) for mt in p.model_types}


def seam_kind(target):
    """What a target fixes, without the layout note: ``"FSDP2 wrap selection (inline loop)"`` -> ``"FSDP2 wrap selection"``."""
    return target.what.split(" (")[0]


def siblings(target, patch_names):
    """The other targets of ``patch_names`` that are alternative layouts of ``target``'s fix.

    verl's wrap selection moved from an inline loop (``apply_fsdp2``, up to
    0.7.0) to ``_select_fsdp2_wrap_targets`` (0.7.1+): a patch carries one
    target per code layout, and any release's code fits only one of them.
    The other is then "another seam", not a refusal (``core.policy``).  Only
    targets that say so (the same ``Target.layout`` in the same module) are
    alternatives: two targets a release needs both (verl's torch and triton
    fused forwards, LLaMA-Factory's selection and its lookup) each need their
    own code to fit.
    """
    if target.layout is None:
        return []
    out = []
    for name in sorted(patch_names):
        for other in patch(name).targets:
            if (other is not target and other.layout == target.layout and other.dist == target.dist
                    and other.module == target.module and other not in out):
                out.append(other)
    return out
