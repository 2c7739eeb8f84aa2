"""Let verl's own GLM4V forward run on a tiny model, with the transformers it admits.

The lm_head proof for GLM4V (tests/test_fused_forwards.py) must run verl's
real ``glm4v.forward_with_torch_backend``.  Upstream, that forward cannot run
on any released transformers, for reasons unrelated to FSDP2 (read in verl
0.7.1, 0.8.0 and 0.9.1, checked against transformers 4.54-4.57 and 5.0-5.8):

- transformers 5.x: ``Glm4vVisionModel.forward`` returns a
  ``BaseModelOutputWithPooling``; verl's ``_get_input_embeds`` calls
  ``model.visual(...).shape`` (``AttributeError``).  verl has a helper for
  this (``utils.transformers_compat``) but only Qwen3-VL uses it.
- transformers 4.x: verl's ``process_position_ids`` insists on 4-row position
  ids (a text row on top of the three M-RoPE rows, transformers PR #39447),
  but ``Glm4vTextModel`` in 4.x only knows 3 rows (its rotary embedding fails
  with a broadcast error).

``bridge()`` adapts *transformers* to the contract verl was written against,
each time exactly as the other major version behaves: on 5.x the vision tower
returns its merged features (``pooler_output``, which 4.x returned as a
tensor); on 4.x a 4-row position tensor loses its text row (which 5.x uses
only for masks, never for rotary embeddings).  Nothing in verl is replaced;
every verl function that the patch under test touches runs as released.

``verl_batch(model, batch)`` turns a ``tiny_models.make_batch("glm4v", ...)``
batch into what verl's data pipeline feeds: 4-row position ids, no labels.
Used by the tests and by ``fsdp2-compat audit --fused``; never by a patch.
"""

import contextlib


@contextlib.contextmanager
def bridge():
    """Adapt transformers' GLM4V classes for verl's forward; restored on exit."""
    import transformers
    from transformers.models.glm4v import modeling_glm4v as glm4v

    if int(transformers.__version__.split(".")[0]) >= 5:
        cls, name = glm4v.Glm4vVisionModel, "forward"
        original = cls.__dict__[name]

        def adapted(self, *args, **kwargs):
            return original(self, *args, **kwargs).pooler_output

    else:
        cls, name = glm4v.Glm4vTextModel, "forward"
        original = cls.__dict__[name]

        def adapted(self, *args, position_ids=None, **kwargs):
            if position_ids is not None and position_ids.ndim == 3 and position_ids.shape[0] == 4:
                position_ids = position_ids[1:]
            return original(self, *args, position_ids=position_ids, **kwargs)

    setattr(cls, name, adapted)
    try:
        yield
    finally:
        setattr(cls, name, original)


def verl_batch(model, batch):
    """``batch`` as verl's data pipeline feeds GLM4V: (4, batch, seq) position ids, no labels."""
    from fsdp2_compat.audit import add_verl_position_ids

    batch = {k: v for k, v in batch.items() if k != "labels"}
    add_verl_position_ids(model, batch)
    return batch
