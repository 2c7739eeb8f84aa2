"""ms-swift: every FSDP2 path it shares with the transformers forwards and accelerate is fixed there; no seam here.

ms-swift trains with ``--fsdp fsdp2`` through accelerate (``fsdp2_prepare_model``, ``TRANSFORMER_BASED_WRAP``: the
``_no_split_modules`` layer classes as units, and from accelerate 1.14 a tail unit for ``lm_head``). Read in the
4.6.0 wheel and run through its own code (``tests/integrations/test_ms_swift.py``, ``test_ms_swift_liger.py``; set
``tf516swift``), these are its paths and what covers each:

- Qwen3-VL / Qwen3-VL-MoE (``swift.model.models.qwen._compat_qwen3_vl_mixed_data``, called by the loaders'
  ``get_model``): saves ``model.origin_forward = model.forward`` on the base model and installs an instance
  ``forward`` that runs its own dummy image only under DeepSpeed, else calls ``origin_forward``: transformers'
  ``Qwen3VLModel.forward``.  A text-only rank then skips every vision unit (gloo ``Received data size doesn't
  match expected size``).  Covered by the model's patch (``transformers_media`` targets:
  ``fixes.mixed_media``, ``fixes.media_merge``): requested before the load, ms-swift saves our wrapper; after
  it, the engine rebinds the saved ``origin_forward`` (``core.instances``) and ``status`` names the instance.
- Qwen2-VL / Qwen2.5-VL / Qwen3.5 / GLM-4.1V templates (``Template._get_inputs_embeds_hf`` from their
  ``_post_encode``, a forward pre-hook ``register_post_encode_hook`` installs): run the tower on every
  micro-batch (a 32x32 black image for a text-only one) and call the model with ``inputs_embeds``: right as released
  (Qwen3.5's ``Qwen3_5Template._post_encode`` calls the Qwen2-VL one; its loader does not replace the forward).
  ``fixes.mixed_media`` counts the tower's calls and adds no dummy of its own when the caller ran the tower for
  the micro-batch (one tower call per micro-batch from the second one on; the first one, before the count
  exists, gets one more on every rank alike).
- GRPO's Liger loss (``GRPOTrainer.compute_liger_loss``: ``unwrapped_model.lm_head.weight`` into liger's
  chunked loss, inside the root unit's forward): on accelerate 1.14-1.15 a VLM's ``lm_head`` is alone in its
  tail unit and reaches liger sharded (``aten.mm.default got mixed torch.Tensor and DTensor``).  Covered by the
  model's patch (``integrations.accelerate``: the tail unit gets the decoder's final norm, whose forward
  unshards the head before the read); text models are right as released.
- GKD's Liger JSD (``GKDTrainer._compute_liger_loss``): not covered, and not a head read.  It calls the
  teacher's base model outside the teacher root unit's forward (the teacher prepared by ms-swift's
  ``prepare_fsdp``), so that root is never lazily initialised nor unsharded: a text teacher fails in FSDP2's
  lazy init (``FSDP requires a single root module``), a VLM teacher at its vision patch embedding (``mixed
  torch.Tensor and DTensor``), before ``teacher_head.weight`` is read.  A fix belongs in ms-swift (call the
  teacher through its root, or unshard the root around the call); ms-swift issue to file.
- Not in the catalogue: InternVL, Kimi-VL, Keye and Seed templates, whose dummy is DeepSpeed-only too.

``PATHS`` records the code of each path above as proven (``guards.fingerprint_source``; ``fsdp2-compat fingerprint
FILE NAME``) as ``Covered`` records of its ``Integration``: ``fsdp2-compat status`` reads the installed release's
files and says per path "proven" (that code), "proven broken" (GKD) or "unverified" (other code: not assumed
covered), and ``list`` prints them (``core.covered``); ``test_ms_swift.py`` checks them against the installed
release.  ``fsdp2-compat check`` runs the Qwen3-VL forward and GRPO Liger paths, unpatched and patched, where their
installed code is the proven code (the harness's ``engines/ms_swift.py``).

Fails safe: nothing of ms-swift is patched.  Delete when ms-swift keeps every rank in the tower's
collectives under FSDP2 itself (its Qwen3-VL dummy not DeepSpeed-only) and the shared targets it relies on
are deleted (see their modules).
"""

from ..core.records import Covered, Integration

# The ms-swift code the tests prove, per release, and what covers it (``core.covered``: ``status``, ``list``).
PATHS = (
    Covered("swift.model.models.qwen", "_compat_qwen3_vl_mixed_data", {"4.6.0": "fe9adf4da06a67a7"},
            "the model's patch: transformers_media (Qwen3-VL forward), core.instances (a late request)"),
    Covered("swift.template.base", "Template._get_inputs_embeds_hf", {"4.6.0": "07501ee9d670f640"},
            "right as released; fixes.mixed_media adds no second tower call"),
    Covered("swift.template.templates.qwen", "Qwen2VLTemplate._post_encode", {"4.6.0": "56f5eba582f54850"},
            "right as released (Qwen2-VL, Qwen2.5-VL, Qwen3.5)"),
    Covered("swift.template.templates.qwen", "Qwen3_5Template._post_encode", {"4.6.0": "380d3736f5cf9d1b"},
            "right as released: calls Qwen2VLTemplate._post_encode (Qwen3.5)"),
    Covered("swift.template.templates.glm", "GLM4VTemplate._post_encode", {"4.6.0": "255e24bcca49d772"},
            "right as released (GLM-4.1V)"),
    Covered("swift.rlhf_trainers.grpo_trainer", "GRPOTrainer.compute_liger_loss", {"4.6.0": "7abb65bd7fd87d1d"},
            "the model's patch: integrations.accelerate (the VLM tail unit gets its final norm)"),
    Covered("swift.rlhf_trainers.gkd_trainer", "GKDTrainer._compute_liger_loss", {"4.6.0": "fd4c61789dd74038"},
            "not covered: the teacher's base model runs outside its root unit (an ms-swift bug)", fixed=False),
)

INTEGRATION = Integration(
    dist="ms-swift",
    package="swift",
    wrap_module=None,  # ms-swift prepares models through accelerate (--fsdp fsdp2), not an apply_fsdp2
    covered=PATHS,
)

TARGETS = ()
