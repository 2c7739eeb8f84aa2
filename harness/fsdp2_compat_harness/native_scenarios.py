"""transformers' native FSDP2 on real ranks: ``from_pretrained(..., distributed_config=DistributedConfig(...))``.

``native_cases(rank, world, directory, cases)`` runs every case in one pair of rank processes: rank 0 saves a
tiny model (``save_pretrained``), every rank loads it with the released ``from_pretrained(path,
distributed_config=DistributedConfig(fsdp_size=world, **case["config"]))`` (transformers'
``apply_fully_sharded_data_parallelism``: nothing replaced), and an unsharded copy of the same checkpoint is
the reference trained on the data-parallel average (``scenarios.train_against_reference``, different data per
rank).  A case is a dict:

- ``family``: a tiny family (``tiny``), ``"phi"`` (``tiny_phi`` below: final norm ``final_layernorm``) or
  ``"qwen3_5"`` (with ``build``: the builder of a test-only tiny model);
- ``patches``: what ``subset.apply`` takes (None: unpatched);
- ``read``: None (the model's own forward) or ``"raw"`` / ``"full_tensor"`` / ``"gather"``: a Liger-style reader
  of ``self.lm_head.weight`` inside the forward (``accelerate_scenarios.reader_forward``; Liger needs Triton);
- ``kinds``: per step, each rank's micro-batch kind (``("image", "text")``: rank 0 an image, rank 1 text only);
- ``config``: more ``DistributedConfig`` fields; ``offload="unpinned"``: ``fsdp_cpu_offload=True`` with the named
  stand-in ``unpinned_offload`` (transformers builds ``CPUOffloadPolicy()``, pinned, which needs an accelerator);
  ``offload="pinned"``: as released.

After each case every rank writes its results so far to ``directory/rank<N>.json``, and its stderr goes to
``directory/rank<N>.err``: an unpatched case whose collectives differ across ranks makes gloo abort the process
(nothing returns), so such a case goes last and ``collect`` reads what was written.
"""


CASE = {"patches": None, "read": None, "kinds": (("image", "image"),), "config": {}, "offload": None, "build": None}


def tiny_phi(seed=0):
    """Tiny Phi (text): its final norm is ``model.final_layernorm``, which transformers' default ``norm`` rule does
    not name, so native FSDP2 keeps ``lm_head`` (``keep_full_weight``) in a unit of its own."""
    import torch
    import transformers as T

    cfg = T.PhiConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                      tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return T.PhiForCausalLM(cfg).float().train()


def build(case):
    from . import tiny

    if case["build"] is not None:
        return case["build"]()
    return tiny_phi() if case["family"] == "phi" else tiny.build(case["family"], tie=False, seed=0)


def batch(family, model, seed, kind):
    """A micro-batch of ``kind`` (``"image"`` / ``"text"``) for ``model``, labels included."""
    from . import tiny
    from .tiny.text import text_only

    if family in ("phi", "qwen3_5"):  # Qwen3.5: Qwen3-VL's image batches, plain text rows
        b = tiny.make_batch("qwen3_vl" if family == "qwen3_5" and kind == "image" else "qwen2", model, seed=seed)
        if family == "qwen3_5":
            b["use_cache"] = False
        return b
    b = tiny.make_batch(family, model, seed=seed)
    return text_only(b, seed + 1000) if kind == "text" and "pixel_values" in b else b


def unpinned_offload():
    """Stand-in (named): ``fsdp_cpu_offload=True`` builds ``CPUOffloadPolicy()``, whose ``pin_memory=True`` needs
    an accelerator (torch 2.13 CPU: "Cannot access accelerator device when none is available."); on CPU the policy
    transformers builds is ``pin_memory=False``.  Nothing else of transformers' code changes.  Returns an undo."""
    import functools

    from torch.distributed.fsdp import CPUOffloadPolicy
    from transformers.distributed import fsdp as tf_fsdp

    before = tf_fsdp.__dict__["CPUOffloadPolicy"]
    tf_fsdp.CPUOffloadPolicy = functools.partial(CPUOffloadPolicy, pin_memory=False)
    return lambda: setattr(tf_fsdp, "CPUOffloadPolicy", before)


