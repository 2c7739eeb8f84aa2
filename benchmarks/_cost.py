"""Shared pieces of the wall-clock benchmarks (issue #40): real-size models, sharding, timing, operator counts.

Not a benchmark itself (``tests/tooling/test_benchmarks.py`` runs the scripts
that import it).  The scripts run as ``python benchmarks/X.py``, so this
directory is on ``sys.path`` and ``import _cost`` finds this module; rank
processes fork from the script and inherit that.

- ``build`` / ``shard`` / ``batches``: a real-size vision-language model
  (the published config of ``tests/support/real_size.py``) with fewer vision
  blocks, text layers and vocabulary where only one part matters, one
  ``fully_shard`` per ``_no_split_modules`` class plus the root, and its
  text / image micro-batches;
- ``OpCounter``: the aten operators dispatched inside it
  (``TorchDispatchMode``);
- ``alternate``: time several variants of one step in turn, run after run,
  so every variant sees the same machine load (these machines are shared),
  and count each one's operators once;
- ``print_rows``: the medians, the ratios to the first row and the operator
  counts, measured in one run.
"""

import os
import statistics
import sys
import time
import warnings

# FSDP2 warns that a unit returned a view (an in-place op on it would skip a hook); these steps make none
warnings.filterwarnings("ignore", message="FSDP2-wrapped module")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def build(family, depth, layers, vocab, device="cpu", dtype=None):
    """The real-size model of ``family`` with ``depth`` vision blocks (None: all), ``layers`` text layers and a
    ``vocab``-token vocabulary, untied, in train mode."""
    import torch
    import transformers

    from fsdp2_compat_harness import tiny
    from fsdp2_compat_harness.tiny.configs import CLASSES
    from support.real_size import real_size_config

    config = real_size_config(family)
    text = config.get_text_config()
    text.num_hidden_layers, text.vocab_size = layers, vocab
    config.tie_word_embeddings = text.tie_word_embeddings = False
    for offset, name in enumerate(("image_token_id", "video_token_id", "vision_start_token_id",
                                   "vision_end_token_id", "image_start_token_id", "image_end_token_id")):
        if getattr(config, name, None) is not None:  # special tokens inside the smaller vocabulary
            setattr(config, name, vocab - 1 - offset)
    if depth:
        config.vision_config.depth = depth
        if hasattr(config.vision_config, "fullatt_block_indexes"):
            config.vision_config.fullatt_block_indexes = [i for i in config.vision_config.fullatt_block_indexes
                                                          if i < depth] or [depth - 1]
        if hasattr(config.vision_config, "deepstack_visual_indexes"):
            config.vision_config.deepstack_visual_indexes = [i for i in config.vision_config.deepstack_visual_indexes
                                                             if i < depth]
    torch.manual_seed(0)
    with torch.device(device):
        model = tiny.quiet(getattr(transformers, CLASSES[family][0]), config)
    if dtype is not None:
        model.to(dtype)
    return model.train()


def shard(model, mesh, mp_policy=None, units=None):
    """``fully_shard`` each module of ``units`` (default: every ``_no_split_modules`` class), then the root."""
    from torch.distributed.fsdp import fully_shard

    kwargs = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if units is None:
        names = set(model._no_split_modules)
        units = [m for m in model.modules() if type(m).__name__ in names]
    for module in units:
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def batches(model, family, tokens, image_side, device="cpu", seed=0):
    """``{"text": ..., "image": ...}`` micro-batches of ``tokens`` tokens; the image is ``image_side`` pixels
    square (patches of the tower's geometry), its merged tokens in place of as many text tokens (the image
    micro-batch is longer where they do not fit)."""
    import torch

    vision = model.config.vision_config
    patch, merge = vision.patch_size, vision.spatial_merge_size
    side = image_side // patch // merge * merge
    grid = torch.tensor([[1, side, side]], device=device)
    width = vision.in_channels * vision.temporal_patch_size * patch * patch
    n_image = side * side // (merge * merge)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab - 8, (1, max(tokens, n_image + 8)), generator=gen).to(device)
    text = {"input_ids": ids[:, :tokens], "attention_mask": torch.ones_like(ids[:, :tokens]),
            "labels": ids[:, :tokens].clone()}
    image_ids = ids.clone()
    image_ids[0, 4:4 + n_image] = model.config.image_token_id
    image = {"input_ids": image_ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
             "pixel_values": torch.randn(side * side, width, generator=gen).to(device), "image_grid_thw": grid}
    image["labels"][0, 4:4 + n_image] = -100
    from fsdp2_compat_harness.tiny.batches import _accepts

    rope_index = getattr(model.model, "get_rope_index", None)
    if rope_index is not None and _accepts(rope_index, "mm_token_type_ids"):  # transformers 5.x's M-RoPE types
        image["mm_token_type_ids"] = (image_ids == model.config.image_token_id).to(torch.int32)
    return {"text": text, "image": image}


