"""verl's own GLM-4.1V forward, made to run on the transformers releases verl admits.

verl installs ``verl/models/transformers/glm4v.py`` on every ``glm4v`` model
(``apply_monkey_patch``: ``Glm4vModel.forward = glm4v_base_forward``, with or
without fused kernels; 0.6.0-0.9.1).  Two contracts of transformers changed
under it, so that forward runs as released only on transformers
5.0.0rc0-rc3 (not an FSDP2 bug; users hit it as verl issues #4095 / #6814):

1. transformers >= 5.0.0: ``Glm4vVisionModel.forward`` returns a
   ``BaseModelOutputWithPooling`` whose ``pooler_output`` is the merged
   tensor older releases returned.  verl's ``_get_input_embeds`` (the only
   verl function that calls ``model.visual``) asks for ``.shape``:
   ``AttributeError: 'BaseModelOutputWithPooling' object has no attribute 'shape'``.
   verl unwraps the same object for Qwen2-VL / Qwen3-VL with
   ``verl.utils.transformers_compat.unpack_visual_output`` (0.8.0+), never for
   GLM4V.
2. transformers < 5.0.0rc0: verl's ``process_position_ids`` insists on 4-row
   position ids (a text row on top of the three M-RoPE rows, transformers
   PR #39447) and passes all four on; 4.x's ``Glm4vTextModel`` feeds them to
   its 3-section rotary embedding: ``The size of tensor a (3) must match the
   size of tensor b (4) at non-singleton dimension 0``.  verl's Qwen2-VL copy
   of that function drops the text row for the transformers that predate the
   4-row contract; the GLM4V copy never got that branch.

Seams (``wrapt.FunctionWrapper`` around verl's functions; the rest of verl's forward runs as released):

- ``vision_output_seam`` (``_get_input_embeds``; its rule also serves verl's
  Qwen2-VL ``_get_input_embeds``, whose text-only dummy branch has the same
  ``.mean()`` on the output object: ``fixes.verl_media``): for the duration of the
  call, a forward hook on ``model.visual`` hands verl the output's
  ``pooler_output`` whenever the vision tower returns an object that has one:
  ``unpack_visual_output``'s rule.  It covers the image, video and text-only
  dummy calls, and runs after FSDP's own hooks when the vision tower is an
  FSDP unit.
- ``position_ids_seam`` (``process_position_ids``): verl's own validation
  runs, then the text row is dropped.  The text row is used only for masks and
  packed flash-attention in 5.x; 4.x builds its masks from the attention mask.
  Limit: on 4.x with ``use_remove_padding=True`` verl's ``glm4v_attn_forward``
  asserts 2-D position ids, which 4.x's text model never passes to its layers;
  that flash-attention path is not changed here.

Each seam decides once, when verl's module is imported, from the installed transformers, and raises ``NotNeeded``
where transformers already does what it adapts (status then says "not needed", not a no-op "applied").

Fails safe: both targets are fingerprinted per verl release; changed code is
refused and left alone.  Delete when verl's GLM4V forward unpacks the vision
output (and, for transformers 4.x users, drops the text row) in every release
you run.
"""

# transformers releases whose Glm4vVisionModel returns an output object (5.0.0 final on;
# read in 4.54-4.57, 5.0.0rc0-rc3 and 5.0-5.8), and those whose Glm4vTextModel takes
# 4-row position ids itself (5.0.0rc0 on).
VISION_OUTPUT_OBJECT = ">=5.0.0"
TEXT_MODEL_TAKES_FOUR_ROWS = ">=5.0.0rc0"


def adapted_for(version):
    """The verl functions transformers ``version`` needs adapted: ``()`` on 5.0.0rc0-rc3 only."""
    from ..core import guards

    out = ()
    if guards.in_range(version, VISION_OUTPUT_OBJECT):
        out += ("_get_input_embeds",)
    if not guards.in_range(version, TEXT_MODEL_TAKES_FOUR_ROWS):
        out += ("process_position_ids",)
    return out


def _transformers_in(spec):
    from ..core import guards

    version = guards.installed_version("transformers")
    return version, version is not None and guards.in_range(version, spec)


def pooled_output(module, args, output):
    """Forward hook: the merged tensor of a vision output object (``unpack_visual_output``'s rule).

    Returns None (output unchanged) for a tensor or anything without ``pooler_output``.
    """
    if isinstance(output, tuple) or not hasattr(output, "pooler_output"):
        return None
    return output.pooler_output


def vision_output_seam(module, attr):
    """verl's ``_get_input_embeds`` with ``model.visual(...)`` seen as its pooled tensor during the call."""
    from ..core import guards

    version, needed = _transformers_in(VISION_OUTPUT_OBJECT)
    if not needed:
        raise guards.NotNeeded("transformers %s: the vision tower returns the merged tensor verl expects" % version)
    import wrapt

    from ..core import calls

    signature = calls.signature_of(module, attr)

    def _get_input_embeds(wrapped, instance, args, kwargs):
        model = signature.argument("model", instance, args, kwargs)
        visual = getattr(model, "visual", None)
        if visual is None or not hasattr(visual, "register_forward_hook"):
            calls.missing(signature.where, "a model with a vision tower (got %s)" % type(model).__name__)
            return wrapped(*args, **kwargs)
        handle = visual.register_forward_hook(pooled_output)
        try:
            return wrapped(*args, **kwargs)
        finally:
            handle.remove()

    return {attr: wrapt.FunctionWrapper(module.__dict__[attr], _get_input_embeds)}


def position_ids_seam(module, attr):
    """verl's ``process_position_ids`` that drops the text row where transformers' GLM4V takes 3 rows."""
    from ..core import guards

    version, takes_four = _transformers_in(TEXT_MODEL_TAKES_FOUR_ROWS)
    if takes_four:
        raise guards.NotNeeded("transformers %s: Glm4vTextModel takes verl's 4-row position ids" % version)
    import wrapt

    def process_position_ids(wrapped, instance, args, kwargs):
        position_ids = wrapped(*args, **kwargs)  # verl's own (4, batch, seq) validation
        return position_ids[1:]

    return {attr: wrapt.FunctionWrapper(module.__dict__[attr], process_position_ids)}
