"""The catalogue: every patch users can name, the model types it is for, and the fixes it needs.

Read top to bottom, this file is the product's feature list.  Patches are
named after the model family a user trains, because that is what they know
when they hit the crash; families that fail for the same reason share the
same fixes, whose targets are applied once.

A patch lists fixes (``fsdp2_compat.fixes``: one record per mechanism); its
targets, references and delete conditions are derived here by a join, never
written by hand: the targets of the integrations (``integrations.targets()``)
whose fix the patch lists and whose ``families`` include one of its model
types (or any model), in fix order; the references and delete conditions of
its fixes, in the same order.

Each patch lists the transformers ``model_type`` values it covers: the one
map from a model to its patch.  ``fsdp2-compat list`` and ``check``, the
auditor's advice, the tests' parametrisations and the README table are
derived from it (``for_model_type``, ``selection_model_types``).

Rules that need the whole catalogue live here too (``siblings``).
"""

from . import fixes as F
from . import integrations
from .core.records import Patch

_TARGETS = integrations.targets()


def targets_of(*fixes, model_types=None):
    """The integrations' targets of ``fixes``, in that order; only those whose ``families`` meet ``model_types``
    (or that are for any model) when it is given."""
    wanted = None if model_types is None else set(model_types)
    return tuple(t for fix in fixes for t in _TARGETS if t.fix is fix
                 and (wanted is None or t.families is None or wanted.intersection(t.families)))


def _patch(name, summary, model_types, fixes, note=""):
    """A catalogue patch: its targets, references and delete conditions joined from ``fixes``."""
    return Patch(name, summary, model_types, targets_of(*fixes, model_types=model_types),
                 tuple(dict.fromkeys(ref for fix in fixes for ref in fix.references)),
                 tuple(dict.fromkeys(fix.delete_when for fix in fixes)), note, fixes)


# The corrected FSDP2 wrap selection, with LLaMA-Factory's layer-class lookup (which ignores transformers 5.x's set
# _no_split_modules, so a VLM's vision blocks stay in the root unit: carried by the VLM patches without it too).
SELECTION = (F.WRAP_SELECTION, F.LAYER_CLASS_LOOKUP)
# What the trainers built on accelerate read outside a unit's forward (TRL's fused head and distillation, axolotl's
# DoRA kernels and KD trainer): carried by every patch whose families train through them.
TRAINER_READS = (F.TRL_HEAD_READS, F.DORA_MAGNITUDE, F.KD_HEAD)
# accelerate's FSDP2 tail unit: 1.14.0 leaves a tied head in the root unit (every tied model: textlm too),
# 1.14.0-1.15.0 leave a VLM's head alone without its decoder's norm.
ACCELERATE = (F.ACCELERATE_TIED_TAIL, F.ACCELERATE_VLM_NORM)
# What every multimodal patch carries: torch's accumulation over micro-batches that leave a unit unused, a tower
# unit first run frozen (LoRA warm-up, staged unfreezing), and the media tower kept in every rank's collectives.
MULTIMODAL = (F.GRAD_ACCUMULATION, F.FROZEN_FIRST_FORWARD, F.MIXED_MEDIA)

# Target groups the harness and the tests read (each a join, as the patches' own).
WRAP_SELECTION = targets_of(*SELECTION)
LF_LAYER_LOOKUP = targets_of(F.LAYER_CLASS_LOOKUP)
GRAD_ACCUMULATION = targets_of(F.GRAD_ACCUMULATION)
MIXED_MEDIA = targets_of(F.MIXED_MEDIA)


def _selection_patch(name, summary, model_types, extra=()):
    """A multimodal family whose problem is the wrap selection (plus ``extra`` fixes, torch's accumulation fix,
    and its media tower kept in every rank's collectives)."""
    return _patch(name, summary, model_types, SELECTION + tuple(extra) + MULTIMODAL)


