"""transformers: the base model forwards that skip the media tower on a text-only micro-batch.

One target per family: ``transformers.models.<family>.modeling_<family>``, ``<Family>Model.forward`` (the module under
``<Family>ForConditionalGeneration.model`` that runs the token embedding, then the vision tower when it is given
media: ``pixel_values`` / ``pixel_values_videos``).  The fix code is ``fsdp2_compat.fixes.mixed_media`` (why this
seam, the mechanism, how it fails safe); what it knows of each tower (attribute, media arguments, the smallest valid
dummy) is ``fsdp2_compat.fixes.media_towers``.

Families: the Qwen/GLM patch-grid towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), GLM-4.1V/4.5V/4.6V, Qwen3.5(-MoE)),
PaddleOCR-VL (unflattened patches, same grid), LFM2-VL (SigLIP2 NaFlex ``vision_tower``), and the Whisper-style
``audio_tower`` of Qwen2-Audio, Voxtral and AudioFlamingo3 (media ``input_features``; the outer class's forward runs
the tower until 5.9.0, ``<Family>Model.forward`` from 5.10.0: two targets each, each declaring the other's releases),
and, new in transformers 5.1x, HunYuan-VL (from 5.13.0, ``vision_tower``) and Cosmos-3 Edge (from 5.15.0, ``visual``):
flat patches with the same grid; Step-3.7 (from 5.16.0, ``vision_model``: square views, and a second tower call for
local crops); Chameleon (``vqmodel``: a VQ-VAE encoder whose codes the token embedding embeds); DeepSeek-OCR-2 (from
5.10.1, ``vision_tower``: SAM and learned query tables, crops as Step-3.7's); GLM-Image (from 5.0.0, ``visual`` and a
VQ tokenizer that run before the token embedding, ``fixes.vq_tokens``: the dummy at the forward's entry, and one
tokenizer call per micro-batch).

Releases (every published transformers release was read, see ``FORWARD_FINGERPRINTS``):
- fingerprinted: 4.57.0-5.25.0 (the newest), each release's code of the forward, where it was checked to call the
  token embedding before the tower, to take the media under the argument names ``media_towers`` lists and to call the
  feature function ``media_towers`` runs on the dummy (``get_image_features``; 5.18.0+ PaddleOCR-VL / LFM2-VL and
  5.24.0 for all also take precomputed ``mm_encoder_outputs``: media, no dummy; 5.24.0 calls its cache ``cache``);
- declared: releases without the family's module;
- unsupported (the bug is there, the patch refuses loudly): the releases between the family's first one and 4.57.0
  (older code, not read for this fix).
Later releases are unknown code until fingerprinted: refused with a warning. Proven on real FSDP2 on the pinned
releases in ``PROVEN`` for every family; identical code elsewhere applies with a note.

Upstream: TRL issue #3934, miles #2406, torchtitan #4777 (the hang); handled in verl's own forwards, LLaMA-Factory's
v0 collator (#6233), prime-rl #1959, cosmos-rl #606.  Delete when transformers keeps every rank in the tower's
collectives, or torch FSDP2 tolerates a unit one rank skips.
"""

from ..core.records import Target
from ..fixes import MIXED_MEDIA as FIX
from .transformers_fsdp import INTEGRATION  # noqa: F401  (transformers' one Integration record)

# Proven on real FSDP2 with 5.3.0 and 5.8.0 (5.4.0-5.8.1 share 5.8.0's code) for every family here:
# Qwen2.5-VL, Qwen3-VL, GLM-4.1V and Qwen3.5 through every framework (tests/integrations/test_mixed_ranks.py),
# the others through one generic per-layer-class wrapping per transformers release
# (tests/integrations/test_mixed_families.py; Qwen2-VL and Qwen3.5-MoE on test-only tiny models).  4.57.6,
# 5.0.0rc3, 5.10.4, 5.16.1 and 5.24.0 pass the same tests where the family exists and wraps, outside this one
# specifier (they apply with the "not in the proven range" note).
PROVEN = ">=5.3.0,<=5.8.1"
_WHAT = "media tower skipped on a text-only micro-batch (%s)"

