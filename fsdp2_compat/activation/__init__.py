"""The ways in that need no line in the user's code, each following the implicit policy.

- ``bootstrap``: the start-up ``.pth`` the wheel installs (every interpreter);
- ``verl_plugin``: the ``verl.plugins`` entry point (``import verl``, 0.9.0+);
- ``ray_env``: a Ray job ``runtime_env`` and its worker setup hook.

All three apply only when ``FSDP2_COMPAT_PATCHES`` is set (see
``fsdp2_compat.core.config``) and record what they decided in
``bootstrap.decisions()`` for ``fsdp2-compat status``.  The explicit way in
is ``import fsdp2_compat.auto``.
"""