PATCHES = (
    _patch(
        name="glm4v",
        summary="`aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor` at the first forward (the "
        "vision `position_embedding` is read raw); with verl's `use_fused_kernels`, also its sharded `lm_head.weight` read; "
        "and verl's own GLM-4.1V forward fails outside transformers 5.0.0rc0-rc3 (`'BaseModelOutputWithPooling' object "
        "has no attribute 'shape'` on 5.x, a 3-vs-4 size mismatch on 4.x)",
        model_types={"glm4v": "GLM-4.1V", "glm4v_moe": "GLM-4.5V", "glm46v": "GLM-4.6V"},
        # verl serves GLM-4.5V / GLM-4.6V (glm4v_moe) through dense_common's fused forward.
        # verl's own GLM-4.1V forward runs on the transformers verl admits only with GLM4V_FORWARD.
        fixes=SELECTION + (F.GLM4V_FORWARD, F.VERL_LM_HEAD) + TRAINER_READS + ACCELERATE + MULTIMODAL
        + (F.MOE_EXPERTS, F.MIXED_DTYPES),
    ),
    _patch(
        name="qwen3vl",
        summary="verl fused kernels: `aten.mm.default` mixed Tensor/DTensor (0.7.1-0.8.0); silently **unaveraged "
        "`lm_head` gradient** from plain `full_tensor()` (0.9.x), and with a bf16 policy a dtype-mismatch crash",
        model_types={"qwen3_vl": "Qwen3-VL", "qwen3_vl_moe": "Qwen3-VL-MoE"},
        # the media tower: transformers' forwards, lmms-engine's own (use_rmpad), verl's own (images and videos)
        fixes=(F.VERL_LM_HEAD,) + TRAINER_READS + ACCELERATE + (F.LAYER_CLASS_LOOKUP,) + MULTIMODAL + (F.VERL_MEDIA,),
    ),
    _patch(
        name="qwen2vl",
        summary="verl fused kernels: `aten.mm.default` mixed Tensor/DTensor (the sharded `lm_head.weight` is read "
        "raw)",
        model_types={"qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL"},
        fixes=(F.VERL_LM_HEAD,) + TRAINER_READS + ACCELERATE + (F.LAYER_CLASS_LOOKUP,) + MULTIMODAL + (F.VERL_MEDIA,),
    ),
    _patch(
        name="qwen35",
        summary="verl fused kernels: unaveraged `lm_head` gradient (plain `full_tensor()`)",
        model_types={"qwen3_5": "Qwen3.5", "qwen3_5_moe": "Qwen3.5-MoE"},
        fixes=(F.VERL_LM_HEAD,) + TRAINER_READS + ACCELERATE + (F.LAYER_CLASS_LOOKUP,) + MULTIMODAL,
    ),
    _patch(
        name="textlm",
        summary="verl fused kernels: `aten.mm.default` mixed Tensor/DTensor (the sharded `lm_head.weight` is read raw)",
        model_types={"qwen2": "Qwen2 / Qwen2.5", "qwen3": "Qwen3", "llama": "Llama"},
        note="and any other text-only causal LM verl serves through its dense_common fused forward (or "
        "transformers' native FSDP2 shards: Phi, whose final norm is not called `norm`); TRL's lm_head reads are "
        "gathered too (text models are already right under accelerate, whose tail unit holds the final norm)",
        fixes=(F.VERL_LM_HEAD,) + TRAINER_READS + (F.ACCELERATE_TIED_TAIL, F.NATIVE_TAIL),
    ),
    _patch(
        name="moe",
        summary="transformers 4.x: a MoE expert one rank's tokens never reach has no gradient there, so the ranks' "
        "reduce-scatters differ in size inside its FSDP2 unit (gloo `Received data size doesn't match expected "
        "size`; NCCL hangs, or completes with wrong gradients)",
        model_types={"qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE / Qwen1.5-MoE", "mixtral": "Mixtral",
                     "deepseek_v2": "DeepSeek-V2", "deepseek_v3": "DeepSeek-V3", "glm4_moe": "GLM-4.5 / GLM-4.6"},
        note="the text MoE families; GLM-4.5V's experts come with the glm4v patch, and Qwen3-VL-MoE and "
        "Qwen3.5-MoE keep 3-D experts in every release (nothing to fix). Also carries textlm's targets (verl's fused "
        "text forward, TRL's reads, accelerate 1.14.0's tied tail)",
        fixes=(F.MOE_EXPERTS, F.GRAD_ACCUMULATION, F.VERL_LM_HEAD) + TRAINER_READS + (F.ACCELERATE_TIED_TAIL,
                                                                                 F.NATIVE_TAIL, F.MIXED_DTYPES),
    ),
    _selection_patch(
        "lfm2vl",
        "wrap-time `RuntimeError: Cannot concatenate overlapping meshes` (transformers 5.x), or a mixed "
        "Tensor/DTensor read of the SigLIP2 `position_embedding` (untied checkpoints)",
        {"lfm2_vl": "LFM2-VL"},
        TRAINER_READS + ACCELERATE,
    ),
    _selection_patch(
        "qwen2audio",
        "wrap-time overlapping-mesh error (nested layer classes), then an `aten.add.Tensor` mixed read of "
        "`embed_positions.weight`",
        {"qwen2_audio": "Qwen2-Audio"},
    ),
    _selection_patch(
        "voxtral",
        "`aten.add.Tensor got mixed torch.Tensor and DTensor` (audio `embed_positions` read raw)",
        {"voxtral": "Voxtral"},
    ),
    _selection_patch(
        "audioflamingo3",
        "as Qwen2-Audio: wrap-time overlapping-mesh error, then an `aten.add.Tensor` mixed read",
        {"audioflamingo3": "AudioFlamingo3"},
    ),
    _selection_patch(
        "paddleocrvl",
        "`aten.add.Tensor got mixed torch.Tensor and DTensor` (vision `position_embedding` read raw; transformers "
        "< 5.15, from 5.15.0 it is called as a module)",
        {"paddleocr_vl": "PaddleOCR-VL"},
        TRAINER_READS + ACCELERATE,
    ),
    # Families new in transformers 5.1x.
    _selection_patch(
        "hunyuanvl",
        "`aten.add.Tensor got mixed torch.Tensor and DTensor` (untied checkpoints: the vision "
        "`position_embedding.weight` is sliced raw in `interpolate_pos_encoding`)",
        {"hunyuan_vl": "HunYuan-VL / HunyuanOCR"},
    ),
    _selection_patch(
        "step3p7",
        "`aten.add.Tensor got mixed torch.Tensor and DTensor` (the vision tower always interpolates its "
        "`position_embedding.weight`); SkyRL cannot take its config at all (it reads a top-level "
        "`tie_word_embeddings` the config class lacks: `AttributeError`, patched or not)",
        {"step3p7": "Step-3.7"},
    ),
    _selection_patch(
        "glmimage",
        "wrap-time `RuntimeError: Cannot concatenate overlapping meshes` (the VQ codebook inside a layer class) "
        "and, on one rank, `aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor` (GLM4V-style "
        "`position_embedding`)",
        {"glm_image": "GLM-Image"},
    ),
    _selection_patch(
        "cosmos3",
        "`aten.add.Tensor got mixed torch.Tensor and DTensor` (SigLIP2-style vision `position_embedding` read raw)",
        {"cosmos3_edge": "Cosmos-3 Edge"},
    ),
    _selection_patch(
        "deepseekocr2",
        "`aten.cat.default got mixed torch.Tensor and DTensor` (the vision encoder's query tables are read raw)",
        {"deepseek_ocr2": "DeepSeek-OCR-2"},
    ),
    _selection_patch(
        "chameleon",
        "wrap-time `RuntimeError: Cannot concatenate overlapping meshes` (transformers 5.x: the VQ codebook "
        "inside a layer class); on 4.57 `aten.add.Tensor got mixed torch.Tensor and DTensor` (the codebook read raw)",
        {"chameleon": "Chameleon"},
    ),
)

_BY_NAME = {p.name: p for p in PATCHES}


def symptom(target):
    """What a user sees without ``target``: its own (where its code path differs from its fix's), else its fix's."""
    return target.symptom or (target.fix.symptom if target.fix is not None else None)


def symptoms(p):
    """What ``p`` fixes, each symptom once: the family's own summary, then the symptoms its fixes own
    (TRL's reads, LLaMA-Factory's lookup, torch's accumulation), in target order."""
    out = [p.summary]
    for t in p.targets:
        if symptom(t) and symptom(t) not in out:
            out.append(symptom(t))
    return out


def names():
    return tuple(p.name for p in PATCHES)


def patch(name):
    return _BY_NAME[name]


def register(p):
    """Add ``p`` to the catalogue for this process (the harness and tests: a transient patch, e.g.
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
    return any(t.fix is F.WRAP_SELECTION for t in p.targets)


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
