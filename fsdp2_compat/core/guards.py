"""Checks made before a seam is touched: installed version and code identity.

Both run when a target module is imported (never at ``import fsdp2_compat``),
so they may use ``importlib.metadata``, ``packaging`` and ``inspect``.
"""


class Drift(Exception):
    """Raised by a seam that finds upstream code it does not expect (the target is refused)."""


class NotNeeded(Exception):
    """Raised by a seam whose fix this environment does not need (e.g. a transformers
    release that already does what the seam adapts); the message says why."""


# dist -> installed version: what ``installed_version`` found (absent ones are not kept).
_versions = {}


def installed_version(dist):
    """Version string of an installed distribution, or ``None``.

    A release found is kept for the process: ``importlib.metadata`` scans
    every path entry and parses the METADATA file (~3 ms a call), and
    ``apply()`` asks for the release of every target it settles.  An absent
    one is looked for again on every call, so a framework installed after
    the process started (a notebook's ``pip install``) is seen; one upgraded
    in place is not until ``forget_versions()`` (the fingerprint of its code
    still decides whether a seam is touched).
    """
    try:
        return _versions[dist]
    except KeyError:
        pass
    from importlib import metadata

    try:
        found = metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
    _versions[dist] = found
    return found


def forget_versions():
    """Read every distribution's version afresh on its next ``installed_version``."""
    _versions.clear()


def in_range(version, spec):
    """True when ``version`` satisfies the PEP 440 ``spec`` (pre-releases count)."""
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(spec).contains(version, prereleases=True)


def release_spans(target):
    """``[(first, last)]`` releases (``packaging`` Versions) of each fingerprint label of ``target``:
    ``"0.6.0-0.7.1"`` names the releases from 0.6.0 to 0.7.1 that have that code."""
    from packaging.version import Version

    spans = []
    for label in target.fingerprints:
        first, _, last = label.partition("-")
        spans.append((Version(first), Version(last or first)))
    return spans


def _is_proxy(obj):
    """True for a wrapt proxy (fsdp2-compat's seams, or another patcher's): not released code."""
    return any(c.__name__ == "ObjectProxy" for c in type(obj).__mro__)


def fingerprint(obj):
    """A short hash of the code of ``obj`` that ignores comments, docstrings and layout.

    Raises ``LookupError`` when the object has no retrievable source (a C
    function, a wrapper object, code built at runtime) or its file cannot be
    read or parsed any more: unknown code is never patched, and never a crash.

    A wrapt proxy (ours or another patcher's) is refused: what we would replace
    is not the released function.  A function decorated in the released source
    itself (``functools.wraps``, e.g. torch's ``@_dynamo_disable``) is read as
    that source reads, decorator included (``inspect`` follows ``__wrapped__``
    to the ``def``), so it fingerprints like ``fingerprint_source`` of the file.
    """
    import inspect

    if _is_proxy(obj):
        raise LookupError("it is wrapped by %s, not the released function" % type(obj).__name__)
    # One hash per compiled function: the code that runs cannot change under the same code object, and a
    # rank forked from a server that fingerprinted its targets (the harness's _preload) reads no file again.
    try:
        code = getattr(inspect.unwrap(obj), "__code__", None) if inspect.isfunction(obj) or inspect.ismethod(obj) else None
    except ValueError:  # a __wrapped__ cycle: getsource below says so
        code = None
    cached = _fingerprints.get(id(code)) if code is not None else None
    if cached is not None and cached[0] is code:
        return cached[1]
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError) as exc:
        raise LookupError("its source is not available (%s)" % exc) from None
    except Exception as exc:  # tokenize / indentation errors: the file changed on disk since the import
        raise LookupError("its source cannot be read (%s: %s)" % (type(exc).__name__, exc)) from None
    try:
        fp = fingerprint_source(source)
    except (SyntaxError, ValueError) as exc:  # a fragment inspect cut badly, a file edited on disk
        raise LookupError("its source does not parse (%s)" % exc) from None
    if code is not None:
        _fingerprints[id(code)] = (code, fp)  # the code object is kept: its id is never reused while cached
    return fp


# id(code object) -> (code object, fingerprint): ``fingerprint``'s memo (failures are never kept).
_fingerprints = {}


def fingerprint_source(source, name=None):
    """Fingerprint of Python source text (of the definition ``name`` if given).

    ``name`` is a top-level def or class (``apply_fsdp2``) or a def inside a
    top-level class (``FSDP2Engine.prepare_model``); ``LookupError`` if absent.

    The source is parsed, docstrings are dropped and the tree is printed back
    with ``ast.unparse``: the hash is stable across formatting, comments and
    Python versions, and changes whenever the code does.  This is how the
    fingerprints in ``fsdp2_compat.integrations`` are computed from released
    files (``fsdp2-compat fingerprint FILE FUNCTION``).
    """
    import ast
    import hashlib
    import textwrap

    defs_types = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    tree = ast.parse(textwrap.dedent(source))
    if name is not None:
        # "f" is a top-level def; "Class.method" a def inside a top-level class.
        scope, node = tree, None
        for part in name.split("."):
            defs = [n for n in getattr(scope, "body", ()) if isinstance(n, defs_types) and n.name == part]
            if not defs:
                raise LookupError("no definition named %r (looking for %r)" % (part, name))
            scope = node = defs[-1]
        tree = ast.Module(body=[node], type_ignores=[])
    for node in ast.walk(tree):
        if isinstance(node, defs_types + (ast.Module,)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
                if isinstance(body[0].value.value, str):
                    node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.unparse(tree).encode()).hexdigest()[:16]
