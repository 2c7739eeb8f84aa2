"""verl: where its FSDP2 wrap selection lives, release by release.

Module ``verl.utils.fsdp_utils``:
- 0.4.0-0.7.0 select inline in ``apply_fsdp2`` (every ``nn.Embedding`` when ``model.config.tie_word_embeddings`` is
  false) -> the ``fully_shard`` seam of ``fsdp2_compat.fixes.inline_selection``;
- 0.7.1-0.9.1 call ``_select_fsdp2_wrap_targets(model, layer_cls)`` by global name from ``apply_fsdp2`` -> replaced by
  ``fsdp2_compat.fixes.selection.select_verl``.

Callers import ``apply_fsdp2`` by name (``verl.workers.fsdp_workers``, ``verl.trainer.fsdp_sft_trainer``,
``verl.workers.engine.fsdp.*``); the engine rebinds those aliases.

To support a new release: widen ``versions`` and, if the function changed, add ``"<release>": "<fingerprint>"``
(``fsdp2-compat fingerprint FILE NAME``).

Module ``verl.models.transformers.glm4v`` (0.6.0+): verl's GLM-4.1V forward, whose ``_get_input_embeds`` /
``process_position_ids`` predate transformers 5.0's vision output object / postdate 4.x's 3-row rotary ids ->
``fsdp2_compat.fixes.glm4v_forward``.

Upstream: SkyRL issue #2087 / PR #2088 (the selection rule), verl issue #4756 / PR #6659 (lm_head reads), verl issues
#4095 / #6814 (GLM-4.1V forward failures). Fails safe (``fsdp2_compat.core.policy``): the code decides, not the
version. Code whose fingerprint is not listed is refused, with a warning naming the patch, the release and what to do,
and left untouched; a release outside ``versions`` whose code is a recorded release's is patched, and ``status`` says
it is outside the proven range (``FSDP2_COMPAT_STRICT=proven`` refuses it). Delete a target when ``fixed_in`` would
cover every release you run.
"""

from ..core.records import Integration, Target
from ..fixes import GLM4V_FORWARD as GLM4V_FIX, VERL_LM_HEAD, VERL_MEDIA, WRAP_SELECTION as SELECTION

FSDP_UTILS = "verl.utils.fsdp_utils"

INTEGRATION = Integration(
    dist="verl",
    package="verl",
    wrap_module=FSDP_UTILS,
    callers=(
        "verl.workers.fsdp_workers",  # 0.4.0-0.7.1
        "verl.trainer.fsdp_sft_trainer",  # 0.4.0-0.7.0
        "verl.workers.engine.fsdp.engine_impl",  # 0.5.0
        "verl.workers.engine.fsdp.transformer_impl",  # 0.6.0+
    ),
)

WRAP_SELECTION_INLINE = Target(
    dist="verl",
    module=FSDP_UTILS,
    attr="apply_fsdp2",
    versions=">=0.4.0,<0.7.1",
    fingerprints={"0.4.0-0.5.0": "c1723289c3265bd0", "0.6.0-0.7.0": "26f7091741f9b7e0"},
    fix=SELECTION,
    via="inline loop",
    what="FSDP2 wrap selection (inline loop)",
    diff="wrap-selection",
    layout="wrap selection",
    declared={
        "<0.4.0": "FSDP1 only: fsdp_utils has no apply_fsdp2",
        ">=0.7.1": "apply_fsdp2 calls _select_fsdp2_wrap_targets (the WRAP_SELECTION target)",
    },
)

WRAP_SELECTION = Target(
    dist="verl", module=FSDP_UTILS, attr="_select_fsdp2_wrap_targets", versions=">=0.7.1,<=0.9.1",
    fingerprints={"0.7.1-0.9.1": "fc0a593bafb6050f"}, fix=SELECTION, via="selection function",
    what="FSDP2 wrap selection", diff="wrap-selection", layout="wrap selection",
    declared={"<0.7.1": "the selection is inline in apply_fsdp2 (the WRAP_SELECTION_INLINE target)"},
)

# ---------------------------------------------------------------------------
# verl's GLM-4.1V forward (``verl/models/transformers/glm4v.py``, 0.6.0+), installed by
# ``apply_monkey_patch`` on every ``glm4v`` model, fused kernels or not.  It runs as
# released only on transformers 5.0.0rc0-rc3 (verl issues #4095 / #6814); see
# ``fsdp2_compat.fixes.glm4v_forward``.  Each seam reports "not needed" where the
# installed transformers does not need it.

