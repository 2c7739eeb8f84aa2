"""Training scenarios on real FSDP2, through each framework's own entry point (``frameworks.shard``).

``train(rank, world, framework, family, patches, ...)`` builds a tiny model,
keeps an unsharded deep copy as the reference, shards the model with the
framework's real ``apply_fsdp2`` (``FSDP2Engine.prepare_model`` for
LLaMA-Factory, ``parallelize_model`` for AReaL) and runs optimizer steps where every rank
gets *different* data.  The reference trains on the mean of all ranks'
losses, i.e. the data-parallel average gradient, so a rank that only sees its
own gradient (the ``full_tensor()`` trap) cannot match it.

``train_against_reference`` is that loop, shared by ``train`` (each
framework's ``apply_fsdp2``), ``train_fused`` (verl's fused-kernel forwards)
and the test-suite's own scenarios (``tests/support``).

The result is a plain dict (picklable across ranks): the wrapped module names,
the first error message if the forward or backward raised, per-step losses
and the worst errors (``max |a - b| / (1 + |b|)``) of loss, gradients and
parameters against the reference.
"""

import warnings

from .frameworks import ensure_skyrl_backends_package, import_fsdp_utils  # noqa: F401  (re-exported)


def tie_flag_refusal(framework, config):
    """Why ``framework``'s ``apply_fsdp2`` refuses a model with this config, patched or not, or None.

    SkyRL and skyrl-train (every release) and verl < 0.7.1 select with
    ``model.config.tie_word_embeddings`` read without a default (verl 0.7.1+
    uses ``getattr(..., False)``); a config class without that top-level
    attribute (Step-3.7) makes them raise ``AttributeError`` before anything
    is sharded.  Our patch keeps upstream's loop, so it cannot change that.
    """
    from fsdp2_compat.core import guards

    if hasattr(config, "tie_word_embeddings"):
        return None
    version = guards.installed_version(framework)
    if framework == "verl" and (version is None or guards.in_range(version, ">=0.7.1")):
        return None
    return ("%s %s reads model.config.tie_word_embeddings without a default and %s has no top-level "
            "tie_word_embeddings: AttributeError in apply_fsdp2, patched or not" % (framework, version, type(config).__name__))