# family -> (base model class, first release with the module)
FAMILIES = {
    "qwen2_vl": ("Qwen2VLModel", "4.45.0"),
    "qwen2_5_vl": ("Qwen2_5_VLModel", "4.49.0"),
    "qwen3_vl": ("Qwen3VLModel", "4.57.0"),
    "qwen3_vl_moe": ("Qwen3VLMoeModel", "4.57.0"),
    "glm4v": ("Glm4vModel", "4.53.0"),
    "glm4v_moe": ("Glm4vMoeModel", "4.56.0"),
    "glm46v": ("Glm46VModel", "5.0.0rc0"),
    "qwen3_5": ("Qwen3_5Model", "5.2.0"),
    "qwen3_5_moe": ("Qwen3_5MoeModel", "5.2.0"),
    # towers of their own kind (fixes.media_towers.TOWERS)
    "lfm2_vl": ("Lfm2VlModel", "4.57.0"),
    "paddleocr_vl": ("PaddleOCRVLModel", "5.0.0rc1"),
    "hunyuan_vl": ("HunYuanVLModel", "5.13.0"),
    "cosmos3_edge": ("Cosmos3EdgeModel", "5.15.0"),
    "step3p7": ("Step3p7Model", "5.16.0"),
    "chameleon": ("ChameleonModel", "4.44.0"),
    "deepseek_ocr2": ("DeepseekOcr2Model", "5.10.1"),
    "glm_image": ("GlmImageModel", "5.0.0rc3"),
    # the outer class runs the tower until 5.9.0; from 5.10.0 VoxtralModel does (VOXTRAL_OUTER_FINGERPRINTS)
    "qwen2_audio": ("Qwen2AudioModel", "4.45.0"),
    "voxtral": ("VoxtralModel", "4.54.0"),
    "audioflamingo3": ("AudioFlamingo3Model", "5.0.0rc0"),
}

