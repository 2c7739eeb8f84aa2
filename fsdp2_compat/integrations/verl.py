"""verl: where its FSDP2 wrap selection lives, release by release.

Module ``verl.utils.fsdp_utils``:
- 0.4.0-0.7.0 select inline in ``apply_fsdp2`` (every ``nn.Embedding`` when
  ``model.config.tie_word_embeddings`` is false) -> the ``fully_shard`` seam of
  ``fsdp2_compat.fixes.inline_selection``;
- 0.7.1-0.9.1 call ``_select_fsdp2_wrap_targets(model, layer_cls)`` by global
  name from ``apply_fsdp2`` -> replaced by ``select_verl`` below.

Callers import ``apply_fsdp2`` by name (``verl.workers.fsdp_workers``,
``verl.trainer.fsdp_sft_trainer``, ``verl.workers.engine.fsdp.*``); the engine
rebinds those aliases.

To support a new release: widen ``versions`` and, if the function changed,
add ``"<release>": "<fingerprint>"`` (``fsdp2-compat fingerprint FILE NAME``).
"""

from ..records import Target

FSDP_UTILS = "verl.utils.fsdp_utils"

WRAP_SELECTION_INLINE = Target(
    dist="verl",
    module=FSDP_UTILS,
    attr="apply_fsdp2",
    versions=">=0.4.0,<0.7.1",
    fingerprints={"0.4.0-0.5.0": "c1723289c3265bd0", "0.6.0-0.7.0": "26f7091741f9b7e0"},
    seam="fsdp2_compat.fixes.inline_selection:seam",
    what="FSDP2 wrap selection (inline loop)",
    diff="patches/verl/0.7.0/wrap-selection.diff",
)

WRAP_SELECTION = Target(
    dist="verl",
    module=FSDP_UTILS,
    attr="_select_fsdp2_wrap_targets",
    versions=">=0.7.1,<=0.9.1",
    fingerprints={"0.7.1-0.9.1": "fc0a593bafb6050f"},
    seam="fsdp2_compat.integrations.verl:selection_seam",
    what="FSDP2 wrap selection",
    diff="patches/verl/0.9.1/wrap-selection.diff",
)

# verl 0.7.1+ also gives ``embed_tokens`` / ``lm_head`` their own groups by
# leaf name, because PEFT's ModulesToSaveWrapper hides the nn.Embedding type.
# That part of verl's memory plan is kept as is.
_VERL_NAMED = ("embed_tokens", "lm_head")


def select_verl(model, layer_classes):
    """verl's selection with auxiliary embeddings left in the root group.

    Same as ``select_wrap_targets`` plus verl's by-name ``embed_tokens`` /
    ``lm_head`` groups when the embeddings are untied (decided by identity).
    """
    from ..fixes.selection import embeddings_tied, select_wrap_targets

    by_name = None
    if not embeddings_tied(model):

        def by_name(name, module):
            return name.rsplit(".", 1)[-1] in _VERL_NAMED and hasattr(module, "weight")

    return select_wrap_targets(model, layer_classes, extra=by_name)


def selection_seam(module):
    import wrapt

    def _select_fsdp2_wrap_targets(wrapped, instance, args, kwargs):
        return select_verl(*args, **kwargs)

    original = module.__dict__["_select_fsdp2_wrap_targets"]
    return {"_select_fsdp2_wrap_targets": wrapt.FunctionWrapper(original, _select_fsdp2_wrap_targets)}
