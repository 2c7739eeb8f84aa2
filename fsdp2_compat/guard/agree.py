"""The guard's check: the ranks agree on the collective they are about to run, or all raise at once.

``check(event)`` (a ``collectives`` listener) all-gathers ``event.code()``
(four int64: all-gather or reduce-scatter, a hash of the unit's path, the
number of parameters, a hash of their names) on the collective's own process
group, so the check is ordered with FSDP2's collectives exactly as they are.
Equal rows: return (the collective runs).  Different rows: every rank sees the
same rows, so every rank takes the same branch: one ``all_gather_object`` of
each rank's ``Collective.describe()`` and ``GuardError`` with
``explain.message``.  A rank never raises alone, so no rank is left waiting in
a collective its peers gave up on.
"""

from .explain import GuardError, message

STATS = {"checks": 0}


def check(event):
    import torch
    import torch.distributed as dist

    pg = event.group
    if pg is None or not dist.is_initialized():
        return
    world = dist.get_world_size(pg)
    if world <= 1:
        return
    STATS["checks"] += 1
    mine = torch.tensor(event.code(), dtype=torch.int64, device=event.device)
    rows = torch.empty(world * mine.numel(), dtype=torch.int64, device=event.device)
    # torch 2.13 renames all_gather_into_tensor (deprecated there) to all_gather_single
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(rows, mine, group=pg)
    rows = rows.view(world, -1).tolist()
    if all(row == rows[0] for row in rows):
        return
    described = [None] * world
    dist.all_gather_object(described, event.describe(), group=pg)
    raise GuardError(message(described, rank=dist.get_rank(pg)))