def first_line(exc):
    """The first line of an exception's message (the part a table can show)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else repr(exc)


def wrapped_module_names(model):
    from torch.distributed.fsdp import FSDPModule

    return sorted(name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule))


def rel_err(actual, expected):
    """max |a - b| / (1 + |b|): below ``tol`` means ``allclose(atol=tol, rtol=tol)``.

    A pure relative error is meaningless for gradients that are zero up to
    rounding (e.g. attention key biases, which softmax ignores).

    ``None`` (torch's "no gradient") equals an exactly-zero gradient: the
    mixed-ranks fix gives a vision tower a text-only micro-batch skipped an
    exact zero (its collectives must run on every rank), where the unsharded
    reference, which skips the tower, has none.  Any non-zero value against
    ``None`` is still an infinite error.
    """
    if actual is None or expected is None:
        other = expected if actual is None else actual
        if other is None or not bool(other.detach().ne(0).any()):
            return 0.0
        return float("inf")
    actual = actual.detach().float()
    expected = expected.detach().float()
    if not actual.numel():
        return 0.0
    return float(((actual - expected).abs() / (1 + expected.abs())).max())


def full_value(t):
    """``t`` as a plain full tensor (a sharded DTensor is gathered; ``None`` stays ``None``)."""
    from torch.distributed.tensor import DTensor

    if t is None:
        return None
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_values(tensors):
    """``full_value`` of each of ``tensors``, detached: one all-gather per mesh and dtype instead of one each.

    The comparisons gather every parameter and gradient of a model after each step, and ``full_tensor()``
    per tensor costs a collective and DTensor's dispatch each time (a sixth of a rank's time in the tests).
    A DTensor sharded ``Shard(0)`` on a 1-D mesh (FSDP2's layout) joins its group's one flat all-gather: every
    rank knows each rank's rows (``torch.chunk`` along dim 0, as ``Shard(0)`` splits), so the full tensors are
    cut back out of it.  Any other DTensor is gathered by ``full_tensor()``; plain tensors and ``None`` pass.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    out = list(tensors)
    groups = {}
    with torch.no_grad():
        for i, t in enumerate(out):
            if not isinstance(t, DTensor):
                out[i] = t.detach() if t is not None else None
            elif t.device_mesh.ndim == 1 and len(t.placements) == 1 and type(t.placements[0]) is Shard \
                    and t.placements[0].dim == 0 and t.dim() > 0:
                groups.setdefault((id(t.device_mesh), t.dtype), []).append(i)
            else:
                out[i] = t.full_tensor().detach()
        for indexes in groups.values():
            _gather_rows(out, indexes, torch, dist)
    return out


def _gather_rows(out, indexes, torch, dist):
    """Replace ``out[i]`` (DTensors on one 1-D mesh, one dtype, ``Shard(0)``) by their full tensors."""
    mesh = out[indexes[0]].device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    sizes = []  # per tensor: each rank's element count
    for i in indexes:
        shape = out[i].shape
        rows, per_row = shape[0], out[i].numel() // max(shape[0], 1)
        chunk = -(-rows // world)
        sizes.append([max(0, min(chunk, rows - r * chunk)) * per_row for r in range(world)])
    locals_ = [out[i].to_local().detach().reshape(-1) for i in indexes]
    if [t.numel() for t in locals_] != [s[rank] for s in sizes]:  # not the layout assumed: one by one
        for i in indexes:
            out[i] = out[i].full_tensor().detach()
        return
    width = max(sum(s[r] for s in sizes) for r in range(world))
    flat = torch.cat(locals_)
    send = torch.zeros(width, dtype=flat.dtype, device=flat.device)
    send[: flat.numel()] = flat
    gathered = torch.empty(world * width, dtype=send.dtype, device=send.device)
    dist.all_gather_into_tensor(gathered, send, group=mesh.get_group())
    parts = gathered.view(world, width)
    offsets = [0] * world
    for k, i in enumerate(indexes):
        pieces = []
        for r in range(world):
            pieces.append(parts[r, offsets[r]: offsets[r] + sizes[k][r]])
            offsets[r] += sizes[k][r]
        out[i] = torch.cat(pieces).view(out[i].shape)


def _step(*optimizers):
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def train_against_reference(model, reference, rank, world, result, batches_for, loss_of, steps=2, lr=0.05,
                            compare=None):
    """SGD steps on this rank's batch (``model``) and on the mean of every rank's (``reference``).

    ``batches_for(step)`` gives one batch per rank (different data); ``loss_of(module,
    batch)`` returns ``(loss, output)``.  After each step the worst loss and
    gradient errors are folded into ``result`` (``_compare_grads``), and
    ``compare(output, reference_output)`` may fold more; at the end,
    ``param_err``.  If the sharded forward or backward raises, ``result["error"]``
    says which step and how, and training stops there.
    """
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    for step in range(steps):
        batches = batches_for(step)
        try:
            loss, out = loss_of(model, batches[rank])
            loss.backward()
        except Exception as exc:
            result["error"] = "step %d: %s: %s" % (step, type(exc).__name__, first_line(exc))
            return result
        ref = [loss_of(reference, b) for b in batches]
        (sum(loss for loss, _ in ref) / world).backward()
        result["losses"].append(loss.item())
        result["loss_err"] = max(result["loss_err"], rel_err(loss, ref[rank][0]))
        if compare is not None:
            compare(out, ref[rank][1])
        _compare_grads(model, reference, result)
        _step(optimizer, ref_optimizer)
    result["param_err"] = _param_err(model, reference)
    return result


def _param_err(model, reference):
    """Worst parameter error after training, sharded parameters gathered."""
    full = full_values(list(model.parameters()))
    return max((rel_err(f, q) for f, q in zip(full, reference.parameters())), default=0.0)


def _compare_grads(model, reference, result):
    """Fold one step's gradients into ``result``'s worst errors, by parameter name.

    Always ``grad_err`` / ``worst_grad``; also each of ``grads_checked``,
    ``lm_head_grad_err``, ``lm_head_rel_to_max`` and ``grad_rel_to_max`` /
    ``worst_rel_to_max`` that ``result`` has.  ``grad_rel_to_max`` (for low-precision runs) skips
    gradients below 1e-3 of the largest, whose relative error is noise.
    """
    if "grad_rel_to_max" in result:
        ref_scale = max((float(q.grad.abs().max()) for q in reference.parameters() if q.grad is not None), default=0.0)
    named = list(model.named_parameters())
    grads = full_values([p.grad for _, p in named])
    for (name, _), grad, q in zip(named, grads, reference.parameters()):
        err = rel_err(grad, q.grad)
        if "grads_checked" in result:
            result["grads_checked"] += int(q.grad is not None)
        if name == "lm_head.weight" and "lm_head_grad_err" in result:
            result["lm_head_grad_err"] = max(result["lm_head_grad_err"], err)
            if "lm_head_rel_to_max" in result and q.grad is not None:
                result["lm_head_rel_to_max"] = max(result["lm_head_rel_to_max"], _rel_to_max(grad, q.grad))
        if err > result["grad_err"]:
            result["grad_err"], result["worst_grad"] = err, name
        if "grad_rel_to_max" in result and q.grad is not None and float(q.grad.abs().max()) > 1e-3 * ref_scale:
            rel = _rel_to_max(grad, q.grad)
            if rel > result["grad_rel_to_max"]:
                result["grad_rel_to_max"], result["worst_rel_to_max"] = rel, name


def train(rank, world, framework, family, patches, steps=2, tie=False, lr=0.05, lora=False, config_attrs=None):
    """One scenario on this rank; see the module docstring for the result.

    The model is sharded through the framework's own entry point
    (``frameworks.shard``: ``apply_fsdp2``, AReaL's ``parallelize_model``,
    LLaMA-Factory's ``FSDP2Engine.prepare_model``).  ``tie``: as for
    ``tiny_models.build`` (False, True or ``"weights-only"``); ``lora``: wrap
    the model in a peft LoRA model first (``with_lora``); ``config_attrs``:
    attributes set on ``model.config`` after the build, as a config.json
    carrying those keys would give them (e.g. a top-level
    ``tie_word_embeddings`` that the config class does not declare).
    """
    import copy

    import fsdp2_compat
    from fsdp2_compat_harness import frameworks, tiny as tiny_models

    if patches:
        fsdp2_compat.apply(patches)
    import_fsdp_utils(framework)

    model = tiny_models.build(family, tie=tie, seed=0)
    for key, value in (config_attrs or {}).items():
        setattr(model.config, key, value)
    if lora:
        model = with_lora(model)
    reference = copy.deepcopy(model)
    result = {
        "wrapped": None,
        "error": None,
        "losses": [],
        "loss_err": 0.0,
        "grad_err": 0.0,
        "worst_grad": None,
        "param_err": 0.0,
        "grads_checked": 0,
    }
    try:
        frameworks.shard(framework, model, world)
    except Exception as exc:  # torch refuses some broken plans at wrap time
        result["error"] = "%s: %s: %s" % (frameworks.entry_name(framework), type(exc).__name__, first_line(exc))
        return result
    result["wrapped"] = wrapped_module_names(model)

    def loss_of(module, batch):
        out = module(**batch)
        return out.loss, out

    def batches_for(step):
        return [tiny_models.make_batch(family, reference, seed=1 + step * world + r) for r in range(world)]

    return train_against_reference(model, reference, rank, world, result, batches_for, loss_of, steps, lr)


def with_lora(model, seed=0):
    """``model`` as a peft LoRA model (r=4 on ``q_proj`` / ``v_proj``, Gaussian-initialised ``lora_B``,
    so the adapters change the output and get gradients from the first step)."""
    import peft
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
        return peft.get_peft_model(model, config)


def _rel_to_max(actual, expected):
    """max |a - b| / max |b| (for low-precision comparisons of non-negligible tensors)."""
    actual = actual.detach().float()
    expected = expected.detach().float()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12))


