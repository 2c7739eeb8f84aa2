"""Which FSDP2 unit owns each parameter under a plan, and the plan's own problems."""

from .findings import ROOT, Finding


def _deepest_unit(module_name, unit_set):
    name = module_name
    while True:
        if name in unit_set:
            return name
        if not name:
            return ROOT
        name = name.rpartition(".")[0]


def parameter_owners(model, units):
    """``{id(param): (param, name, owner unit, [unit of each alias])}``.

    Rule: for each name under which the parameter is reachable
    (``named_parameters(remove_duplicate=False)``), the deepest unit whose
    module contains it (by name prefix; the root ``""`` otherwise).  When the
    aliases land in different units (a tied weight split across units) the
    owner is the first of them in ``fully_shard`` order: the plan's units in
    the order given, the root last - the unit FSDP2 would manage it in first.
    torch 2.13 refuses such a split at wrap time (``plan_problems`` says so).
    """
    unit_set = set(units) | {ROOT}
    order = {u: i for i, u in enumerate([u for u in units if u] + [ROOT])}
    aliases, params = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
        params[id(p)] = p
    owners = {}
    for pid, alias_names in aliases.items():
        cands = []
        for n in alias_names:
            u = _deepest_unit(n.rpartition(".")[0], unit_set)
            if u not in cands:
                cands.append(u)
        owner = min(cands, key=lambda u: order[u])
        owners[pid] = (params[pid], alias_names[0], owner, cands)
    return owners


def plan_problems(model, units):
    """Problems of the plan itself, not read hazards, as ``Finding`` records: a unit
    nested in one that is sharded before it (``nested``), and tied weights split
    across units (``split-tied``)."""
    problems = []
    position = {u: i for i, u in enumerate(units)}
    for u in units:
        parent = u.rpartition(".")[0]
        while parent:
            if parent in position and position[parent] < position[u]:
                problems.append(Finding(
                    "nested",
                    "unit %s is nested in unit %s, which is sharded first: torch 2.13 does not support that "
                    "order (2 ranks: 'Cannot concatenate overlapping meshes' at wrap time; 1 rank: mixed "
                    "Tensor/DTensor at the first forward)" % (u, parent),
                    "nested: %s in %s" % (u, parent)))
                break
            parent = parent.rpartition(".")[0]
    for _, name, owner, cands in parameter_owners(model, units).values():
        if len(cands) > 1:
            problems.append(Finding(
                "split-tied",
                "tied parameter %s spans units %s (torch 2.13 refuses a parameter shared across FSDP groups)"
                % (name, ", ".join(c or "<root>" for c in cands)),
                "split tied: %s" % name))
    return problems
