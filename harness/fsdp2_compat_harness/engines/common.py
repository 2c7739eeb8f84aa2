"""Shared by the engine harnesses: model directories, turning fsdp2-compat on, comparisons."""

import os

# How a rank turns fsdp2-compat on (the ``patches`` argument of the rank functions):
#   None            nothing (upstream as released)
#   "env"           nothing in the rank: the process got it at start-up (FSDP2_COMPAT_PATCHES with the
#                   installed wheel's .pth bootstrap, or verl's plugin entry point)
#   "auto"          ``import fsdp2_compat.auto`` (FSDP2_COMPAT_PATCHES selects the patches)
#   names / keys    ``fsdp2_compat.apply`` (a selection string or list; target keys and "-" items
#                   through ``fsdp2_compat_harness.subset``)
ENV, AUTO = "env", "auto"

TOL = 1e-5  # fp32 throughout: the sharded run and the reference differ by summation order only
BF16_TOL = 1e-2  # a bf16 computation (a bf16 policy, or an engine that autocasts to bf16 regardless) vs the reference


def text_only_rank(step, world):
    """The rank whose batch is text-only on ``step`` of a mixed run (the others have images): 1, then 0."""
    return (step + 1) % world


def tolerance(result):
    """The bound a rank result's loss / gradient / parameter errors are held to.

    ``BF16_TOL`` when the run computed in bf16 (``result["bf16"]``: the
    framework's bf16 policy; ``result["autocast"]``: an engine that autocasts
    whatever the policy, e.g. verl 0.7.0), else ``TOL``.
    """
    return BF16_TOL if result.get("bf16") or result.get("autocast") else TOL


def activate(patches):
    """Turn fsdp2-compat on in this rank as ``patches`` says (see above); returns the patch names requested."""
    if patches in (None, ENV):
        from fsdp2_compat.core import engine

        return engine.requested()
    if patches == AUTO:
        import fsdp2_compat.auto  # noqa: F401  (applies FSDP2_COMPAT_PATCHES)
        from fsdp2_compat.core import engine

        return engine.requested()
    from fsdp2_compat_harness import subset

    return subset.apply(patches)


def activation_report(modules):
    """What fsdp2-compat did in this process for the targets in ``modules``.

    ``{"requested": [...], "how": [bootstrap / plugin lines], "decisions": {mechanism: {...}},
    "outcomes": {target key: outcome}, "file": fsdp2_compat.__file__}``.
    """
    import fsdp2_compat
    from fsdp2_compat.activation import bootstrap
    from fsdp2_compat.core import engine

    requested = list(engine.requested())
    outcomes = {}
    for _, o in engine.outcomes(requested):
        if o.target.module in modules and o.kind not in (engine.WAITING, engine.NOT_REQUESTED):
            outcomes[o.target.key] = o.kind
    try:
        how = bootstrap.activation_summary()["lines"]
    except Exception as exc:  # noqa: BLE001  (a report, never a failure)
        how = ["activation summary unavailable: %s" % exc]
    return {"requested": requested, "how": how, "decisions": bootstrap.decisions(), "outcomes": outcomes,
            "file": fsdp2_compat.__file__}


def build_tokenizer(path, vocab_size=256):
    """A word-level tokenizer over the tiny vocabulary (0 pad, 1 eos, 2 bos), saved to ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    vocab.update({"t%d" % i: i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    fast.save_pretrained(path)


def model_dir(family, root, tokenizer=True, vision=None):
    """``root/family``: ``save_pretrained`` of the tiny untied model (seed 0), plus a tokenizer; built once.
    ``vision``: ``tiny.build``'s vision overrides (the directory's name then lists them)."""
    from fsdp2_compat_harness import tiny

    path = os.path.join(root, family + "".join("-%s%s" % kv for kv in sorted((vision or {}).items())))
    if not os.path.exists(os.path.join(path, "config.json")):
        os.makedirs(path, exist_ok=True)
        tiny.build(family, tie=False, seed=0, vision=vision).save_pretrained(path)
        if tokenizer:
            build_tokenizer(path)
    return path


def compare(module, reference, result, key):
    """Fold the gradients of ``module`` (sharded) vs ``reference`` into ``result[key + "_*"]``.

    ``_grad_err`` / ``_worst_grad`` (every parameter, by name), ``_lm_head_grad_err``
    and ``_grads_checked``; gradients are gathered from their shards.
    """
    from fsdp2_compat_harness.scenarios import full_values, rel_err

    ref = dict(reference.named_parameters())
    worst, name_worst, lm, checked = 0.0, None, 0.0, 0
    named = list(module.named_parameters())
    for (name, _), grad in zip(named, full_values([p.grad for _, p in named])):
        q = ref[name]
        err = rel_err(grad, q.grad)
        checked += int(q.grad is not None)
        if name == "lm_head.weight":
            lm = err
        if err > worst:
            worst, name_worst = err, name
    result[key + "_grad_err"] = worst
    result[key + "_worst_grad"] = name_worst
    result[key + "_lm_head_grad_err"] = lm
    result[key + "_grads_checked"] = checked


def param_err(module, reference):
    """Worst parameter error (sharded parameters gathered), by name."""
    from fsdp2_compat_harness.scenarios import full_values, rel_err

    ref = dict(reference.named_parameters())
    named = list(module.named_parameters())
    return max((rel_err(f, ref[n]) for (n, _), f in zip(named, full_values([p for _, p in named]))), default=0.0)


def units(model):
    """Names of the FSDP2 units in ``model``."""
    from fsdp2_compat_harness.scenarios import wrapped_module_names

    return wrapped_module_names(model)


def merge(results):
    """One dict for all ranks: rank 0's, with every ``*_err`` the worst over ranks, losses per rank."""
    merged = dict(results[0])
    for r in results[1:]:
        for k, v in r.items():
            if k.endswith("_err") and isinstance(v, float):
                merged[k] = max(merged.get(k) or 0.0, v)
        if merged.get("error") is None and r.get("error") is not None:
            merged["error"] = r["error"]
    merged["losses_per_rank"] = [r.get("losses") for r in results]
    merged.pop("losses", None)
    return merged