def fused_loss(out, batch):
    """A PPO-shaped scalar from verl's fused outputs: masked log-prob mean plus entropy bonus."""
    mask = batch["attention_mask"].to(out.log_probs.dtype)
    return -(out.log_probs * mask).sum() / mask.sum() - 0.01 * (out.entropy * mask).sum() / mask.sum()


def train_fused(rank, world, family, patches, steps=2, mesh_shape=None, bf16=False, lr=0.05, convention="instance",
                offload=False):
    """verl's fused-kernel path (``use_fused_kernels=True``, torch backend) on real FSDP2.

    The model goes through verl's own ``apply_monkey_patch`` and
    ``apply_fsdp2``; the reference is an unsharded copy with the same verl
    forward, trained on the mean loss of all ranks' (different) batches.
    ``mesh_shape=(2, 2)`` gives an HSDP mesh; ``bf16`` a bf16
    ``MixedPrecisionPolicy`` (fp32 reduce).  The dtype and kind of the
    ``vocab_weights`` that reach ``FusedLinearForPPO`` are recorded, as are
    which verl forward was installed (``forward``), how often the vision
    tower ran in the sharded forwards and fsdp2-compat's own warnings.
    Batches carry verl's 4-row position ids where its forward takes them
    (Qwen2-VL family, GLM4V).  ``patches`` as for ``subset.apply`` (names, or
    target keys: verl's GLM4V forward runs on most transformers only with the
    ``glm4v`` patch's forward targets, so GLM4V's "unpatched" side names them).
    ``convention``: how the sharded model's ``forward`` reaches the one verl
    installed on its class (``fsdp2_compat_harness.conventions``).  ``offload``:
    ``offload_policy=CPUOffloadPolicy(pin_memory=False)``, a named stand-in for
    verl's pinned policy (pinning needs an accelerator; on CPU the compute device
    is the CPU, so only the gradient's averaging is shown, never a device).
    """
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp2_compat_harness import subset, tiny as tiny_models
    from fsdp2_compat_harness.conventions import adopt

    subset.apply(patches)
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils import fsdp_utils
    from verl.utils.experimental import torch_functional

    model = tiny_models.build(family, tie=False, seed=0)
    apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True, fused_kernels_backend="torch")
    installed = type(model).forward.__module__
    reference = copy.deepcopy(model)
    adopt(model, type(model), "forward", convention)
    if mesh_shape is None:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    else:
        mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=("ddp", "fsdp"))
    kwargs = {"mesh": mesh}
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    fsdp_utils.apply_fsdp2(model, kwargs, {})

    seen, recording = [], [False]
    original_forward = torch_functional.FusedLinearForPPO.forward

    def spy(self, hidden_states, vocab_weights, *args, **kwargs):
        if recording[0]:  # the sharded model's calls, not the reference's
            seen.append((type(vocab_weights).__name__, str(vocab_weights.dtype), tuple(vocab_weights.shape)))
        return original_forward(self, hidden_states, vocab_weights, *args, **kwargs)

    torch_functional.FusedLinearForPPO.forward = spy
    from fsdp2_compat_harness.verl_batches import add_verl_position_ids

    result = {
        "wrapped": wrapped_module_names(model),
        "forward": installed,  # which verl fused forward apply_monkey_patch installed
        "error": None,
        "losses": [],
        "logprob_err": 0.0,
        "loss_err": 0.0,
        "grad_err": 0.0,
        "worst_grad": None,
        "grads_checked": 0,  # reference gradients compared (the trainable parameters': LoRA's adapters alone)
        "lm_head_grad_err": 0.0,
        "grad_rel_to_max": 0.0,
        "worst_rel_to_max": None,
        "param_err": 0.0,
        "kernel_weights": seen,
        "vision_calls": 0,  # did the vision tower run in the sharded forward?
        "dummy_forwards": 0,  # ... of which the mixed-ranks fix's zero-contribution dummies (no image)
        "walks": 0,  # ... and of those, walked without the tower's code (fixes.unit_walk)
        "warnings": [],  # fsdp2-compat's own warnings during the sharded forwards
    }
    def count_vision_call(*_):
        if recording[0]:
            result["vision_calls"] += 1

    visual = getattr(getattr(model, "model", None), "visual", None)
    if visual is not None:
        visual.register_forward_hook(count_vision_call)

    def batches_for(step):
        batches = []
        for r in range(world):
            batch = tiny_models.make_batch(family, reference, seed=1 + step * world + r)
            batch.pop("labels", None)
            add_verl_position_ids(reference, batch)  # verl's Qwen2-VL / GLM4V forwards take 4-row ids
            batches.append(batch)
        return batches

    def loss_of(module, batch):
        recording[0] = module is model
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = module(**batch, return_dict=True)
        finally:
            recording[0] = False
        if module is model:
            result["warnings"] += [str(w.message) for w in caught if str(w.message).startswith("fsdp2-compat")]
        return fused_loss(out, batch), out

    def compare(out, ref_out):
        result["logprob_err"] = max(result["logprob_err"], rel_err(out.log_probs, ref_out.log_probs))

    from fsdp2_compat.fixes import mixed_media, unit_walk

    dummies = mixed_media.STATS["dummy_forwards"]  # only the sharded model runs them (its tower is sharded)
    walks = unit_walk.STATS["walks"]
    try:
        return train_against_reference(model, reference, rank, world, result, batches_for, loss_of, steps, lr, compare)
    finally:
        result["dummy_forwards"] = mixed_media.STATS["dummy_forwards"] - dummies
        result["walks"] = unit_walk.STATS["walks"] - walks
        torch_functional.FusedLinearForPPO.forward = original_forward
