"""Request an exact subset of the catalogue's targets through the engine.

A proof that isolates one bug needs every other fix of the same patch in place:
the "unpatched" side of GLM-4.1V's fused lm_head proof must run with the wrap
selection and verl's GLM4V forward fixed, or it crashes before ``lm_head`` is
read.  ``request(["glm4v", "-verl:...forward_with_torch_backend", ...])`` does
that through the real engine (fingerprints, "not needed", status, revert):
the chosen targets are registered as one transient patch named ``subset``,
which is requested like any other.

Tooling only (check, audit, scenarios, tests); users name patches.
"""

NAME = "subset"


def targets_of(items):
    """The catalogue targets ``items`` selects, in catalogue order.

    ``items``: patch names (all their targets), target keys
    (``"verl:verl.models.transformers.glm4v._get_input_embeds"``), and either
    prefixed with ``-`` to drop them again.
    """
    from fsdp2_compat import registry

    by_key = {t.key: t for t in registry.targets()}
    chosen, dropped = [], set()
    for item in items:
        negated = item.startswith("-")
        name = item[1:] if negated else item
        found = [by_key[name]] if name in by_key else list(registry.patch(name).targets)
        if negated:
            dropped.update(t.key for t in found)
        else:
            chosen += [t for t in found if t.key not in {c.key for c in chosen}]
    return tuple(t for t in chosen if t.key not in dropped)


def request(items):
    """Request exactly ``targets_of(items)`` (as the transient patch ``subset``); returns its name."""
    import fsdp2_compat
    from fsdp2_compat import registry
    from fsdp2_compat.core.records import Patch

    forget()
    patch = Patch(NAME, "a subset of the catalogue's targets (tooling)", {}, targets_of(items), (), "never: tooling only")
    registry.register(patch)
    fsdp2_compat.apply([NAME])
    return NAME


def forget():
    """Revert the transient patch (if requested) and remove it from the catalogue."""
    from fsdp2_compat import registry

    if NAME not in registry.names():
        return
    import fsdp2_compat

    fsdp2_compat.revert([NAME])
    registry.unregister(NAME)


def apply(patches):
    """``fsdp2_compat.apply(patches)``, or ``request(patches)`` when it names targets or drops some.

    ``patches``: None / "" (nothing), a selection string, or a list of names
    and target keys (see ``targets_of``).
    """
    if not patches:
        return ()
    if isinstance(patches, str):
        import fsdp2_compat

        return fsdp2_compat.apply(patches)
    items = list(patches)
    if any(":" in item or item.startswith("-") for item in items):
        return (request(items),)
    import fsdp2_compat

    return fsdp2_compat.apply(items)
