"""The runtime core: what ``import fsdp2_compat.auto`` and the start-up ``.pth`` load.

Stdlib only at import time, and cheap (every Python process of an environment
pays for it when the variable is set):

- ``config``     environment variables, the selection grammar, both activation policies
- ``hooks``      post-import hooks (run a callback once a module has been imported)
- ``records``    ``Fix``, ``Target``, ``Patch``, ``Integration``, ``Covered``: the declarative records
- ``guards``     installed version, version ranges, source fingerprints (lazy imports)
- ``policy``     the gate: whether the installed code may be patched (the code decides, not the version)
- ``outcomes``   the outcome names and the ``Outcome`` record
- ``engine``     apply / revert, outcomes
- ``swaps``      one seam's replacements installed all or nothing, undone by identity
- ``aliases``    rebinding names that callers imported from a patched module
- ``instances``  objects that captured a replaced method bound to themselves (a late request)
- ``calls``      what a seam's wrapper receives: self and arguments by name, under every calling convention
- ``status``     what happened, as rows
- ``covered``    the paths of a framework as proven through its code (beside its seams, or with none)
"""
