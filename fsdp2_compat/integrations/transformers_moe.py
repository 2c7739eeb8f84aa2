"""transformers: the MoE blocks that run only the experts a micro-batch's tokens reach.

One target per family: the method of the MoE block class that loops over the
routed experts and skips those no token reached (``Qwen3MoeSparseMoeBlock.forward``,
``Glm4vMoeTextMoE.moe``, ...).  The fix code, why it sits at FSDP2's unit and
what it costs: ``fsdp2_compat.fixes.experts``.

Releases (every published transformers release was read with the release
census' reader; ``tests/integrations/test_census.py`` keeps it so):
- fingerprinted: each family's releases whose loop skips an unreached expert
  (``expert_hit`` / ``numel() > 0`` / ``num_tokens == 0``, and Mixtral's
  ``top_x.shape[0] == 0`` before 4.40), up to 4.57.6, the last 4.x;
- declared, by code: 5.0.0rc0 and later store routed experts as 3-D parameters
  (``<Family>Experts.gate_up_proj`` / ``down_proj``, indexed per expert), so
  every rank has a gradient for every expert; Qwen2-MoE and Mixtral
  4.40.0-4.51.3 and Qwen3-MoE 4.51.0-4.52.4 run every expert, on an empty
  slice when no token reached it (a zero gradient on every rank); releases
  before the family's module existed;
- not a target at all: Qwen3-VL-MoE (3-D experts in every release, 4.57.0 on)
  and Qwen3.5-MoE (5.2.0 on, 3-D).  ``NOT_AFFECTED`` says so for doctor and check.

Proven on real FSDP2 (2 CPU gloo ranks, tokens that reach different experts
on each rank) with 4.57.6 through verl, SkyRL, skyrl-train and accelerate's
wrapping; the same scenario is exact unpatched on 5.8.0
(``tests/integrations/test_moe_experts.py``).

Upstream: pytorch issue #171355, SkyRL issue #1297 / PR #1370 (Qwen3-MoE
deadlock with partially run experts), torchtitan #4777.  Delete when every
transformers you train a MoE model with is 5.0+.
"""

from ..core.records import Target
from ..fixes import MOE_EXPERTS as FIX
from .transformers_media import INTEGRATION  # noqa: F401  (transformers' one Integration record)

_WHAT = "MoE expert no token on this rank reached (%s)"
THREE_D = ("routed experts are 3-D parameters (<Family>Experts, indexed per expert): every rank has a gradient "
           "for every expert")
EVERY_EXPERT = "the loop runs every expert, on an empty slice when no token reached it: a (zero) gradient on every rank"

# family -> (module class, method with the expert loop, first release with the module)
FAMILIES = {
    "glm4v_moe": ("Glm4vMoeTextMoE", "moe", "4.56.0"),
    "glm4_moe": ("Glm4MoeMoE", "moe", "4.54.0"),
    "deepseek_v3": ("DeepseekV3MoE", "moe", "4.51.0"),
    "deepseek_v2": ("DeepseekV2MoE", "moe", "4.54.0"),
    "qwen3_moe": ("Qwen3MoeSparseMoeBlock", "forward", "4.51.0"),
    "qwen2_moe": ("Qwen2MoeSparseMoeBlock", "forward", "4.40.0"),
    "mixtral": ("MixtralSparseMoeBlock", "forward", "4.36.0"),
}

# family -> {release label: fingerprint of the method}, the releases whose loop skips unreached experts
FINGERPRINTS = {
    # GLM-4.5V, GLM-4.5 and DeepSeek-V3 share one `moe` (transformers' modular copies)
    "glm4v_moe": {"4.56.0-4.57.6": "fbf5af62a67f75bc"},
    "glm4_moe": {"4.54.0-4.57.6": "fbf5af62a67f75bc"},
    "deepseek_v3": {"4.51.0-4.57.6": "fbf5af62a67f75bc"},
    "deepseek_v2": {"4.54.0-4.56.2": "81d112e3127dfd55", "4.57.0-4.57.6": "2fac1866ab4b9307"},
    "qwen3_moe": {"4.53.0-4.55.4": "2c98462ac0913850", "4.56.0-4.57.6": "cdcaf408bf7c6ac4"},
    "qwen2_moe": {"4.52.0-4.52.4": "b75e4ae6d0ccec3d", "4.53.0-4.55.4": "df34b953ce145b05",
                  "4.56.0-4.57.6": "9e1780f1747bb010"},
    "mixtral": {"4.36.0-4.36.2": "a5423df2d1633264", "4.37.0-4.39.3": "fdb02659014b0dd9",
                "4.52.0-4.52.4": "0c1634771781b719", "4.53.0-4.55.4": "348efcb9dea75b67",
                "4.56.0-4.57.6": "fe6649643cc8bda2"},
}

# family -> releases (a specifier) whose loop runs every expert
_EVERY_EXPERT_RUNS = {
    "qwen3_moe": ">=4.51.0,<4.53.0",
    "qwen2_moe": ">=4.40.0,<4.52.0",
    "mixtral": ">=4.40.0,<4.52.0",
}

# The catalogue's MoE families whose experts are 3-D in every release: nothing to patch (check and doctor say so).
NOT_AFFECTED = {
    "qwen3_vl_moe": "Qwen3-VL-MoE: " + THREE_D + " (every release, 4.57.0 on)",
    "qwen3_5_moe": "Qwen3.5-MoE: " + THREE_D + " (every release, 5.2.0 on)",
}

# Proven on real FSDP2 with 4.57.6 (the tf4 / verl080 sets): each family's newest label, which holds it, is its
# proven range (stdlib only here: the records are built when the registry is imported, at apply()).
PROVEN_RELEASE = "4.57.6"



def _target(family):
    cls, method, first = FAMILIES[family]
    prints = FINGERPRINTS[family]
    low, _, high = list(prints)[-1].partition("-")  # the newest code, the label that holds PROVEN_RELEASE
    declared = {"<%s" % first: "no transformers.models.%s module before %s" % (family, first),
                ">=5.0.0rc0": THREE_D}
    if family in _EVERY_EXPERT_RUNS:
        declared[_EVERY_EXPERT_RUNS[family]] = EVERY_EXPERT
    return Target(
        dist="transformers",
        module="transformers.models.%s.modeling_%s" % (family, family),
        attr="%s.%s" % (cls, method),
        versions=">=%s,<=%s" % (low, high or low),
        fingerprints=prints,
        fix=FIX,
        families=(family,),
        what=_WHAT % family,
        declared=declared,
    )


GLM4V_MOE = (_target("glm4v_moe"),)
# The text MoE families users train with these frameworks (the ``moe`` patch).
TEXT = tuple(_target(f) for f in ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3", "glm4_moe"))
TARGETS = GLM4V_MOE + TEXT
