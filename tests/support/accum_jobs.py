"""Rank functions for the gradient-accumulation proofs (``tests/integrations/test_grad_accumulation.py``).

Each function runs several cases one after the other in the same pair of
rank processes (a fresh model and a fresh patch request per case, reverted
after it), because starting ranks costs more than the tiny models' training.

A case trains optimizer steps made of micro-batches through
``fsdp2_compat_harness.scenarios.train_against_reference``: every rank gets
different data, the unsharded fp32 reference trains on the data-parallel
average, and gradient sync is deferred on every micro-batch but the last of a
step (``sync="deferred"``, as verl's ``use_no_sync_for_gradient_accumulation``;
through accelerate, inside ``accelerator.no_sync`` as transformers' Trainer)
or on none (``sync="every"``).  "text" micro-batches carry no image (every
image token replaced by text), "image" ones an image; the pattern is the same
on every rank, as FSDP needs (a unit's all-gather is a collective).

Test-only catalogue entries (``TEST_PATCHES``) select single targets through
the real engine, to show what each seam alone does: registered in the rank
process only, like the toy patches of ``tests/core/conftest.py``.
"""

import contextlib

from fsdp2_compat_harness.scenarios import first_line, full_value, full_values, fused_loss, train_against_reference
from fsdp2_compat_harness.tiny.text import text_only  # noqa: F401  (used here and by the tests)

STEPS = (("text", "image"), ("image", "text", "image"))  # micro-batch kinds of step 0 and step 1
TEXT_STEPS = (("text", "text"), ("text", "text", "text"))


def _test_patches():
    from fsdp2_compat import registry
    from fsdp2_compat.core.records import Patch
    from fsdp2_compat.integrations import torch_fsdp, verl

    def patch(name, targets):
        return Patch(name, "test only", {}, targets, ("test",), "never")

    return (
        patch("t-selection", registry.WRAP_SELECTION),  # the selection fix, torch as released
        # the AttributeError guard alone (and LLaMA-Factory's layer-class lookup, as Qwen3-VL's patch
        # carries it: without it LLaMA-Factory's bf16 Qwen3-VL stops before any accumulation)
        patch("t-guard", registry.LF_LAYER_LOOKUP + (torch_fsdp.GRAD_ACCUM_GUARD,)),
        patch("t-selection-guard", registry.WRAP_SELECTION + (torch_fsdp.GRAD_ACCUM_GUARD,)),
        patch("t-accum", registry.GRAD_ACCUMULATION),  # both torch seams, nothing else
        # Qwen3-VL's patch without LLaMA-Factory's layer-class lookup (what that target is for)
        patch("t-qwen3vl-without-lookup", tuple(t for t in registry.patch("qwen3vl").targets
                                                if t not in registry.LF_LAYER_LOOKUP)),
    ) + tuple(
        # each family patch without its mixed text/image ranks targets (tests/integrations/test_mixed_ranks.py)
        patch("t-%s-without-mixed" % name, tuple(t for t in registry.patch(name).targets
                                                 if t not in registry.MIXED_MEDIA))
        for name in ("glm4v", "qwen3vl", "qwen2vl", "qwen35", "lfm2vl", "paddleocrvl", "qwen2audio", "voxtral",
                     "audioflamingo3", "hunyuanvl", "cosmos3", "step3p7", "chameleon", "deepseekocr2", "glmimage")
    ) + (
        # ... and without the fix of verl's own Qwen2-VL text-only dummy (verl.QWEN2_VL_FORWARD)
        patch("t-qwen2vl-without-verl-forward", tuple(t for t in registry.patch("qwen2vl").targets
                                                      if t not in registry.MIXED_MEDIA + verl.QWEN2_VL_FORWARD)),
    )


def register_test_patches():
    """Add ``_test_patches()`` to the catalogue of this (rank) process."""
    from fsdp2_compat import registry

    for p in _test_patches():
        if p.name not in registry.names():
            registry.register(p)


TOL = 1e-5
# bf16 params against an fp32 reference, two steps (as tests/integrations/test_fused_forwards.py)
BF16_GRAD, BF16_REL_TO_MAX = 1e-2, 6e-2


def assert_close(r, policy, where):
    """A case's result matches the data-parallel reference: fp32 to ``TOL``, bf16 within bf16 tolerance."""
    assert r["error"] is None, "%s: %s" % (where, r["error"])
    assert r["grads_checked"] > 0, where
    if policy == "fp32":
        assert r["loss_err"] < TOL and r["param_err"] < TOL, (where, r)
        assert r["grad_err"] < TOL, "%s: worst gradient %s %.2e" % (where, r["worst_grad"], r["grad_err"])
    else:
        assert r["grad_err"] < BF16_GRAD, "%s: worst gradient %s %.2e" % (where, r["worst_grad"], r["grad_err"])
        assert r["grad_rel_to_max"] < BF16_REL_TO_MAX, (where, r["worst_rel_to_max"], r["grad_rel_to_max"])
        assert r["lm_head_grad_err"] < BF16_GRAD, (where, r["lm_head_grad_err"])