# family -> {release label: fingerprint of <Family>Model.forward}, read from every wheel 4.57.0-5.25.0
FORWARD_FINGERPRINTS = {
    "qwen2_vl": {
        "4.57.0-5.0.0rc0": "6ff9c468bc6f2503", "5.0.0rc1-5.0.0rc2": "0e54d47652245890",
        "5.0.0rc3": "850436a4c9c523ef", "5.0.0-5.1.0": "76dc664c106aa649", "5.2.0": "ffd7c999b9527652",
        "5.3.0": "a18b28518ae008b4", "5.4.0-5.8.1": "ffa7c5cc5e5586f5", "5.9.0-5.10.0": "05e37e09771d2ff8",
        "5.10.1-5.14.1": "78bfd2cdb5d0b4e1", "5.15.0-5.17.0": "a8da1c1ae13f33ab", "5.18.0-5.22.2": "44255a1e6513e4ac",
        "5.23.0": "2ef1a7a1dbb97733", "5.24.0-5.25.0": "f85545d9fc31e17c",
    },
    "qwen2_5_vl": {
        "4.57.0-4.57.6": "bd96bbc289d3e759", "5.0.0rc0": "0b34b0d0e59f4acf", "5.0.0rc1-5.0.0rc2": "944fe56c6ffb4e69",
        "5.0.0rc3": "651aea6fd5d983b1", "5.0.0-5.1.0": "55c392ef51b4ac5d", "5.2.0": "93053a61ffe931d1",
        "5.3.0": "769eaf704e317240", "5.4.0-5.8.1": "e19a168642b4f3e1", "5.9.0-5.10.0": "4717c7fbbe2de1e7",
        "5.10.1-5.14.1": "2298b0b05991aa49", "5.15.0-5.17.0": "adb6fdf588c567c6", "5.18.0-5.22.2": "1aff4141ece9358e",
        "5.23.0": "a5c0acca6d58e97d", "5.24.0-5.25.0": "c1e21caf227dab30",
    },
    "qwen3_vl": {
        "4.57.0-4.57.1": "2982eaec381205f0", "4.57.2-4.57.3": "5c4ad0caa9264e81",
        "4.57.4-5.0.0rc0": "2982eaec381205f0", "5.0.0rc1-5.0.0rc2": "9a8bde2fac3f17dc",
        "5.0.0rc3": "ca8ef80021628d30", "5.0.0-5.1.0": "e0ee08de93796fd1", "5.2.0": "44d83f0048772a05",
        "5.3.0": "e2d2a296f1531c24", "5.4.0-5.8.1": "5a473104ef48a223", "5.9.0-5.17.0": "62f609444d38a3ab",
        "5.18.0-5.22.2": "cffa65c2a3c6d183", "5.23.0": "ddda523e573acc2f", "5.24.0-5.25.0": "cee337fc955dcbc5",
    },
    "qwen3_vl_moe": {
        "4.57.0-4.57.1": "de0ce736d4cb4694", "4.57.2-4.57.3": "465ae14859530898",
        "4.57.4-5.0.0rc0": "de0ce736d4cb4694", "5.0.0rc1-5.0.0rc2": "e2face5f40f4b4a1",
        "5.0.0rc3": "7d4f42ea624f9f62", "5.0.0-5.1.0": "a0aa630ff48a1135", "5.2.0": "bda929d15da69bdf",
        "5.3.0": "f86e6cb391209b4e", "5.4.0-5.8.1": "2e17e272ca4d89b2", "5.9.0-5.17.0": "7da6363acb44363b",
        "5.18.0-5.22.2": "d745a3110878b988", "5.23.0": "ddda523e573acc2f", "5.24.0-5.25.0": "5004083bdf75d4f1",
    },
    "glm4v": {
        "4.57.0-5.0.0rc2": "c85657bde2e427cf", "5.0.0rc3": "e30c327afdc93f40", "5.0.0-5.1.0": "c1f6693ea179a2bb",
        "5.2.0": "aa08d3ee50293253", "5.3.0": "5b6497ebcf1aa5a8", "5.4.0-5.8.1": "1c9d2b6b11fa2148",
        "5.9.0-5.10.0": "6cd801a22cd878fe", "5.10.1-5.14.1": "e16b0257cba2823f", "5.15.0-5.17.0": "ba0cf2419f18d381",
        "5.18.0-5.22.2": "aefe475de31eebc3", "5.23.0": "8028a9e88e78dc3b", "5.24.0-5.25.0": "3834d169d48a3463",
    },
    "glm4v_moe": {
        "4.57.0-5.0.0rc2": "79ecd10c01a5899f", "5.0.0rc3": "f8cd60ef4abc6c8b", "5.0.0-5.1.0": "9710ce9705c61d9f",
        "5.2.0": "95d7868713e8fdd4", "5.3.0": "4a02317a9c7c51f2", "5.4.0-5.8.1": "6b0a51e155d97b19",
        "5.9.0-5.10.0": "7a71d006084863d1", "5.10.1-5.14.1": "b905a4b6506cffb2", "5.15.0-5.17.0": "8ec62b6612b58366",
        "5.18.0-5.22.2": "dc6bd85cd9ecbb76", "5.23.0": "8028a9e88e78dc3b", "5.24.0-5.25.0": "6bad4e2a34186760",
    },
    "glm46v": {
        "5.0.0rc0-5.0.0rc2": "754bc91b5068a622", "5.0.0rc3": "c77b068952f98e88", "5.0.0-5.1.0": "2c50ddbb8b4aeee9",
        "5.2.0": "0a4691f05b6cec33", "5.3.0": "7a1218008873b96a", "5.4.0-5.8.1": "cd709b6a72b34e65",
        "5.9.0-5.10.0": "4624b242c535469d", "5.10.1-5.14.1": "196cbaf76b9540be", "5.15.0-5.17.0": "33e101b4b8f38006",
        "5.18.0-5.22.2": "9aa4b22442ae7bd2", "5.23.0": "8028a9e88e78dc3b", "5.24.0-5.25.0": "3834d169d48a3463",
    },
    "qwen3_5": {
        "5.2.0": "19631d870e03bd2e", "5.3.0": "161ab83b803d82c7", "5.4.0-5.8.1": "2d10da9a5a20af27",
        "5.9.0-5.17.0": "13795bc509baed50", "5.18.0-5.22.2": "54e9b9a8b377e8be", "5.23.0": "2ef1a7a1dbb97733",
        "5.24.0-5.25.0": "f85545d9fc31e17c",
    },
    "qwen3_5_moe": {
        "5.2.0": "9d792af60e021e8e", "5.3.0": "346f96b1e407e2eb", "5.4.0-5.8.1": "8aa62069641b3244",
        "5.9.0-5.17.0": "210bca842d54e920", "5.18.0-5.22.2": "0ec5e24bf6392db4", "5.23.0": "acc02c61eba214c6",
        "5.24.0-5.25.0": "08be9257c0efd620",
    },
    # Lfm2VlModel.forward: embedding (get_input_embeddings()) first, then vision_tower through
    # get_image_features(pixel_values=, spatial_shapes=, pixel_attention_mask=) when pixel_values is given
    # (5.18.0+: or mm_encoder_outputs["image"]); every distinct code below was read.
    "lfm2_vl": {
        "4.57.0-5.0.0rc2": "fba7944697efe6ce", "5.0.0rc3": "c4daa2240529ab88", "5.0.0-5.3.0": "ffb3ae3cd13f92a4",
        "5.4.0-5.17.0": "3c61525cc6d0810b", "5.18.0-5.22.2": "e378f714d097f15e", "5.23.0": "1d330bd7072495fa",
        "5.24.0-5.25.0": "9779f48adb6c15fd",
    },
    # PaddleOCRVLModel.forward: language_model.embed_tokens first, then get_image_features(pixel_values,
    # image_grid_thw) when pixel_values is given (5.18.0+: or mm_encoder_outputs["image"]).
    # VoxtralModel.forward (5.10.0+): as the outer class's forward before it (get_audio_features(input_features)).
    "voxtral": {
        "5.10.0-5.14.1": "634f6f2f6680c01f", "5.15.0-5.22.2": "fd624ea1218afdc8", "5.23.0": "115de727509c9b6a",
        "5.24.0-5.25.0": "a755fc782aeaa9b0",
    },
    "qwen2_audio": {
        "5.10.0-5.11.0": "e531c7dbb397e03c", "5.12.0-5.22.2": "125a290072bb2133", "5.23.0": "3893230ac7e04cea",
        "5.24.0-5.25.0": "005935d5bf48d63e",
    },
    "audioflamingo3": {
        "5.10.0-5.14.1": "177a0f26f8fead14", "5.15.0-5.22.2": "c5efd55e84fd170c", "5.23.0": "2988e485f8420420",
        "5.24.0-5.25.0": "5b19e6ca3e69324d",
    },
    "paddleocr_vl": {
        "5.0.0rc1-5.0.0rc2": "bc6a3b5e5793ef01", "5.0.0rc3": "ba24914c67f2598a", "5.0.0-5.1.0": "9296cd3f90b372a0",
        "5.2.0": "b180b518b8a8ca45", "5.3.0": "3d81f7a676a06ee5", "5.4.0-5.8.1": "49c142013546eafe",
        "5.9.0-5.10.0": "90714bded774bdf3", "5.10.1-5.14.1": "e1b6006a1799f3cf", "5.15.0-5.17.0": "96f5f6bffd39b970",
        "5.18.0-5.22.2": "2c71acd6568d4da9", "5.23.0": "5f9d456062a55a2f", "5.24.0-5.25.0": "e8958dcd4dd7f4eb",
    },
    # families new in transformers 5.1x, read from every wheel that has them (5.13.0 / 5.15.0 to 5.25.0)
    "hunyuan_vl": {
        "5.13.0-5.14.1": "e7f709657ca7c04d", "5.15.0-5.17.0": "b6617cf42af55fbb", "5.18.0-5.20.0": "7c1023b301aa2dca",
        "5.20.1-5.22.2": "3c869dc70da6126f", "5.23.0": "8882d42b32d445d3", "5.24.0-5.25.0": "90b03d9fc32dd1e9",
    },
    "cosmos3_edge": {
        "5.15.0-5.17.0": "b88836a9e2158d82", "5.18.0-5.22.2": "33453fa4d1f2c886", "5.23.0": "2ef1a7a1dbb97733",
        "5.24.0-5.25.0": "f85545d9fc31e17c",
    },
    # every release: get_input_embeddings() first, then get_image_features(pixel_values, pixel_values_local,
    # num_local_patches) when pixel_values is given (5.18.0+: unless mm_encoder_outputs; 5.24.0: ``cache``)
    "step3p7": {
        "5.16.0-5.17.0": "ea2f19fb60ad9a7f", "5.18.0": "807260cd486bdade", "5.19.0-5.22.2": "d34cfd81f4a2e5a4",
        "5.23.0": "4db2ae94e230509b", "5.24.0-5.25.0": "a8e7b6ad693745b6",
    },
    # every release: embed_tokens (get_input_embeddings()) first, then get_image_features(pixel_values) when
    # pixel_values is given (the VQ encoder, then the embedding of its codes; 5.18.0+: unless mm_encoder_outputs)
    "chameleon": {
        "4.57.0-4.57.6": "895e1943f95f9913", "5.0.0rc0-5.0.0rc2": "54fa5410711f98dd", "5.0.0rc3": "00cecf2c01ac9b39",
        "5.0.0-5.1.0": "b38c0ec10435bac0", "5.2.0-5.3.0": "bc49feaef24aa024", "5.4.0-5.17.0": "129fe26d4e33dfaf",
        "5.18.0-5.22.2": "018f5e0ce5ffdb9b", "5.23.0": "73c82fb99ffc241f", "5.24.0-5.25.0": "af62e578b1466ba6",
    },
    # every release: the embedding first, then get_image_features(pixel_values, pixel_values_local,
    # num_local_patches) when pixel_values is given (5.18.0+: unless mm_encoder_outputs has the image's)
    "deepseek_ocr2": {
        "5.10.1-5.14.1": "b15a4a30d6d0b456", "5.15.0-5.17.0": "93aa961bc4043960", "5.18.0": "6a4c8e9772553822",
        "5.19.0-5.22.2": "170fbd7b5696cd69", "5.23.0": "7fbbf2faabff8437", "5.24.0-5.25.0": "6629d31ba6abcac1",
    },
    # every release from 5.0.0: get_image_features(pixel_values, source grids, return_dict=True), then
    # get_image_tokens (one vqmodel.encode per source image), the ids scattered into input_ids, and only then
    # the token embedding (the tower runs first); 5.18.0+: per-image [channels, h, w] features, mm_encoder_outputs
    "glm_image": {
        "5.0.0": "3828d895403efbfd", "5.1.0": "4319e7324ac8837c", "5.2.0-5.3.0": "1d5ea4263e535d8c",
        "5.4.0-5.8.1": "bd8c65953ffbfc7f", "5.9.0-5.10.0": "080544d1015230a9", "5.10.1-5.14.1": "a2d1026e9fa1a508",
        "5.15.0-5.17.0": "42c1e253a2fe1e95", "5.18.0-5.22.2": "9e7aa2d9d1ffdf30", "5.23.0": "2e39d9ff00f83436",
        "5.24.0-5.25.0": "2f9fc23ce7e7189b",
    },
}


