"""AReaL: the FSDP2 wrap selection, inline in ``apply_fsdp2`` ("Adapted from verl").

Module ``areal.engine.fsdp_utils`` (``areal/engine/fsdp_utils/__init__.py``):
``apply_fsdp2(model, fsdp_kwargs, wrap_policy)`` is verl's 0.4-0.7 loop, with
AReaL's own normalisation of the layer-class list (a transformers 5.x *set*
``_no_split_modules`` is accepted, AReaL PR #1187).  It selects every module
whose class name is a layer class **and every ``nn.Embedding`` when
``model.config.tie_word_embeddings`` is false**, then calls the module-global
``fully_shard`` once per selected module and once for the root (inside its
own ``maybe_patch_fsdp_module``).  GLM4V's vision ``position_embedding`` then
gets a unit of its own, its parent reads ``.weight`` raw and the first
forward fails with ``aten.grid_sampler_2d.default got mixed torch.Tensor and
DTensor`` (Voxtral / PaddleOCR-VL / Qwen2-Audio / AudioFlamingo3:
``aten.add.Tensor``; LFM2-VL and the nested layer classes of Qwen2-Audio /
AudioFlamingo3: "Cannot concatenate overlapping meshes" at wrap time).

Mechanism: the same seam as verl 0.4.0-0.7.0 and SkyRL,
``fsdp2_compat.fixes.inline_selection``: ``apply_fsdp2`` is wrapped only to
publish the model, and the ``fully_shard`` its loop calls drops the
auxiliary embeddings (they stay in the root unit) and nested layer classes;
everything else, ``fsdp_kwargs`` (AReaL's mesh ``dp_sp``, mixed precision,
offload, ``reshard_after_forward``) included, is AReaL's own code.
``areal.engine.fsdp_utils.parallel`` (``parallelize_model``, what
``FSDPEngine`` calls) imports ``apply_fsdp2`` by name; the engine rebinds it.

Releases: 1.0.4 is the only release on PyPI; AReaL main (May 2026) still has
this exact function (same fingerprint).  No upstream issue or fix for AReaL;
the rule is SkyRL's fix (issue #2087 / PR #2088).

Fails safe: applied only where ``apply_fsdp2``'s fingerprint is the one
below and ``fully_shard`` is a module global (else refused with the reason,
nothing touched); outside an ``apply_fsdp2`` call the ``fully_shard`` wrapper
is a pass-through.  Delete when AReaL selects only layer classes and the
untied input embedding (the fingerprint then changes and the target refuses
itself; add the fixed release as ``fixed_in``).
"""

from ..core.records import Integration, Target
from ..fixes import WRAP_SELECTION as FIX

FSDP_UTILS = "areal.engine.fsdp_utils"

INTEGRATION = Integration(
    dist="areal",
    package="areal",
    wrap_module=FSDP_UTILS,
    callers=("areal.engine.fsdp_utils.parallel",),  # parallelize_model, called by FSDPEngine
)

WRAP_SELECTION = Target(
    dist="areal",
    module=FSDP_UTILS,
    attr="apply_fsdp2",
    versions="==1.0.4",
    fingerprints={"1.0.4": "c4a4502294081efc"},
    fix=FIX,
    via="inline loop",
    what="FSDP2 wrap selection (inline loop)",
    diff="wrap-selection",
)

TARGETS = (WRAP_SELECTION,)
