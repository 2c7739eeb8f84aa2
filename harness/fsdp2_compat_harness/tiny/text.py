"""Text rows of the tiny batches, shared by ``batches`` and ``recent`` (a leaf: it imports neither).

Ordinary text ids are drawn from ``[3, TEXT_TOKENS_MAX)``; every special token
of the tiny configs (image, video, audio placeholders, begin / end markers)
lies at or above it, so a row's media span is exactly the ids placed there.
"""

from __future__ import annotations

TEXT_TOKENS_MAX = 240


def text_ids(gen, n: int):
    """``n`` ordinary text ids from the generator ``gen``."""
    import torch

    return torch.randint(3, TEXT_TOKENS_MAX, (n,), generator=gen)


def with_placeholders(gen, batch_size: int, pre: int, span: list[int], post: int):
    """``(input_ids, attention_mask, labels)``: rows text[pre] + span + text[post]; labels mask the span."""
    import torch

    rows, labels = [], []
    for _ in range(batch_size):
        a, b = text_ids(gen, pre), text_ids(gen, post)
        ids = torch.cat([a, torch.tensor(span, dtype=torch.long), b])
        lab = ids.clone()
        lab[pre : pre + len(span)] = -100
        rows.append(ids)
        labels.append(lab)
    input_ids = torch.stack(rows)
    return input_ids, torch.ones_like(input_ids), torch.stack(labels)


def text_only(batch: dict, seed: int) -> dict:
    """``batch`` with every special token (image placeholder, markers) replaced by a text id and no media
    inputs: the text-only micro-batch a mixed dataset gives one rank while another gets an image."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = batch["input_ids"].clone()
    special = ids >= TEXT_TOKENS_MAX
    ids[special] = torch.randint(3, TEXT_TOKENS_MAX, (int(special.sum()),), generator=gen)
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    if "mm_token_type_ids" in batch:
        out["mm_token_type_ids"] = torch.zeros_like(batch["mm_token_type_ids"])
    return out


def one_rank_with_media(make, step: int, world: int) -> list:
    """The micro-batches of ``world`` ranks at ``step``: rank ``step % world`` gets ``make(seed)`` (its media), every
    other rank that batch's text-only version (``text_only``), so each rank is text-only on some step."""
    batches = [make(1 + 10 * step + r) for r in range(world)]
    return [b if r == step % world else text_only(b, seed=1000 + 10 * step + r) for r, b in enumerate(batches)]


def count_forwards(module) -> list:
    """A list with one entry per micro-batch of the model (``counted_loss`` opens it); ``module``'s forwards
    outside backward (not a checkpoint's recompute) count into the last entry."""
    import torch

    calls = []

    def count(_module, inputs, output):
        if torch._C._current_graph_task_id() == -1 and calls:
            calls[-1] += 1

    module.register_forward_hook(count)
    return calls


def counted_loss(model, calls: list, keep_output: bool = True):
    """``loss_of(module, batch)`` for ``scenarios.train_against_reference``: the model's loss, a new entry of
    ``calls`` (``count_forwards``) for each micro-batch of ``model`` (not of the reference)."""

    def loss_of(module, batch):
        if module is model:
            calls.append(0)
        out = module(**batch)
        return out.loss, out if keep_output else None

    return loss_of
