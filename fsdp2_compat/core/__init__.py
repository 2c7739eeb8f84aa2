"""The runtime core: what ``import fsdp2_compat.auto`` and the start-up ``.pth`` load.

Stdlib only at import time, and cheap (every Python process of an environment
pays for it when the variable is set):

- ``config``   environment variables, the selection grammar, both activation policies
- ``hooks``    post-import hooks (run a callback once a module has been imported)
- ``records``  ``Target`` and ``Patch``, the declarative records
- ``guards``   installed version, version ranges, source fingerprints (lazy imports)
- ``aliases``  rebinding names that callers imported from a patched module
- ``engine``   apply / revert, outcomes
- ``swaps``    one seam's replacements installed all or nothing, undone by identity
- ``status``   what happened, as rows
"""