def geometry(model, tokens, image_side=None):
    """One line naming what was built: parameters, vision blocks, text layers x hidden, vocabulary, tokens."""
    config = model.config
    text = config.get_text_config()
    vision = getattr(config, "vision_config", None)
    parts = ["%.0fM parameters" % (sum(p.numel() for p in model.parameters()) / 1e6)]
    if vision is not None:
        parts.append("%d vision blocks at %d" % (vision.depth, vision.hidden_size))
    parts.append("%d text layer(s) at %d" % (text.num_hidden_layers, text.hidden_size))
    parts.append("vocabulary %d" % text.vocab_size)
    parts.append("%d tokens" % tokens + ("" if image_side is None else ", a %dx%d image" % (image_side, image_side)))
    return ", ".join(parts)


class OpCounter:
    """Counts the aten operators dispatched inside it (``TorchDispatchMode``)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.ops += 1
                return func(*args, **(kwargs or {}))

        self.ops = 0
        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def alternate(variants, runs, warmup=1):
    """Time each variant of a step, in turn within every run; ``{label: (median seconds, aten ops)}``.

    ``variants``: ``{label: (on, off, step)}``; ``on()`` switches the variant in, ``step()`` runs one step,
    ``off()`` switches it out (``None``: nothing to switch).  Every variant first runs ``warmup`` steps;
    then ``runs`` rounds time one step of each, in order; then each variant's operators are counted over
    one more step.  Rank processes call it in the same order, so their collectives match.
    """
    def once(label, counter=None):
        on, off, step = variants[label]
        if on is not None:
            on()
        try:
            start = time.perf_counter()
            if counter is None:
                step()
            else:
                with counter:
                    step()
            return time.perf_counter() - start
        finally:
            if off is not None:
                off()

    for label in variants:
        for _ in range(warmup):
            once(label)
    times = {label: [] for label in variants}
    for _ in range(runs):
        for label in variants:
            times[label].append(once(label))
    out = {}
    for label in variants:
        counter = OpCounter()
        once(label, counter)
        out[label] = (statistics.median(times[label]), counter.ops)
    return out


def print_rows(results, title, base=None):
    """A table of ``results`` (``{label: (seconds, ops)}``): median ms, added ms, time ratio and aten operators
    against ``base`` (default: the first row), then one ``time ratio`` line per other row."""
    labels = list(results)
    base = base or labels[0]
    b_s, b_ops = results[base]
    print(title)
    print("  %-40s %10s %10s %10s %12s %10s" % ("", "ms", "+ms", "time x", "aten ops", "ops x"))
    for label in labels:
        s, ops = results[label]
        print("  %-40s %10.1f %10s %10.3f %12d %10.3f" % (label, 1e3 * s, "" if label == base else
                                                          "%+.1f" % (1e3 * (s - b_s)), s / b_s, ops,
                                                          ops / b_ops if b_ops else float("nan")))
    for label in labels:
        if label != base:
            s, ops = results[label]
            print("  time ratio %s / %s: %.3f; aten ops %d -> %d (%+d)" % (label, base, s / b_s, b_ops, ops,
                                                                          ops - b_ops))


def stack():
    """``torch X, transformers Y[, verl Z ...]``: the releases a figure was measured on."""
    from fsdp2_compat.core import guards

    found = [(d, guards.installed_version(d)) for d in ("torch", "transformers", "verl", "skyrl", "trl", "accelerate")]
    return ", ".join("%s %s" % (d, v) for d, v in found if v)
