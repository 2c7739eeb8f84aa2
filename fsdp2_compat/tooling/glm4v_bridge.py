"""Let verl's own GLM4V forward run on a tiny model, with the transformers it admits.

The lm_head proof for GLM4V (tests/integrations/test_fused_forwards.py) must run verl's
real ``glm4v.forward_with_torch_backend``.  Upstream, that forward runs only
on the transformers 5.0.0 release candidates (rc0-rc3), for reasons unrelated
to FSDP2 (read in verl 0.7.1, 0.8.0 and 0.9.1, checked against transformers
4.54-4.57, 5.0.0rc0-rc3 and 5.0-5.8):

- transformers 5.0.0 and later: ``Glm4vVisionModel.forward`` returns a
  ``BaseModelOutputWithPooling``; verl's ``_get_input_embeds`` calls
  ``model.visual(...).shape`` (``AttributeError``).  verl has a helper for
  this (``utils.transformers_compat``) but only Qwen3-VL uses it.
- transformers 4.x (4.54-4.57 read): verl's ``process_position_ids`` insists on 4-row position
  ids (a text row on top of the three M-RoPE rows, transformers PR #39447),
  but ``Glm4vTextModel`` in 4.x only knows 3 rows (its rotary embedding fails
  with a broadcast error).

Related upstream reports: verl issues #4095 and #6814 (GLM-4.1V forwards
failing in verl).

``bridge()`` adapts *transformers* to the contract verl was written against,
that of the release candidates, and does nothing on them (``needed()``): from
5.0.0 the vision tower returns its merged features (``pooler_output``, the
tensor earlier releases returned); on 4.x a 4-row position tensor loses its
text row (which 5.x uses only for masks, never for rotary embeddings).
Nothing in verl is replaced; every verl function that the patch under test
touches runs as released.  The ``tf5rc`` pinned set runs the proof with no
adaptation at all.

Used by the tests and by ``fsdp2-compat audit --fused``; never by a patch.
"""

import contextlib


def needed():
    """What this transformers needs adapted for verl's GLM4V forward: a label, or None.

    The 5.0.0 release candidates (rc0-rc3) are the only transformers releases
    verl's GLM4V forward runs on as is: their vision tower still returns a
    tensor and their text model already takes 4-row position ids.
    """
    from fsdp2_compat.core import guards

    version = guards.installed_version("transformers")
    if guards.in_range(version, ">=5.0.0"):
        return "vision output object"
    if guards.in_range(version, "<5.0.0rc0"):
        return "3-row position ids"
    return None


@contextlib.contextmanager
def bridge():
    """Adapt transformers' GLM4V classes for verl's forward where ``needed()``; restored on exit."""
    from transformers.models.glm4v import modeling_glm4v as glm4v

    need = needed()
    if need is None:
        yield
        return
    if need == "vision output object":
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