def _target(family, cls=None, fingerprints=None, declared=None, refuse_older=True, versions=PROVEN, layout=None,
            unsupported=None):
    """The family's ``<cls>.forward`` target (``FAMILIES``' base model class unless ``cls`` is given);
    ``declared``: more releases with nothing to patch there; ``refuse_older``: the family's releases before
    4.57.0 are unsupported (False where ``declared`` already classifies them: never both); ``unsupported``:
    more releases with the bug in code the fix was not fitted to."""
    cls, first = cls or FAMILIES[family][0], FAMILIES[family][1]
    unsupported = dict(unsupported or {})
    # (major, minor) of the first release: a family first released after 4.57 has no older releases to refuse
    if tuple(int(x) for x in first.split(".")[:2]) < (4, 57) and refuse_older:
        unsupported[">=%s,<4.57.0" % first] = (
            "%s.forward of releases before 4.57.0 was not read for the mixed-ranks fix (the tower is skipped on "
            "text-only micro-batches there too)" % cls)
    return Target(
        dist="transformers", module="transformers.models.%s.modeling_%s" % (family, family), attr=cls + ".forward",
        versions=versions, fingerprints=fingerprints or FORWARD_FINGERPRINTS[family], fix=FIX, families=(family,),
        what=_WHAT % family,
        declared=dict({"<%s" % first: "no transformers.models.%s module" % family}, **(declared or {})),
        unsupported=unsupported, layout=layout,
    )