GLM4V_MODULE = "verl.models.transformers.glm4v"
_NO_GLM4V = {"<0.6.0": "no verl/models/transformers/glm4v.py"}

GLM4V_FORWARD = (
    Target(
        dist="verl", module=GLM4V_MODULE, attr="_get_input_embeds", versions="==0.9.1",
        fingerprints={"0.6.0-0.7.1": "f2e8ade7673659c8", "0.8.0.dev0-0.9.1": "cddf133591ef1fd9"}, fix=GLM4V_FIX,
        via="vision output", families=("glm4v",),
        what="GLM-4.1V forward (vision output object, transformers >= 5.0.0)", diff="glm4v-forward",
        declared=_NO_GLM4V,
    ),
    Target(
        dist="verl", module=GLM4V_MODULE, attr="process_position_ids", versions=">=0.7.0,<=0.8.0",
        fingerprints={"0.6.0-0.9.1": "bccfd50e9f69d2fe"}, fix=GLM4V_FIX, via="position ids", families=("glm4v",),
        what="GLM-4.1V forward (4-row position ids, transformers < 5.0.0rc0)", diff="glm4v-forward",
        declared=_NO_GLM4V,
    ),
)

# verl's own Qwen-VL forwards (``verl/models/transformers/qwen2_vl.py`` / ``qwen3_vl.py``, installed by
# ``apply_monkey_patch`` on Qwen2-VL, Qwen2.5-VL and Qwen3-VL(-MoE), fused kernels or not, 0.6.0+) call
# ``model.visual`` in ``_get_input_embeds``: once for the images and again for the videos, so a rank with
# both kinds runs every vision unit's collectives twice where a rank with one kind runs them once (a hang;
# ``fsdp2_compat.fixes.verl_media`` runs the tower once).  The Qwen2-VL copy's text-only dummy also calls
# ``.mean()`` on what the tower returns: from transformers 5.0.0 a ``BaseModelOutputWithPooling``, so every
# text-only micro-batch raises ``AttributeError: 'BaseModelOutputWithPooling' object has no attribute
# 'mean'``; the same seam hands verl the ``pooler_output`` there (``glm4v_forward``'s rule).  Before 0.6.0
# verl left the vision tower to transformers' forward (the mixed-ranks targets cover it).
_NO_INPUT_EMBEDS = "no _get_input_embeds: verl's Qwen-VL forwards leave the vision tower to transformers' forward " \
                   "(covered by the mixed-ranks target)"
QWEN2_VL_FORWARD = (
    Target(
        dist="verl",
        module="verl.models.transformers.qwen2_vl",
        attr="_get_input_embeds",
        versions=">=0.7.0,<=0.9.1",
        fingerprints={"0.6.0-0.7.1": "bd15d2383d6b4d3b", "0.8.0.dev0-0.9.1": "b57eda559ec1a29a"},
        fix=VERL_MEDIA,
        via="qwen2_vl",
        families=("qwen2_vl", "qwen2_5_vl"),
        what="Qwen2-VL forward (images and videos: one tower call; transformers >= 5.0.0: the text-only "
             "dummy's vision output)",
        declared={"<0.6.0": _NO_INPUT_EMBEDS},
    ),
)
QWEN3_VL_FORWARD = (
    Target(
        dist="verl", module="verl.models.transformers.qwen3_vl", attr="_get_input_embeds", versions=">=0.7.0,<=0.9.1",
        fingerprints={"0.6.0-0.7.1": "bb55f0bd8adf8d38", "0.8.0.dev0-0.9.1": "c9f220af46137281"}, fix=VERL_MEDIA,
        via="qwen3_vl", families=("qwen3_vl", "qwen3_vl_moe"),
        what="Qwen3-VL forward (images and videos: one tower call)",
        declared={"<0.6.0": "no verl.models.transformers.qwen3_vl module"},
    ),
)


# ---------------------------------------------------------------------------
# Fused-kernel forwards (``use_fused_kernels=True``).  ``patch_forward_with_backends``
# imports ``forward_with_torch_backend`` / ``forward_with_triton_backend`` from
# these modules when the model is built and assigns one to the model class, so
# replacing the module attribute is enough.  Each reads ``self.lm_head.weight``
# raw (qwen3_vl 0.9.x and qwen3_5 call plain ``full_tensor()``: the gradient
# trap); the wrapper unshards ``lm_head`` through FSDP first, so upstream's
# read sees a plain, full, param_dtype tensor.  See fsdp2_compat.fixes.gather.