def native_cases(rank, world, directory, cases):
    """Every case in order (see the module doc); returns the results (when no case aborted the process)."""
    from .mixed import stderr_to_file
    from .rank_cases import each_case

    stderr_to_file(directory, rank)
    return each_case(rank, world, directory, cases, CASE, native_case)


def native_case(rank, world, path, case):
    import contextlib
    import time
    import types

    import torch
    import torch.distributed as dist
    from transformers.distributed import DistributedConfig

    from . import subset
    from .accelerate_scenarios import head_layout, reader_forward
    from .scenarios import train_against_reference
    from .tiny import moe
    from .trl_scenarios import rank_env

    start = time.monotonic()
    rank_env(rank, world)
    subset.apply(case["patches"])
    if rank == 0:  # one checkpoint, every rank loads it
        build(case).save_pretrained(path)
    dist.barrier()
    cls = type(build(case))
    from fsdp2_compat.fixes import mixed_media, tail_unit, unit_walk

    before = (mixed_media.STATS["dummy_forwards"], unit_walk.STATS["walks"], tail_unit.STATS["native_pairs"])
    undo = unpinned_offload() if case["offload"] == "unpinned" else None
    config = dict(case["config"], fsdp_size=case["config"].get("fsdp_size", world))
    if case["offload"]:
        config["fsdp_cpu_offload"] = True
    try:
        model = cls.from_pretrained(path, distributed_config=DistributedConfig(**config), dtype=torch.float32)
        next(p for p in model.parameters() if hasattr(p, "to_local")).to_local().clone()  # pinned: fails here
    except Exception as exc:  # e.g. a pinned CPUOffloadPolicy without an accelerator
        return {"error": "load: %s: %s" % (type(exc).__name__, str(exc).strip().splitlines()[0])}
    finally:
        if undo is not None:
            undo()
    reference = cls.from_pretrained(path, dtype=torch.float32)
    model.train(), reference.train()
    if case["read"] is not None:
        for m in (model, reference):
            m.forward = types.MethodType(reader_forward(case["read"]), m)
    result = dict(head_layout(model), error=None, losses=[], loss_err=0.0, grad_err=0.0,
                  worst_grad=None, lm_head_grad_err=0.0, lm_head_rel_to_max=0.0, param_err=0.0, grads_checked=0)
    shard = next(p for p in model.parameters() if hasattr(p, "to_local"))
    result["shard_device"] = str(shard.to_local().device)

    def batches_for(step):
        kinds = case["kinds"][step]
        return [batch(case["family"], reference, 1 + step * world + r, kinds[r]) for r in range(world)]

    def loss_of(module, b):
        return module(**b).loss, None

    torch.manual_seed(0)
    with contextlib.ExitStack() as stack:
        if case["family"] in moe.CLASSES:  # the experts this rank's tokens reached, over every step
            hits = stack.enter_context(moe.hits(model))
        result = train_against_reference(model, reference, rank, world, result, batches_for, loss_of,
                                         steps=len(case["kinds"]), lr=0.05)
    if case["family"] in moe.CLASSES:
        result["hits"] = [{name: sorted(seen) for name, seen in hits.items()}]  # moe_scenarios.differing_experts
    after = (mixed_media.STATS["dummy_forwards"], unit_walk.STATS["walks"], tail_unit.STATS["native_pairs"])
    result.update(dummy_forwards=after[0] - before[0], walks=after[1] - before[1], native_pairs=after[2] - before[2],
                  seconds=round(time.monotonic() - start, 2))
    return result


def collect(cases, pg_timeout=30, timeout=400):
    """Run ``native_cases`` on 2 gloo ranks: ``([per case: [rank 0 result, rank 1 result] or None], gloo line,
    error)``.  A case after which a rank wrote nothing (gloo aborted it) is None; the gloo line is the first mismatch
    message any rank printed (``mixed.gloo_error``), or None; error: the ranks' failure, or None."""
    import tempfile

    from .mixed import gloo_error
    from .rank_cases import written_cases
    from .ranks import RankError, run_ranks

    with tempfile.TemporaryDirectory(prefix="f2c_native_") as tmp:
        error = None
        try:
            run_ranks(native_cases, 2, tmp, cases, timeout=timeout, retries=0, pg_timeout=pg_timeout)
        except RankError as exc:  # an aborted case: what each rank wrote before it is read below
            error = str(exc)
        return written_cases(tmp, 2, len(cases)), gloo_error(tmp, 2), error
