"""The live FSDP2 units of this process, read from torch's composable-API state.

``fully_shard`` records each module it makes a unit of in
``torch.distributed._composable_state`` (a weak mapping from the module to its
``FSDPState``).  That is private torch API: this module is the one place the
fixes read it (``fixes.mixed_media``: does a unit around the tower manage it;
``fixes.experts``: which units hold a MoE block's experts).
"""


def live_units():
    """``[(module, FSDPState)]`` for every module ``fully_shard`` made a unit of that is still alive; empty on a
    torch without FSDP2's composable state."""
    try:
        from torch.distributed._composable_state import _get_module_state, _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:
        return []
    out = []
    for module in list(_module_state_mapping.keys()):  # the values are (weak references to) the states
        state = _get_module_state(module)
        if isinstance(state, FSDPState):
            out.append((module, state))
    return out