# Releases without the module (or whose module lost the forward), per verl model module.
_FUSED_DECLARED = {
    "qwen3_vl": {"<0.6.0": "no verl.models.transformers.qwen3_vl module"},
    "glm4v": {"<0.6.0": "no verl.models.transformers.glm4v module"},
    "qwen2_vl": {"<0.4.1": "no fused forwards before 0.4.1"},
    "qwen2_5_vl": {"<0.4.1": "no fused forwards before 0.4.1",
                   ">=0.6.0": "Qwen2.5-VL is served by the qwen2_vl module"},
    "dense_common": {"<0.4.1": "no verl.models.transformers.dense_common module"},
    "qwen3_5": {"<0.8.0.dev0": "no verl.models.transformers.qwen3_5 module"},
}


# The model types each fused-forward module serves (verl serves GLM-4.5V / GLM-4.6V and every text model through
# dense_common; before 0.6.0 Qwen2.5-VL had a module of its own).
_FAMILIES = {
    "qwen3_vl": ("qwen3_vl", "qwen3_vl_moe"),
    "glm4v": ("glm4v",),
    "qwen2_vl": ("qwen2_vl", "qwen2_5_vl"),
    "qwen2_5_vl": ("qwen2_5_vl",),
    "dense_common": ("glm4v_moe", "glm46v", "qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe", "mixtral",
                     "deepseek_v2", "deepseek_v3", "glm4_moe"),
    "qwen3_5": ("qwen3_5", "qwen3_5_moe"),
}


def _fused(model_module, backend, versions, fingerprints):
    return Target(
        dist="verl", module="verl.models.transformers." + model_module, attr="forward_with_%s_backend" % backend,
        versions=versions, fingerprints=fingerprints, fix=VERL_LM_HEAD, via="reader",
        families=_FAMILIES[model_module], what="fused forward reads lm_head.weight (%s backend)" % backend,
        diff="%s-lm-head" % model_module, declared=_FUSED_DECLARED[model_module],
    )


# Labels start at 0.8.0.dev0 where that pre-release on PyPI has 0.8.0's code.


QWEN3_VL_FUSED = (
    _fused("qwen3_vl", "torch", ">=0.6.0,<=0.9.1", {
        "0.6.0-0.7.1": "e6ea5557d4a41547", "0.8.0.dev0-0.8.0": "ee4406373c544b20", "0.9.0": "c4f71fadc8932585",
        "0.9.1": "52f8d02f0867bac8",
    }),
    _fused("qwen3_vl", "triton", ">=0.6.0,<=0.9.1", {
        "0.6.0-0.7.1": "d0bb3c5ea475719e", "0.8.0.dev0-0.9.1": "df840afb97131c82",
    }),
)

GLM4V_FUSED = (
    _fused("glm4v", "torch", ">=0.6.0,<=0.9.1", {
        "0.6.0-0.7.1": "603f0ce55900fffa", "0.8.0.dev0-0.9.0": "f488ad4f247f515f", "0.9.1": "bb84718af5f176ca",
    }),
    _fused("glm4v", "triton", ">=0.6.0,<=0.9.1", {
        "0.6.0-0.7.1": "0b726f2f4793bbb6", "0.8.0.dev0-0.9.1": "dcef062f8a09c0a1",
    }),
)

QWEN2_VL_FUSED = (
    _fused("qwen2_vl", "torch", ">=0.4.1,<=0.9.1", {
        "0.4.1": "1c7d5a1aacf6e489", "0.5.0": "f7638957d8603682", "0.6.0-0.7.1": "50c009c81d7a3b5d",
        "0.8.0.dev0-0.9.0": "038571ae2e42eb92", "0.9.1": "5c5de580e35d5f03",
    }),
    _fused("qwen2_vl", "triton", ">=0.4.1,<=0.9.1", {
        "0.4.1": "0215a5a95618f897", "0.5.0": "ed6cfe5f68e1b2df", "0.6.0-0.7.1": "30cd41ff9bb24d63",
        "0.8.0.dev0-0.9.1": "177192f600f209b0",
    }),
    # Before 0.6.0 Qwen2.5-VL had a module of its own.
    _fused("qwen2_5_vl", "torch", ">=0.4.1,<0.6.0", {"0.4.1": "ae4fafb6bb3cc703", "0.5.0": "536ed3517486ffd6"}),
    _fused("qwen2_5_vl", "triton", ">=0.4.1,<0.6.0", {"0.4.1": "6cbf8a53b63a1812", "0.5.0": "e2312912cf53f6c1"}),
)

