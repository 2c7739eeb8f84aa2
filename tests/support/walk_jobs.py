"""Rank functions for the unit-walk proofs (``tests/fixes/test_unit_walk.py``).

``toy_cases``: a pure-torch model (a "tower" of unit blocks with parameters
held by the root beside it) and ``unit_walk.zero`` called directly, on one
gloo rank, with every collective its units issue recorded through
``guard.collectives``.  ``family_traces``: tiny VLMs sharded by a framework's
own entry point, the family's patch applied, the same micro-batches on both
ranks (image, text, text: the second text-only one is walked), with the
collective sequence of each micro-batch.
"""


# Where a release runs a family under reentrant checkpoints in a way the record cannot mirror, it keeps the real
# dummy ((family, checkpointing) -> the start of ``unit_walk.why_not``): the audio towers' attention units inside
# their layers' units, both checkpointed (transformers 5.8.0); a unit called twice inside reentrant checkpoints
# (DeepSeek-OCR-2 on 5.10.4 / 5.16.1), whose gradients FSDP2 itself leaves unreduced (``twice_in_checkpoints``):
# there the image micro-batch is wrong too, so it is no reference (``UPSTREAM`` in the reason).
UPSTREAM = "inside reentrant activation checkpoints"
KEEPS_THE_DUMMY = {("qwen2_audio", "reentrant"): "nested activation checkpoints in ",
                   ("audioflamingo3", "reentrant"): "nested activation checkpoints in ",
                   ("deepseek_ocr2", "reentrant"): "the media path calls FSDPDeepseekOcr2SamVisionLayer 2 times "
                                                   + UPSTREAM}
UPSTREAM_SKIP = ("upstream: FSDP2 leaves a unit called twice inside reentrant checkpoints unreduced "
                 "(docs/upstream-problems.md)")


def _recorder():
    from fsdp2_compat.guard import collectives

    trace = []

    def listen(event):
        trace.append((event.kind, event.unit, tuple(event.params) if event.kind == collectives.REDUCE_SCATTER
                      else len(event.params)))

    collectives.listen(listen)
    return trace, lambda: collectives.unlisten(listen)


class _Counter:
    """Forward calls of every non-unit module under ``root`` (what only the real media path runs)."""

    def __init__(self, root):
        from torch.distributed.fsdp import FSDPModule

        self.calls = 0
        self.handles = [m.register_forward_hook(self._count) for m in root.modules() if not isinstance(m, FSDPModule)]

    def _count(self, *_):
        self.calls += 1

    def remove(self):
        for h in self.handles:
            h.remove()


def _toy(world, twice=False, foreign=False, frozen_first=False, reentrant=False):
    """``(model, run)``: a root unit holding ``proj`` and ``unused``, a tower of three unit blocks; ``run`` is
    the dummy (the tower on a tiny input, then ``proj``).  ``twice``: the dummy runs block 0 twice;
    ``foreign``: block 1 calls ``proj`` (a module it does not hold); ``frozen_first``: block 0 is frozen;
    ``reentrant``: each block call runs in a reentrant activation checkpoint."""
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self, owner=None):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.spare = nn.Linear(4, 4)  # never used: no gradient on any rank
            self.owner = [owner]  # not a submodule

        def forward(self, x):
            h = self.lin(x).relu()
            return self.owner[0](h) if self.owner[0] is not None else h

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.unused = nn.Linear(4, 4)
            self.tower = nn.ModuleList(Block() for _ in range(3))
            self.text = nn.Linear(4, 4)
            if foreign:
                self.tower[1].owner[0] = self.proj

        def forward(self, x, dummy=None):
            h = self.text(x)
            if dummy is not None:
                h = h + dummy(self, x.device).to(h.dtype)
            return h.pow(2).mean()

    torch.manual_seed(0)
    model = Toy()
    if frozen_first:
        model.tower[0].requires_grad_(False)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.tower:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

    def run(m, device):
        h = torch.zeros(1, 4, device=device, requires_grad=reentrant)  # (else the checkpoint runs no backward)
        blocks = [m.tower[0]] * (2 if twice else 1) + list(m.tower[1:])
        for block in blocks:
            h = checkpoint(block, h, use_reentrant=True) if reentrant else block(h)
        return m.proj(h)

    return model, run


class _Warnings:
    """The ``fsdp2_compat`` logger's warnings, appended to ``into`` until ``remove()``."""

    def __init__(self, into):
        import logging

        class Handler(logging.Handler):
            def emit(self, record):
                into.append(record.getMessage())

        self.handler = Handler(logging.WARNING)
        logging.getLogger("fsdp2_compat").addHandler(self.handler)

    def remove(self):
        import logging

        logging.getLogger("fsdp2_compat").removeHandler(self.handler)


def twice_in_checkpoints(rank, world):
    """``{mode: {parameter: {"sharded": bool, "err": max |grad - DP reference|}}}`` for a root unit whose head
    reads one unit block called twice, each call in an activation checkpoint (``"reentrant"``, ``"non-reentrant"``),
    on different data per rank, after one backward, against an unsharded copy backpropagated on every rank's data
    (the DP average)."""
    import copy

    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.checkpoint import checkpoint

    from fsdp2_compat_harness.scenarios import full_value  # (FSDP2 may leave the unit unsharded: a plain grad)

    class Model(nn.Module):
        def __init__(self, reentrant):
            super().__init__()
            self.block, self.head, self.reentrant = nn.Linear(4, 4), nn.Linear(4, 1), reentrant

        def forward(self, a, b):
            def block(x):
                return checkpoint(self.block, x, use_reentrant=self.reentrant).relu()
            return self.head(block(a) + block(b)).sum()

    def data(r):
        g = torch.Generator().manual_seed(r)
        return [torch.randn(2, 4, generator=g, requires_grad=True) for _ in range(2)]

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for mode in ("reentrant", "non-reentrant"):
        torch.manual_seed(0)
        model = Model(mode == "reentrant")
        reference = copy.deepcopy(model)
        fully_shard(model.block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model(*data(rank)).backward()
        for r in range(world):
            (reference(*data(r)) / world).backward()
        out[mode] = {n: {"sharded": hasattr(p, "full_tensor"), "err": float((full_value(p.grad) - q.grad).abs().max())}
                     for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters())}
    return out