QWEN2_VL = (_target("qwen2_vl"), _target("qwen2_5_vl"))
QWEN3_VL = (_target("qwen3_vl"), _target("qwen3_vl_moe"))
GLM4V = (_target("glm4v"), _target("glm4v_moe"), _target("glm46v"))
QWEN3_5 = (_target("qwen3_5"), _target("qwen3_5_moe"))
# The audio families' outer class runs the tower until 5.9.0 (these fingerprints), their ``*Model`` from 5.10.0
# (FORWARD_FINGERPRINTS): get_input_embeddings() first, then get_audio_features(input_features[,
# input_features_mask]) when input_features and input_ids are given (read: every code below and there).
OUTER_FINGERPRINTS = {
    # Qwen2-Audio: the tower and projector run inline (no feature function), only when inputs_embeds is not
    # given and input_ids is longer than one token
    "qwen2_audio": {
        "4.57.0-4.57.6": "3d03e9c7a8c3a11d", "5.0.0rc0": "9f22d59fe7354c11", "5.0.0rc1-5.0.0rc2": "a80bce50b439e456",
        "5.0.0rc3": "80717bdd379706a3", "5.0.0-5.1.0": "892225ffc8cf8261", "5.2.0-5.3.0": "beac68eaf6c0248f",
        "5.4.0-5.9.0": "9cbc6ef2d29cdaf8",
    },
    "voxtral": {
        "4.57.0-5.0.0rc2": "054b21dcd171ca4c", "5.0.0rc3": "90ab9408520ba255", "5.0.0-5.3.0": "885b1eb92907d361",
        "5.4.0-5.8.1": "3c8d7cafb8fd77af", "5.9.0": "518e40fa223665db",
    },
    "audioflamingo3": {
        "5.0.0rc0-5.0.0rc2": "42f39e4a1c9256f8", "5.0.0rc3": "b304a5d730f32df6", "5.0.0-5.3.0": "1c8a8a1149afcdc1",
        "5.4.0-5.8.1": "704f2cfcd5a0ea05", "5.9.0": "45f6fd6d99780546",
    },
}


