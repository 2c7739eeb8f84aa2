"""transformers' native FSDP2: ``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=N))``.

From 5.15.0 ``DistributedMixin.maybe_distribute_model`` shards the loaded model with
``transformers.distributed.fsdp.apply_fully_sharded_data_parallelism`` (``mixin`` imports it by name: the engine
rebinds it) after the plan: ``_fsdp_plan`` + ``base_model_fsdp_plan`` (``embed_tokens``, ``layers.*``, ``norm``),
a user ``fsdp_plan`` from 5.23.0; 5.13-5.14 declare ``fsdp_size`` but never shard.  ``TAIL`` (fix
``tail_unit.native_apply_seam``): a head whose final norm is not called ``norm`` (Phi) is a unit alone, and an
in-forward reader crashes (``aten.mm``) or, with ``full_tensor()``, trains it unaveraged.  ``PATHS``: what the
other bug classes do there (``status`` / ``list``).  Proofs: tests/integrations/test_native_fsdp.py.  Upstream:
no transformers issue yet.  Delete when ``is_norm_and_head_pair`` accepts any final norm in every release you run.
"""

from ..core.records import Covered, Integration, Target
from ..fixes import NATIVE_TAIL

FSDP = "transformers.distributed.fsdp"
APPLY = "apply_fully_sharded_data_parallelism"
FINGERPRINTS = {"5.15.0-5.18.0": "642a1f4582e75fae", "5.19.0-5.20.1": "2b56bfb1b7b3aa74",
                "5.20.2-5.22.2": "d1973e3b66dab912", "5.23.0-5.25.0": "ba8f3b5097a30372"}
# The layouts the pinned sets run (tf516 / skyrl040: 5.16.1, latest: 5.24.0).
PROVEN_FPS = {k: FINGERPRINTS[k] for k in ("5.15.0-5.18.0", "5.23.0-5.25.0")}
_MEDIA = "the model's patch: transformers_media (the tower in the root unit: a text-only rank's dummy)"
PATHS = (
    Covered(FSDP, APPLY, PROVEN_FPS, "a text-only rank beside an image rank (Qwen2.5-VL, Qwen3-VL, GLM-4.1V, "
            "Qwen3.5; HSDP, CPU offload): " + _MEDIA),
    Covered(FSDP, APPLY, PROVEN_FPS, "right as released: MoE with 3-D experts (ep_size too), GLM-4.1V "
            "position_embedding under the default plan (in the root unit)"),
    Covered(FSDP, APPLY, {"5.23.0-5.25.0": FINGERPRINTS["5.23.0-5.25.0"]},
            "not covered: a user fsdp_plan that frees lm_head or names a raw-read embedding (GLM-4.1V "
            "position_embedding) shards it as asked; readers must use fsdp2_compat.gather_param", fixed=False),
)

# transformers' one Integration record (transformers_media and transformers_moe hold model code, this file the
# sharding); it wraps nothing an apply_fsdp2-style call reaches.
INTEGRATION = Integration(dist="transformers", package="transformers", wrap_module=None,
                          callers=("transformers.distributed.mixin",), covered=PATHS)

TAIL = Target(
    dist="transformers",
    module=FSDP,
    attr=APPLY,
    # Pinned sets: 5.16.1 and 5.24.0; 5.15.0, 5.19.0 and 5.22.0 ran the same rule in the issue #42 research.
    versions=">=5.15.0,<=5.24.0",
    fingerprints=FINGERPRINTS,
    fix=NATIVE_TAIL,
    what="transformers native FSDP2 tail (a kept lm_head alone, without its decoder's final norm)",
    declared={"<5.15.0": "no native FSDP2: DistributedConfig has no FSDP fields before 5.13.0, and 5.13.0-5.14.x "
                         "declare fsdp_size but from_pretrained never shards"},
)

TARGETS = (TAIL,)
