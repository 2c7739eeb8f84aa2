"""The catalogue: every patch users can name, and the targets it needs.

Read top to bottom, this file is the product's feature list.  Patches are
named after the model family a user trains, because that is what they know
when they hit the crash; families that fail for the same reason share the
same targets, which are applied once.
"""

from .integrations import skyrl, verl
from .records import Patch

# The corrected FSDP2 wrap selection, in every framework release that has the bug.
WRAP_SELECTION = (verl.WRAP_SELECTION_INLINE, verl.WRAP_SELECTION, skyrl.SKYRL, skyrl.SKYRL_TRAIN)

_SELECTION_REFS = ("SkyRL issue #2087", "SkyRL PR #2088")
_SELECTION_DELETE = (
    "when every framework release you run selects only layer classes and the untied "
    "input embedding for their own FSDP2 groups (SkyRL PR #2088 released; verl has no fix yet)"
)

_LM_HEAD_REFS = ("verl issue #4756", "verl PR #6659")
_LM_HEAD_DELETE = (
    "when verl's fused forwards gather lm_head.weight with a data-parallel-averaged "
    "gradient (not plain full_tensor()) in every release you run"
)



def _selection_patch(name, summary, families):
    """A family whose only problem is the wrap selection."""
    return Patch(name, summary, families, WRAP_SELECTION, _SELECTION_REFS, _SELECTION_DELETE)


PATCHES = (
    Patch(
        name="glm4v",
        summary="aten.grid_sampler_2d got mixed torch.Tensor and DTensor (vision position_embedding read raw); "
        "verl fused forward reads a sharded lm_head.weight",
        families=("GLM-4.1V (Glm4v)", "GLM-4.5V (Glm4vMoe)", "GLM-4.6V (Glm46V)"),
        # verl serves GLM-4.5V / GLM-4.6V (glm4v_moe) through dense_common's fused forward.
        targets=WRAP_SELECTION + verl.GLM4V_FUSED + verl.DENSE_FUSED,
        references=_SELECTION_REFS + _LM_HEAD_REFS,
        delete_when=_SELECTION_DELETE + "; and " + _LM_HEAD_DELETE,
    ),
    Patch(
        name="qwen3vl",
        summary="verl fused forward: aten.mm mixed Tensor/DTensor (0.7.1-0.8.0) or unaveraged lm_head "
        "gradient from plain full_tensor() (0.9.x)",
        families=("Qwen3-VL", "Qwen3-VL-MoE"),
        targets=verl.QWEN3_VL_FUSED,
        references=_LM_HEAD_REFS,
        delete_when=_LM_HEAD_DELETE,
    ),
    Patch(
        name="qwen2vl",
        summary="verl fused forward reads a sharded lm_head.weight (aten.mm mixed Tensor/DTensor)",
        families=("Qwen2-VL", "Qwen2.5-VL"),
        targets=verl.QWEN2_VL_FUSED,
        references=_LM_HEAD_REFS,
        delete_when=_LM_HEAD_DELETE,
    ),
    Patch(
        name="qwen35",
        summary="verl fused forward: unaveraged lm_head gradient from plain full_tensor()",
        families=("Qwen3.5", "Qwen3.5-MoE"),
        targets=verl.QWEN3_5_FUSED,
        references=_LM_HEAD_REFS,
        delete_when=_LM_HEAD_DELETE,
    ),
    Patch(
        name="textlm",
        summary="verl fused forward for text-only models reads a sharded lm_head.weight (aten.mm mixed Tensor/DTensor)",
        families=("text-only causal LMs served by verl's dense_common (Qwen2/2.5/3, Llama, ...)",),
        targets=verl.DENSE_FUSED,
        references=_LM_HEAD_REFS,
        delete_when=_LM_HEAD_DELETE,
    ),
    _selection_patch(
        "lfm2vl",
        "fully_shard TypeError / aten.mm mixed Tensor and DTensor (SigLIP2 position_embedding read raw)",
        ("LFM2-VL (SigLIP2 vision)",),
    ),
    _selection_patch(
        "qwen2audio",
        "fully_shard overlapping-mesh error (nested layer classes) / aten.add mixed Tensor and DTensor "
        "(audio embed_positions read raw)",
        ("Qwen2-Audio",),
    ),
    _selection_patch(
        "voxtral",
        "aten.add got mixed torch.Tensor and DTensor (audio embed_positions read raw)",
        ("Voxtral",),
    ),
    _selection_patch(
        "audioflamingo3",
        "fully_shard overlapping-mesh error (nested layer classes) / aten.add mixed Tensor and DTensor "
        "(audio embed_positions read raw)",
        ("AudioFlamingo3",),
    ),
    _selection_patch(
        "paddleocrvl",
        "aten.add got mixed torch.Tensor and DTensor (vision position_embedding read raw)",
        ("PaddleOCR-VL",),
    ),
)

_BY_NAME = {p.name: p for p in PATCHES}


def names():
    return tuple(p.name for p in PATCHES)


def patch(name):
    return _BY_NAME[name]


def targets():
    """Every distinct target, in catalogue order."""
    seen, out = set(), []
    for p in PATCHES:
        for t in p.targets:
            if t.key not in seen:
                seen.add(t.key)
                out.append(t)
    return out