DENSE_FUSED = (
    _fused("dense_common", "torch", ">=0.4.1,<=0.9.1", {
        "0.4.1": "9318d4277933edfb", "0.5.0-0.7.1": "c2d6c1e04d49c872", "0.8.0.dev0-0.9.0": "d15e06a479f4e49e",
        "0.9.1": "dc446b0fdc12cc42",
    }),
    _fused("dense_common", "triton", ">=0.4.1,<=0.9.1", {
        "0.4.1": "766a8ad945249975", "0.5.0-0.7.1": "c0489709bab6fbbd", "0.8.0.dev0-0.9.1": "5769699326e173d2",
    }),
)

QWEN3_5_FUSED = (
    _fused("qwen3_5", "torch", ">=0.8.0.dev0,<=0.9.1", {
        "0.8.0.dev0-0.8.0": "d8fbabf7125cb384", "0.9.0": "43c9d0c701f0e117", "0.9.1": "c575d244ecbc0505",
    }),
    _fused("qwen3_5", "triton", ">=0.8.0.dev0,<=0.9.1", {
        "0.8.0.dev0-0.8.0": "13a26f0a2447e294", "0.9.0-0.9.1": "86ad9675412832a6",
    }),
)

# verl 0.6.0-0.7.1's Ulysses SP callers roll the labels over the whole sequence but never pass them: the fused
# forwards above roll on what they get (``fixes.gather``'s docstring); 0.8.0 passes ``shift_labels`` (PR #6268).
_SP_FAMILIES = tuple(dict.fromkeys(_FAMILIES["qwen2_vl"] + _FAMILIES["qwen3_vl"] + _FAMILIES["glm4v"]
                                   + _FAMILIES["dense_common"]))
_SP_FIXED = "the engine passes shift_labels (the SP-sliced global roll) and the fused forwards use it (PR #6268)"


def _sp_caller(module, attr, fingerprints, declared, unsupported=None):
    return Target(dist="verl", module=module, attr=attr, versions="==0.7.0", fingerprints=fingerprints,
                  fix=VERL_LM_HEAD, via="sp caller", families=_SP_FAMILIES, unsupported=unsupported,
                  what="fused forward under Ulysses SP: labels rolled on the SP shard", declared=declared,
                  symptom="verl 0.6.0-0.7.1 fused kernels with Ulysses SP: log-probs against the wrong labels, "
                  "silently (a VLM: every SP rank but the first uses SP rank 0's labels; text: the last label of "
                  "every shard); the lm_head gradient off by ~0.1")


SP_CALLERS = (
    _sp_caller("verl.workers.actor.dp_actor", "DataParallelPPOActor._forward_micro_batch", {
        "0.6.0": "8ac5a6004ffc1953", "0.6.1": "0385faa4d7828908", "0.7.0": "bfb366295fb0fcce",
        "0.7.1": "90bb2b2b3d19a2e6",
    }, {"<0.4.1": "no fused forwards before 0.4.1", ">=0.8.0.dev0": "no dp_actor: " + _SP_FIXED},
        {">=0.4.1,<0.6.0": "the same forwards, but the caller decides 'VLM' by multi_modal_inputs in the micro-batch "
                           "(verl #2639: a VLM's text-only micro-batch is sliced twice)"}),
    _sp_caller("verl.workers.engine.fsdp.transformer_impl", "FSDPEngineWithLMHead.forward_step",
               {"0.6.0-0.6.1": "202aac30425c9ab6", "0.7.0-0.7.1": "2825e510786f2b0f"},
               {"<0.6.0": "no verl.workers.engine.fsdp.transformer_impl module", ">=0.8.0.dev0": _SP_FIXED}),
)

TARGETS = ((WRAP_SELECTION_INLINE, WRAP_SELECTION) + GLM4V_FORWARD + QWEN2_VL_FORWARD + QWEN3_VL_FORWARD + QWEN3_VL_FUSED
           + GLM4V_FUSED + QWEN2_VL_FUSED + DENSE_FUSED + QWEN3_5_FUSED + SP_CALLERS)
