"""Read the user's choice of patches from a string such as ``FSDP2_COMPAT_PATCHES``.

Grammar (comma separated, whitespace and case ignored, empty items ignored):
- ``all``            every registered patch
- ``none`` / ``off`` nothing (may not be combined with other items)
- ``name``           that patch
- ``-name``          exclude it (alone, exclusions start from ``all``)

Unset means ``all``.  An unknown name is an error that names the bad token and
the valid names: a typo must never silently disable the fix the user asked for.

Stdlib only; nothing read here is ever imported or evaluated.
"""

import os

PATCHES_ENV = "FSDP2_COMPAT_PATCHES"
STRICT_ENV = "FSDP2_COMPAT_STRICT"

_TRUE = ("1", "true", "yes", "on")


class ConfigError(ValueError):
    """The patch selection string could not be understood."""


def parse_selection(text, known):
    """Return the chosen patch names (a tuple in registry order).

    ``text`` is the raw selection (``None`` means unset), ``known`` the
    registered names in their canonical order.
    """
    known = tuple(known)
    if text is None:
        return known
    items = [item.strip().lower() for item in text.split(",")]
    items = [item for item in items if item]
    if not items:
        return known
    if any(item in ("none", "off") for item in items):
        if len(items) > 1:
            raise ConfigError(
                "%s=%r: 'none' cannot be combined with other items" % (PATCHES_ENV, text)
            )
        return ()
    include, exclude = set(), set()
    for item in items:
        negated = item.startswith("-")
        name = item[1:].strip() if negated else item
        if name == "all":
            if negated:
                raise ConfigError("%s=%r: '-all' is not allowed; use 'none'" % (PATCHES_ENV, text))
            include.update(known)
            continue
        if name not in known:
            raise ConfigError(
                "%s=%r: unknown patch %r. Valid names: all, none, %s (prefix a name with '-' to exclude it)."
                % (PATCHES_ENV, text, name, ", ".join(known))
            )
        (exclude if negated else include).add(name)
    if not include:
        include = set(known)
    return tuple(name for name in known if name in include and name not in exclude)


def strict_from_env(environ=None):
    """True when ``FSDP2_COMPAT_STRICT`` asks for skips and failures to raise."""
    value = (environ if environ is not None else os.environ).get(STRICT_ENV, "")
    return value.strip().lower() in _TRUE