def rank_kinds(step, rank):
    """The micro-batch kinds of ``rank`` in one step: ``step`` is one sequence for every rank
    (``("text", "image")``) or one per rank (``(("image",), ("text",))``: mixed across ranks)."""
    return step[rank] if step and isinstance(step[0], (tuple, list)) else step


def tiny_qwen3_5(seed=0, moe=False):
    """Tiny untied Qwen3.5 (verl's own ``qwen3_5`` fused forward): one linear-attention and one
    full-attention layer, depth-1 vision tower; ``moe``: Qwen3.5-MoE (4 experts, 2 per token, a shared
    expert).  Test-only (not a ``tooling.tiny`` family: its batches need ``use_cache=False``, verl
    0.9.1's gated-delta-net patch cannot read transformers 5.8's cache)."""
    import torch
    import transformers as T

    text = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, layer_types=["linear_attention", "full_attention"],
                linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2,
                max_position_embeddings=256, pad_token_id=0, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True, "partial_rotary_factor": 1.0})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=16)
    if moe:
        text.update(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    config_cls, model_cls = ((T.Qwen3_5MoeConfig, T.Qwen3_5MoeForConditionalGeneration) if moe else
                             (T.Qwen3_5Config, T.Qwen3_5ForConditionalGeneration))
    cfg = config_cls(text_config=text, vision_config=vision, image_token_id=250, video_token_id=251,
                     vision_start_token_id=252, vision_end_token_id=253, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(cfg)
    return model.float().train()


def tiny_qwen2_vl(seed=0):
    """Tiny untied Qwen2-VL, as ``tooling.tiny``'s Qwen2.5-VL (same patch grid and batches: ``make_batch``
    of ``qwen2_5_vl`` fits it) with Qwen2-VL's own vision config.  Test-only, for the mixed-ranks proofs
    (``test_mixed_families.py``): as a ``tooling.tiny`` family it would add rows to every family-wide test."""
    import torch
    import transformers as T

    from fsdp2_compat_harness.tiny.configs import _text, rope

    vision = dict(depth=1, embed_dim=32, hidden_size=32, mlp_ratio=2, num_heads=2, in_channels=3, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2)
    cfg = T.Qwen2VLConfig(text_config=_text(False, **rope(mrope_section=[2, 3, 3])), vision_config=vision,
                          image_token_id=250, video_token_id=251, vision_start_token_id=252,
                          vision_end_token_id=253, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = T.Qwen2VLForConditionalGeneration(cfg)
    return model.float().train()


# Test-only families (not in tooling.tiny): their builders, and the tiny family whose batches fit them.
TEST_ONLY = {"qwen3_5": (tiny_qwen3_5, None), "qwen3_5_moe": (lambda seed=0: tiny_qwen3_5(seed, moe=True), None),
             "qwen2_vl": (tiny_qwen2_vl, "qwen2_5_vl")}


class _HeadOutput:
    def __init__(self, loss):
        self.loss = loss


CHUNK = 7  # rows of hidden states per lm_head read


def chunked_head_forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
    """A causal-LM forward whose loss reads ``lm_head.weight`` once per chunk of rows (a chunked
    cross-entropy) through ``fsdp2_compat.fixes.gather``: one weight, several uses in one graph."""
    import torch.nn.functional as F

    from fsdp2_compat.fixes import gather

    kwargs.pop("return_dict", None)
    hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)[0]
    targets = (labels if labels is not None else input_ids)[:, 1:].reshape(-1)
    hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    total, count = 0.0, 0
    with gather.gathered(self.lm_head):
        for start in range(0, hidden.shape[0], CHUNK):
            weight = gather.gather_param(self.lm_head)
            logits = (hidden[start:start + CHUNK].to(weight.dtype) @ weight.t()).float()
            t = targets[start:start + CHUNK]
            keep = t != -100
            total = total + F.cross_entropy(logits, t.clamp_min(0), reduction="none")[keep].sum()
            count += int(keep.sum())
    return _HeadOutput(total / count)


def never_gathered_units(model):
    """FSDP units (module names) with a parameter that was never all-gathered."""
    from torch.distributed.fsdp import FSDPModule

    from fsdp2_compat.fixes.accumulation import never_all_gathered

    out = []
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            for group in _groups(module):
                if any(never_all_gathered(p) for p in group.fsdp_params):
                    out.append(name or "<root>")
    return sorted(set(out))


def _policies(model):
    """The ``[param_dtype, reduce_dtype]`` pairs of the model's FSDP units, as their wrapping set them."""
    from torch.distributed.fsdp import FSDPModule

    # torch <= 2.14 keeps one policy per group; 2.15 resolves it per parameter (FSDPParam.mp_policy)
    policies = [p for m in model.modules() if isinstance(m, FSDPModule) for g in _groups(m)
                for p in ([g.mp_policy] if hasattr(g, "mp_policy") else [f.mp_policy for f in g.fsdp_params])]
    pairs = {(str(p.param_dtype), str(p.reduce_dtype)) for p in policies}
    return [list(p) for p in sorted(pairs)]


def _groups(module):
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return groups


def _prepare(rank, world, framework, model, policy):
    """``model`` sharded through ``framework``'s own entry point, and the context in which
    its trainer runs a micro-batch whose gradient sync is deferred: ``(model, no_sync)``.

    ``framework``: a wrapping integration (``frameworks.shard``: verl's / SkyRL's
    ``apply_fsdp2``, AReaL's ``parallelize_model``, LLaMA-Factory's
    ``FSDP2Engine.prepare_model``), its deferral FSDP2's own switch; or
    ``"accelerate"`` (``trl_scenarios.prepare_for_accumulation``), its deferral
    ``accelerator.no_sync(model)``.
    """
    if framework == "accelerate":
        from fsdp2_compat_harness import trl_scenarios

        model, accelerator = trl_scenarios.prepare_for_accumulation(rank, world, model, policy)
        return model, lambda: accelerator.no_sync(model)
    from fsdp2_compat_harness import frameworks

    frameworks.shard(framework, model, world, policy)
    return model, lambda: _requires_no_gradient_sync(model)


@contextlib.contextmanager
def _requires_no_gradient_sync(model):
    # What verl's use_no_sync_for_gradient_accumulation does around a micro-batch (AReaL's and
    # LLaMA-Factory's engines never defer: this is the same switch a user's loop would set).
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _build(family, fused):
    from fsdp2_compat_harness import tiny

    model = TEST_ONLY[family][0]() if family in TEST_ONLY else tiny.build(family, tie=False, seed=0)
    if fused:
        from verl.models.transformers.monkey_patch import apply_monkey_patch

        apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True, fused_kernels_backend="torch")
    return model


def _micro_batch(family, reference, seed, kind, fused):
    from fsdp2_compat_harness import tiny
    from fsdp2_compat_harness.verl_batches import add_verl_position_ids

    if family in TEST_ONLY and TEST_ONLY[family][1]:
        family = TEST_ONLY[family][1]
    if family in ("qwen3_5", "qwen3_5_moe"):  # text-only micro-batches, as in verl issue #7520; images as Qwen3-VL's
        batch = tiny.make_batch("qwen3_vl" if kind == "image" else "qwen2", reference, seed=seed)
        batch["use_cache"] = False
    elif kind in ("video", "image+video", "image+crops"):  # VIDEO_FAMILIES' videos; local crops
        batch = tiny.make_batch(family, reference, seed=seed, media=tuple(kind.split("+")))
    else:
        batch = tiny.make_batch(family, reference, seed=seed)
        if kind == "text" and ("pixel_values" in batch or "input_features" in batch):
            batch = text_only(batch, seed + 1000)
    if fused:
        batch.pop("labels", None)
        add_verl_position_ids(reference, batch)
    return batch


def _one_case(rank, world, framework, family, fused, patches, policy, sync, steps, chunked=False, checkpointing=None):
    """One training run; returns the result dict of ``train_against_reference`` plus the evidence.

    ``chunked``: the model class's forward is ``chunked_head_forward`` for this run; ``checkpointing``:
    ``"reentrant"`` or ``"non-reentrant"``: transformers' own gradient checkpointing, enabled before sharding.
    """
    import copy

    import fsdp2_compat
    from fsdp2_compat.fixes import gather, media_merge, mixed_media, unit_walk, vq_tokens
    from fsdp2_compat_harness import scenarios

    if patches:
        fsdp2_compat.apply(patches)
    if framework != "accelerate":
        scenarios.import_fsdp_utils(framework)  # the wrapping module first, as a trainer imports it
    model = _build(family, fused)
    if checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    if chunked:  # before sharding, as verl installs its forwards; restored after the run
        model_class = type(model)
        saved_forward = model_class.__dict__["forward"]
        model_class.forward = chunked_head_forward
    reference = copy.deepcopy(model)
    model, no_sync = _prepare(rank, world, framework, model, policy)
    result = {"wrapped": scenarios.wrapped_module_names(model), "policies": _policies(model), "error": None,
              "losses": [], "loss_err": 0.0, "grad_err": 0.0, "worst_grad": None, "param_err": 0.0, "grads_checked": 0, "lm_head_grad_err": 0.0,
              "never_gathered_after_first": None, "grads": [], "lm_head_sharded_after_backward": []}
    releases_before = gather.STATS["early_releases"]
    dummies_before = mixed_media.STATS["dummy_forwards"]
    walks_before, unusable_before = unit_walk.STATS["walks"], unit_walk.STATS["unusable"]
    merged_before = media_merge.STATS["merged_forwards"]
    encodes_before = vq_tokens.STATS["encodes"]
    lm_head = getattr(model, "lm_head", None)
    lm_group = gather._owning(lm_head, lm_head.weight)[0] if lm_head is not None and hasattr(
        lm_head, "_get_fsdp_state") else None

    def after_backward():
        if lm_group is not None:
            result["lm_head_sharded_after_backward"].append(lm_group.is_sharded)
    if policy != "fp32":
        result.update(grad_rel_to_max=0.0, worst_rel_to_max=None)

    def forward_loss(module, batch):
        if fused:
            return fused_loss(module(**batch, return_dict=True), batch)
        return module(**batch).loss

    def loss_of(module, micro_batches):
        # Every micro-batch but the last is backpropagated here; the caller
        # backpropagates the last (train_against_reference: the sharded model's
        # loss as is, the reference's summed over ranks / world).
        sharded = module is model
        n = len(micro_batches)
        for i, batch in enumerate(micro_batches):
            deferred = sharded and sync == "deferred" and i < n - 1
            with no_sync() if deferred else contextlib.nullcontext():  # forward and backward, as the trainers
                loss = forward_loss(module, batch) / n
                if i < n - 1:
                    (loss if sharded else loss / world).backward()
            if sharded and i < n - 1:
                after_backward()
                if result["never_gathered_after_first"] is None:
                    result["never_gathered_after_first"] = never_gathered_units(model)
        return loss, None

    def batches_for(step):
        return [[_micro_batch(family, reference, 1 + 100 * step + 10 * mb + r, kind, fused)
                 for mb, kind in enumerate(rank_kinds(steps[step], r))] for r in range(world)]

    def snapshot(_out, _ref_out):
        after_backward()  # the step's last micro-batch (train_against_reference backpropagated it)
        named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
        result["grads"].append({n: g.float().clone() for (n, _), g in zip(named, full_values([p.grad for _, p in named]))})

    try:
        train_against_reference(model, reference, rank, world, result, batches_for, loss_of, len(steps),
                                compare=snapshot)
    finally:
        model.set_requires_gradient_sync(True)
        if chunked:
            model_class.forward = saved_forward
    result["early_releases"] = gather.STATS["early_releases"] - releases_before
    result["dummy_forwards"] = mixed_media.STATS["dummy_forwards"] - dummies_before
    result["walks"] = unit_walk.STATS["walks"] - walks_before  # of which walked (fixes.unit_walk)
    result["unwalkable"] = unit_walk.STATS["unusable"] - unusable_before  # records the walk could not mirror
    result["merged_forwards"] = media_merge.STATS["merged_forwards"] - merged_before
    result["vq_encodes"] = vq_tokens.STATS["encodes"] - encodes_before  # GLM-Image's one tokenizer call
    return result


def accumulation_cases(rank, world, framework, family, cases, pairs=(), fused=False, chunked=False):
    """Run ``cases`` ``[(name, patches, policy, sync, steps[, checkpointing])]`` in order; ``{name: result}``.

    ``framework``: as for ``_prepare`` (the fused and chunked runs: verl).
    ``patches``: a list of catalogue names (the test-only ones included) or
    None; ``policy``: "bf16" (bf16 params, fp32 reduce) or "fp32", given to the
    framework its own way (``frameworks.shard``), and for accelerate also
    "bf16-reduce" (its own bf16 policy, ``trl_scenarios``); ``steps``:
    "mixed" (``STEPS``), "text" (``TEXT_STEPS``) or the steps themselves,
    per rank where they differ across ranks (``rank_kinds``).  For each ``(a, b)`` of
    ``pairs``, ``"a vs b"`` is the worst ``max |a-b|/(1+|b|)`` between the
    gradients of the two cases, step by step (e.g. deferred vs every-micro-batch
    sync of the same model and data).
    """
    import fsdp2_compat
    from fsdp2_compat_harness.scenarios import rel_err

    register_test_patches()
    out = {}
    for name, patches, policy, sync, steps, *checkpointing in cases:
        try:
            kinds = {"mixed": STEPS, "text": TEXT_STEPS}.get(steps, steps)
            out[name] = _one_case(rank, world, framework, family, fused, patches, policy, sync, kinds, chunked,
                                  *checkpointing)
        except Exception as exc:  # a harness failure, not a training failure: report, go on
            out[name] = {"error": "harness: %s: %s" % (type(exc).__name__, first_line(exc)), "grads": []}
        finally:
            fsdp2_compat.revert()
    for a, b in pairs:
        ga, gb = out[a]["grads"], out[b]["grads"]
        if ga and len(ga) == len(gb):
            out["%s vs %s" % (a, b)] = max(rel_err(x[k], y[k]) for x, y in zip(ga, gb) for k in y)
    for result in out.values():
        if isinstance(result, dict):
            result.pop("grads", None)
    return out


def adopt_convention(model, convention):
    """Make torch reach both accumulation seams by ``convention`` (``tooling.conventions``) in ``model``:
    every ``FSDPParam`` / ``FSDPParamGroup`` of its units gets the subclass that calls torch's method that way.
    Returns how many objects were given one."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from fsdp2_compat_harness.conventions import adopt

    count = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in _groups(module):
                adopt(group, FSDPParamGroup, "post_backward", convention)
                for fsdp_param in group.fsdp_params:
                    adopt(fsdp_param, FSDPParam, "to_accumulated_grad_if_needed", convention)
                count += 1 + len(group.fsdp_params)
    return count


def toy_accumulation(rank, world, patches, unused=False, sync="deferred", convention="instance"):
    """Pure torch (no transformers): root(text Linear, vis_proj Linear, child unit tower), 2 micro-batches.

    Micro-batch 0 is "text only" (``tower`` and ``vis_proj`` unused) with sync
    deferred; micro-batch 1 uses everything with sync on (``unused``: again
    text only, with ``set_reduce_scatter_unused_params(True)``); ``sync="every"``
    syncs both.  bf16 params, fp32 reduce.  Different data per rank; the
    gradient is compared with an unsharded fp32 copy trained on the
    data-parallel average, and returned (``grads``, full values as lists).
    ``convention``: how torch's own calls reach the two accumulation methods
    (``adopt_convention``).
    """
    import copy

    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fsdp2_compat
    from fsdp2_compat_harness.frameworks import mp_policy
    from fsdp2_compat_harness.scenarios import rel_err

    register_test_patches()
    if patches:
        fsdp2_compat.apply(patches)

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.text = nn.Linear(8, 8)
            self.vis_proj = nn.Linear(8, 8)  # in the root unit, used only with an "image"
            self.tower = nn.Sequential(nn.Linear(8, 8))  # its own unit, used only with an "image"

        def forward(self, x, image=None):
            h = self.text(x)
            if image is not None:
                h = h + self.vis_proj(self.tower(image))
            return h.float().pow(2).mean()

    torch.manual_seed(0)
    model = Toy()
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.tower, mesh=mesh, mp_policy=mp_policy("bf16"))
    fully_shard(model, mesh=mesh, mp_policy=mp_policy("bf16"))
    adopted = adopt_convention(model, convention)
    gen = torch.Generator().manual_seed(7)
    data = [(torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)) for _ in range(world)]
    result = {"error": None, "grad_err": None, "adopted": adopted}
    try:
        if unused:
            model.set_reduce_scatter_unused_params(True)
        model.set_requires_gradient_sync(sync == "every")
        model(data[rank][0]).backward()
        model.set_requires_gradient_sync(True)
        (model(data[rank][0]) if unused else model(*data[rank])).backward()
    except Exception as exc:
        result["error"] = "%s: %s" % (type(exc).__name__, str(exc).strip().splitlines()[-1])
        return result
    for x, img in data:
        (reference(x) / world).backward()
        ((reference(x) if unused else reference(x, img)) / world).backward()

    def grad(p):  # an unused parameter: no gradient, or the zero torch reduce-scattered for it
        g = full_value(p.grad)
        return torch.zeros_like(full_value(p.detach())) if g is None else g

    result["grad_err"] = max(rel_err(grad(p), grad(q)) for p, q in zip(model.parameters(), reference.parameters()))
    result["grads_checked"] = sum(q.grad is not None for q in reference.parameters())
    result["grads"] = {n: grad(p).tolist() for n, p in model.named_parameters()}
    return result
