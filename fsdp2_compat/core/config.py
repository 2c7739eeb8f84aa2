"""Every environment variable fsdp2-compat reads, and the rules for reading them.

One owner for each name and each policy:

- ``FSDP2_COMPAT_PATCHES`` chooses the patches.  Grammar (comma separated,
  whitespace and case ignored, empty items ignored): ``all`` every patch;
  ``none`` / ``off`` nothing (alone only); ``name`` that patch; ``-name``
  exclude it (alone, exclusions start from ``all``).  An unknown name is an
  error that names the bad token and the valid names: a typo must never
  silently disable the fix the user asked for.
- Two activation policies read it:
  * explicit (``import fsdp2_compat.auto``, ``apply()``): unset means *all*,
    because the user wrote a line asking for fsdp2-compat;
  * implicit (the start-up ``.pth``, the verl plugin, the Ray hook): unset or
    blank means *nothing*, because an installed package must never change
    training on its own.
- ``FSDP2_COMPAT_STRICT``: ``1`` turns a requested patch that cannot apply
  (unknown code, a failure) into an error; ``proven`` also refuses code
  outside the proven range (``strict_setting``, ``strict_level``).
- ``FSDP2_COMPAT_DISABLE_BOOTSTRAP``: keep the ``.pth`` inert while the
  variable still reaches the other ways in.
- ``FSDP2_COMPAT_GUARD``: ``1`` turns on the run-time collective guard
  (``fsdp2_compat.guard``) through the same ways in as the patches (the
  ``.pth`` line runs when either variable is set); unset, nothing is installed.

Also the start-up ``.pth`` file's name and its one line (``PTH_NAME``,
``PTH_LINE``), built here from the same names; ``setup.py`` reads them by
running this file (stdlib only, no relative imports, nothing evaluated from
the environment).
"""

import os

PATCHES_ENV = "FSDP2_COMPAT_PATCHES"
STRICT_ENV = "FSDP2_COMPAT_STRICT"
DISABLE_BOOTSTRAP_ENV = "FSDP2_COMPAT_DISABLE_BOOTSTRAP"
GUARD_ENV = "FSDP2_COMPAT_GUARD"

TRUE_VALUES = ("1", "true", "yes", "on")

# The file the wheel installs at the root of site-packages, and its only line.
# site.py executes a .pth line that starts with "import"; this one:
# - with both variables (patches, guard) unset or blank: two dict lookups, no import, no output;
# - set: imports the bootstrap and calls startup(), which never raises;
# - set, but the package is gone (half-uninstalled): one line on stderr.
# An exception escaping a .pth line would make site.py print a traceback and
# skip the rest of the file; nothing here lets one escape.  Python 3.11's
# site.py processes a venv's site-packages twice (venv() and then
# addsitepackages()), so the line marks ``sys`` and runs once per process.
BOOTSTRAP_MODULE = "fsdp2_compat.activation.bootstrap"
PTH_NAME = "fsdp2_compat_bootstrap.pth"
PTH_LINE = (
    "import os; "
    'exec("import sys\\n'
    "if not hasattr(sys, '_fsdp2_compat_pth'):\\n"
    " sys._fsdp2_compat_pth = 1\\n"
    " try:\\n"
    "  import %s as b; b.startup()\\n"
    " except Exception as e:\\n"
    "  sys.stderr.write('fsdp2-compat: start-up bootstrap skipped (%%s: %%s)\\\\n' %% (type(e).__name__, e))\")"
    ' if os.environ.get("%s", "").strip() or os.environ.get("%s", "").strip() else None'
) % (BOOTSTRAP_MODULE, PATCHES_ENV, GUARD_ENV)


class ConfigError(ValueError):
    """The patch selection string could not be understood."""


def _environ(environ):
    return os.environ if environ is None else environ


def is_true(value):
    """The one truthiness rule for on/off variables (``1``, ``true``, ``yes``, ``on``)."""
    return (value or "").strip().lower() in TRUE_VALUES


def explicit_selection(environ=None):
    """``FSDP2_COMPAT_PATCHES`` for the explicit policy: its raw value, ``None`` (= all) when unset."""
    return _environ(environ).get(PATCHES_ENV)


def implicit_selection(environ=None):
    """``FSDP2_COMPAT_PATCHES`` for the implicit policy: the stripped value, ``None`` (= nothing) when unset or blank."""
    value = _environ(environ).get(PATCHES_ENV)
    if value is None or not value.strip():
        return None
    return value.strip()


def bootstrap_disabled(environ=None):
    """True when ``FSDP2_COMPAT_DISABLE_BOOTSTRAP`` switches the ``.pth`` off."""
    return is_true(_environ(environ).get(DISABLE_BOOTSTRAP_ENV))


def guard_requested(environ=None):
    """True when ``FSDP2_COMPAT_GUARD`` turns the collective guard on (the one truthiness rule)."""
    return is_true(_environ(environ).get(GUARD_ENV))


def strict_setting(environ=None):
    """``FSDP2_COMPAT_STRICT`` as written (``None`` when unset): ``1`` / ``true`` ... or ``proven``."""
    value = _environ(environ).get(STRICT_ENV)
    return value.strip() if value is not None and value.strip() else None


STRICT_OFF, STRICT_ON, STRICT_PROVEN = None, "on", "proven"


def strict_level(value):
    """Normalise ``strict`` (bool, None, ``"1"``, ``"proven"``, ...) to ``STRICT_OFF / _ON / _PROVEN``."""
    if value in (None, False, ""):
        return STRICT_OFF
    if isinstance(value, str):
        text = value.strip().lower()
        if text == STRICT_PROVEN:
            return STRICT_PROVEN
        return STRICT_ON if is_true(text) else STRICT_OFF
    return STRICT_ON if value else STRICT_OFF


def stricter(a, b):
    """The stricter of two levels (a patch requested twice keeps its strictest request)."""
    order = (STRICT_OFF, STRICT_ON, STRICT_PROVEN)
    return a if order.index(a) >= order.index(b) else b


def strict_from_env(environ=None):
    """True when ``FSDP2_COMPAT_STRICT`` asks for refusals and failures to raise (``1`` or ``proven``)."""
    value = strict_setting(environ)
    return value is not None and (is_true(value) or value.lower() == "proven")


def parse_selection(text, known):
    """Return the chosen patch names (a tuple in registry order).

    ``text`` is the raw selection (``None`` means unset: all), ``known`` the
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