def _outer_then_base(family, outer_cls, base_proven=">=5.10.0,<=5.14.1"):
    """``(<outer_cls>.forward to 5.9.0, <Family>Model.forward from 5.10.0)``: each declares the other's releases
    (for the census), and both are one ``layout`` (at run time the one whose code fits applies, the other
    says "uses the other seam", never a refusal: ``registry.siblings``).  The base forward is proven with
    5.10.4 (``base_proven``: the releases that share its code)."""
    first = FAMILIES[family][1]
    layout = "%s media forward" % family
    return (
        _target(family, outer_cls, OUTER_FINGERPRINTS[family],
                {">=5.10.0": "the forward calls %s.forward, which runs the tower (the other %s target)"
                             % (FAMILIES[family][0], family)}, layout=layout),
        _target(family, declared={">=%s,<5.10.0" % first: "no %s before 5.10.0 (the outer class's forward runs "
                                  "the tower: the other %s target)" % (FAMILIES[family][0], family)},
                refuse_older=False, versions=base_proven, layout=layout),
    )


QWEN2_AUDIO = _outer_then_base("qwen2_audio", "Qwen2AudioForConditionalGeneration", ">=5.10.0,<=5.11.0")
VOXTRAL = _outer_then_base("voxtral", "VoxtralForConditionalGeneration")
AUDIOFLAMINGO3 = _outer_then_base("audioflamingo3", "AudioFlamingo3ForConditionalGeneration")
LFM2_VL = (_target("lfm2_vl"),)
# Proven with 5.16.1 (the 5.15.0-5.17.0 code); 5.24.0 passes the same tests, with the "not in the proven range" note.
HUNYUAN_VL = (_target("hunyuan_vl", versions=">=5.15.0,<=5.17.0"),)
COSMOS3_EDGE = (_target("cosmos3_edge", versions=">=5.15.0,<=5.17.0"),)
PADDLEOCR_VL = (_target("paddleocr_vl"),)
# Proven with 5.24.0 (accelerate; SkyRL cannot take its config, so 5.16.1 is not run here).
STEP3P7 = (_target("step3p7", versions=">=5.24.0,<=5.25.0"),)
CHAMELEON = (_target("chameleon"),)
# Proven with 5.24.0 (accelerate), 5.16.1 (SkyRL) and 5.10.4 (verl), local crops on one rank too.
DEEPSEEK_OCR2 = (_target("deepseek_ocr2", versions=">=5.24.0,<=5.25.0"),)
# Proven with 5.24.0 (accelerate), 5.16.1 (SkyRL) and 5.10.4 (verl), two source images against a text-only rank.
GLM_IMAGE = (_target("glm_image", versions=">=5.24.0,<=5.25.0", unsupported={
    "==5.0.0rc3": "GlmImageModel.get_image_features of 5.0.0rc3 returns a tuple (no return_dict): not read for the "
                  "mixed-ranks fix"}),)
TARGETS = (QWEN2_VL + QWEN3_VL + GLM4V + QWEN3_5 + LFM2_VL + PADDLEOCR_VL + QWEN2_AUDIO + VOXTRAL + AUDIOFLAMINGO3
           + HUNYUAN_VL + COSMOS3_EDGE + STEP3P7 + CHAMELEON + DEEPSEEK_OCR2 + GLM_IMAGE)
