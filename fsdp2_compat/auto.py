"""``import fsdp2_compat.auto``: request the patches named in the environment.

``FSDP2_COMPAT_GUARD=1`` also turns on the collective guard (``fsdp2_compat.guard``).
``FSDP2_COMPAT_PATCHES`` (comma separated; ``all``, ``none``, ``-name``;
unset means all) chooses the patches; ``FSDP2_COMPAT_STRICT=1`` turns a skip
or failure of a requested patch into an error.  Each patch applies when its
upstream module is imported, before or after this import.

An unknown name raises ``fsdp2_compat.ConfigError`` here, at start-up, naming
the bad token and the valid names.  Importing this module costs a few
milliseconds: no torch, transformers, verl or SkyRL is imported.
"""

from . import guard
from .core import config, engine

guard.install_if_requested()  # FSDP2_COMPAT_GUARD=1: the collective guard (fsdp2_compat.guard)

# The explicit policy: the user wrote this import, so unset means all.
REQUESTED = engine.apply(config.explicit_selection())
