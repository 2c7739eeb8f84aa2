"""What ``status`` and ``list`` say of a framework whose paths shared fixes cover (``Integration.covered``).

ms-swift trains through accelerate and transformers' forwards: every FSDP2 bug
on its paths is fixed by targets other integrations own, so it has no target
of its own, and the engine's rows (one per target) would never name it.  Its
integration lists the paths the tests ran through its code (``Covered``), and
``rows()`` says, for the installed release, whether each path's code is the
code those tests ran on: "proven" (a recorded fingerprint) or "unverified"
(other code: the shared fixes may still apply, nothing here has run it).

The source is read from the installed distribution's files, never imported
(``importlib.metadata``: importing ms-swift costs seconds and imports torch).
Stdlib only.
"""

from . import guards
from .outcomes import Classified


def _source(dist, module):
    """The installed text of ``module`` of distribution ``dist``, or None."""
    import importlib.metadata

    try:
        distribution = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    base = module.replace(".", "/")
    for relative in (base + ".py", base + "/__init__.py"):
        path = distribution.locate_file(relative)
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError:
            continue
    return None


def verdict(dist, path):
    """``Classified(kind, why)`` of one ``Covered`` path in the installed ``dist``: ``"absent"``, ``"unverified"``,
    ``"proven"`` or ``"proven broken"``."""
    text = _source(dist, path.module)
    if text is None:
        return Classified("absent", "no %s in this release" % path.module)
    try:
        fp = guards.fingerprint_source(text, path.attr)
    except LookupError as exc:
        return Classified("absent", str(exc))
    label = next((label for label, known in path.fingerprints.items() if known == fp), None)
    if label is None:
        return Classified("unverified", "code differs from the proven release(s) %s (fingerprint %s): not run here"
                          % (", ".join(path.fingerprints), fp))
    return Classified("proven" if path.fixed else "proven broken", "code of %s: %s" % (label, path.by))


def rows(integrations):
    """One dict per ``Covered`` path of each installed integration in ``integrations``."""
    out = []
    for integration in integrations:
        version = guards.installed_version(integration.dist) if integration.covered else None
        if version is None:
            continue
        for path in integration.covered:
            outcome, detail = verdict(integration.dist, path)
            out.append({"dist": integration.dist, "found": version, "path": "%s.%s" % (path.module, path.attr),
                        "outcome": outcome, "detail": detail})
    return out


def format_lines(rows_):
    """The human lines ``status`` prints under its table."""
    if not rows_:
        return []
    lines = ["paths as proven through the frameworks' code (the fixes above act on them, or nothing does):"]
    lines += ["  %s %s  %s: %s, %s" % (r["dist"], r["found"], r["path"], r["outcome"], r["detail"]) for r in rows_]
    return lines
