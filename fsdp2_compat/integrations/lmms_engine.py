"""lmms-engine: the FSDP2 wrap selection, inline in ``apply_fsdp2`` (verl's loop).

Module ``lmms_engine.utils.fsdp2_utils`` (``lmms_engine/utils/fsdp2_utils.py``):
``apply_fsdp2(model, fsdp_kwargs, fsdp_transformer_layer_cls_to_wrap=None)``
selects every module whose class name is a layer class **and every
``nn.Embedding`` when ``model.config.tie_word_embeddings`` is false**, then
calls the module-global ``fully_shard`` once per selected module and once for
the root: verl 0.4-0.7's loop.  GLM-4.1V's vision ``position_embedding`` then
gets a unit of its own, its parent reads ``.weight`` raw, and the first
forward fails with ``aten.grid_sampler_2d.default got mixed torch.Tensor and
DTensor`` (every family ``registry.selection_model_types()`` lists fails the
way ``tests/integrations/test_wrap_selection.py`` records).  Qwen3-VL calls
its ``pos_embed`` as a module and trains as released.
``lmms_engine.train.fsdp2.fsdp2_trainer`` (``FSDP2SFTTrainer.prepare_model``,
the trainer's only FSDP2 path unless TP/CP/EP ``apply_parallelize`` is on)
imports ``apply_fsdp2`` by name; the engine rebinds that alias.

Mechanism: the same seam as AReaL, SkyRL and verl 0.4.0-0.7.0,
``fsdp2_compat.fixes.inline_selection``: ``apply_fsdp2`` is wrapped only to
publish the model, and the ``fully_shard`` its loop calls drops the auxiliary
embeddings (they stay in the root unit) and nested layer classes; everything
else (lmms-engine's mesh, mixed precision, ``reshard_after_forward``) is its
own code.  Its ``apply_parallelize`` path (TP/CP/EP for the model types in
``MODEL_TO_PARALLEL_METHOD``) shards per model in other modules and is not
covered here.

Not changed (upstream's, said so): with no layer classes configured it takes
``model._no_split_modules``, a *set* on transformers 5.x, and its own
``assert ... [0]`` raises ``TypeError``; lmms-engine's example configs pass
``transformer_layer_cls_to_wrap`` as a list, which is what the tests do.

Importing: ``lmms_engine/utils/__init__.py`` imports deepspeed, datasets and
librosa (``train_utils``, ``data_utils``); ``fsdp2_utils`` itself needs only
torch.  Users have the full install, so the hook fires on the real import.
The pinned test set installs lmms-engine ``--no-deps`` and imports the
released ``fsdp2_utils.py`` with that package ``__init__`` skipped
(``tooling.frameworks.import_fsdp_utils``): the file under test runs unchanged.

Releases: 0.1.2 and 0.1.4 (the only ones on PyPI) have the same ``apply_fsdp2``
code (one fingerprint; 0.1.4 proven).  No upstream issue or fix for
lmms-engine; the rule is SkyRL's fix (issue #2087 / PR #2088).

Fails safe: applied only where ``apply_fsdp2``'s fingerprint is the one below
and ``fully_shard`` is a module global (else refused with the reason, nothing
touched); outside an ``apply_fsdp2`` call the ``fully_shard`` wrapper is a
pass-through.  Delete when lmms-engine selects only layer classes and the
untied input embedding (the fingerprint then changes and the target refuses
itself; add the fixed release as ``fixed_in``).
"""

from ..core.records import Integration, Target

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
    seam="fsdp2_compat.fixes.inline_selection:seam",
    what="FSDP2 wrap selection (inline loop)",
    diff="wrap-selection",
)