def toy_cases(rank, world, cases):
    """``{case: result}`` for each case name in ``cases`` (see ``test_unit_walk``)."""
    import torch

    from fsdp2_compat.fixes import mixed_media, unit_walk
    from fsdp2_compat_harness.scenarios import full_value

    out = {}
    for case in cases:
        model, run = _toy(world, twice=case.startswith("twice"), foreign=case == "foreign",
                          frozen_first=case == "frozen block", reentrant=case == "twice reentrant")
        calls = _Counter(model.tower)
        trace, stop = _recorder()
        result = {"traces": [], "tower_calls": [], "walks": [], "why_not": [], "grads": [], "warnings": []}
        warnings = _Warnings(result["warnings"])

        def dummy(m, device):
            if case.endswith("real dummy"):  # (every time: what an image rank's units do, for comparison)
                return mixed_media._zero_of_output(run(m, device))
            z = unit_walk.zero(m, run, device, mixed_media._zero_of_output)
            return z if z is not None else torch.zeros((), device=device)

        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
        try:
            for i, mode in enumerate(_MODES[case]):
                del trace[:]
                calls.calls = 0
                before = unit_walk.STATS["walks"]
                if mode == "no_grad":
                    with torch.no_grad():
                        model(x, dummy)
                else:
                    model.set_requires_gradient_sync(mode != "train, sync off")
                    loss = model(x, dummy)
                    if mode.startswith("train"):
                        loss.backward()
                        result["grads"].append({n: (None if p.grad is None else float(full_value(p.grad).abs().sum()))
                                                for n, p in model.named_parameters()})
                        model.zero_grad(set_to_none=True)
                result["traces"].append(list(trace))
                result["tower_calls"].append(calls.calls)
                result["walks"].append(unit_walk.STATS["walks"] - before)
                result["why_not"].append(unit_walk.why_not(model, run))
        finally:
            stop()
            calls.remove()
            warnings.remove()
        out[case] = result
    return out


# each toy case's forwards: "train" (forward + backward), "train, sync off" (the same, FSDP2 not reducing),
# "forward" (grad on, no backward), "no_grad"
_MODES = {
    "walk": ("train", "train", "train"),
    "frozen block": ("train", "train"),
    "twice": ("train", "train", "train"),
    "twice, sync off first": ("train, sync off", "train", "train"),
    "twice, sync off first, real dummy": ("train, sync off", "train", "train"),
    "foreign": ("train", "train"),
    "twice reentrant": ("train", "train"),
    "no backward": ("forward", "train", "train"),
    "no grad": ("no_grad", "no_grad", "train", "train"),
}


def family_traces(rank, world, framework, configs):
    """``{(family, gc): result}``: for each config, the family's patch applied, the model sharded by
    ``framework`` (``accum_jobs._prepare``, fp32), gradient checkpointing off (None), ``"reentrant"`` or
    ``"non-reentrant"``, then an image, a text-only and a text-only micro-batch on both ranks, each with its
    forward and backward: per micro-batch the collective sequence, the tower's non-unit module calls, and
    ``unit_walk`` walks; and the record's ``why_not``."""
    import fsdp2_compat
    from fsdp2_compat import registry
    from fsdp2_compat.fixes import media_towers, unit_walk
    from fsdp2_compat_harness.tiny.text import text_only
    from support import accum_jobs

    out = {}
    for family, gc in configs:
        fsdp2_compat.apply([registry.for_model_type(family).name])
        trace, stop = _recorder()
        try:
            model = accum_jobs._build(family, fused=False)
            if gc:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": gc == "reentrant"})
            reference = model
            batches = [accum_jobs._micro_batch(family, reference, 1 + i, "image", False) for i in range(3)]
            model, _ = accum_jobs._prepare(rank, world, framework, model, "fp32")
            base = getattr(model, "model", model)  # (the audio families' forward is the outer one's before 5.10)
            tower = getattr(base, media_towers.for_model(base).attr)
            calls = _Counter(tower)
            result = {"traces": [], "tower_calls": [], "walks": []}
            for i, kind in enumerate(("image", "text", "text")):
                batch = batches[i] if kind == "image" else text_only(batches[i], seed=100 + i)
                del trace[:]
                calls.calls = 0
                before = unit_walk.STATS["walks"]
                model(**batch).loss.backward()
                model.zero_grad(set_to_none=True)
                result["traces"].append(list(trace))
                result["tower_calls"].append(calls.calls)
                result["walks"].append(unit_walk.STATS["walks"] - before)
            result["why_not"] = unit_walk.why_not(base, media_towers.for_model(base).run)
            calls.remove()
        except Exception as exc:  # a harness failure: report it, go on
            result = {"error": "%s: %s" % (type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")}
        finally:
            stop()
            fsdp2_compat.revert()
        out[(family, gc)] = result
    return out
