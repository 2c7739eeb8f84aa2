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

PATCHES = (
    Patch(
        name="glm4v",
        summary="aten.grid_sampler_2d got mixed torch.Tensor and DTensor (vision position_embedding read raw)",
        families=("GLM-4.1V (Glm4v)", "GLM-4.5V (Glm4vMoe)", "GLM-4.6V (Glm46V)"),
        targets=WRAP_SELECTION,
        references=_SELECTION_REFS,
        delete_when=_SELECTION_DELETE,
    ),
    Patch(
        name="lfm2vl",
        summary="fully_shard TypeError / aten.mm mixed Tensor and DTensor (SigLIP2 position_embedding read raw)",
        families=("LFM2-VL (SigLIP2 vision)",),
        targets=WRAP_SELECTION,
        references=_SELECTION_REFS,
        delete_when=_SELECTION_DELETE,
    ),
    Patch(
        name="qwen2audio",
        summary="fully_shard TypeError / aten.add mixed Tensor and DTensor (audio embed_positions read raw)",
        families=("Qwen2-Audio",),
        targets=WRAP_SELECTION,
        references=_SELECTION_REFS,
        delete_when=_SELECTION_DELETE,
    ),
    Patch(
        name="voxtral",
        summary="aten.add got mixed torch.Tensor and DTensor (audio embed_positions.weight read raw)",
        families=("Voxtral",),
        targets=WRAP_SELECTION,
        references=_SELECTION_REFS,
        delete_when=_SELECTION_DELETE,
    ),
    Patch(
        name="audioflamingo3",
        summary="fully_shard TypeError / aten.add mixed Tensor and DTensor (audio embed_positions read raw)",
        families=("AudioFlamingo3",),
        targets=WRAP_SELECTION,
        references=_SELECTION_REFS,
        delete_when=_SELECTION_DELETE,
    ),
    Patch(
        name="paddleocrvl",
        summary="aten.add got mixed torch.Tensor and DTensor (vision position_embedding read raw)",
        families=("PaddleOCR-VL",),
        targets=WRAP_SELECTION,
        references=_SELECTION_REFS,
        delete_when=_SELECTION_DELETE,
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
