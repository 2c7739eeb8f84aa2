"""Checks made before a seam is touched: installed version and code identity.

Both run when a target module is imported (never at ``import fsdp2_compat``),
so they may use ``importlib.metadata``, ``packaging`` and ``inspect``.
"""

import sys


class Drift(Exception):
    """Raised by a seam that finds upstream code it does not expect."""


def installed_version(dist):
    """Version string of an installed distribution, or ``None``."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def in_range(version, spec):
    """True when ``version`` satisfies the PEP 440 ``spec`` (pre-releases count)."""
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(spec).contains(version, prereleases=True)


def fingerprint(obj):
    """A short hash of the code of ``obj`` that ignores comments, docstrings and layout.

    Raises ``LookupError`` when the object has no retrievable source (a C
    function, a wrapper object, code built at runtime).
    """
    import inspect

    if hasattr(obj, "__wrapped__"):
        # Someone (maybe another patcher) already wrapped it: what we would
        # replace is not the released function.
        raise LookupError("it is wrapped by %s, not the released function" % type(obj).__name__)
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError) as exc:
        raise LookupError("its source is not available (%s)" % exc) from None
    return fingerprint_source(source)


def fingerprint_source(source, name=None):
    """Fingerprint of Python source text (of the top-level def ``name`` if given).

    The source is parsed, docstrings are dropped and the tree is printed back
    with ``ast.unparse``: the hash is stable across formatting, comments and
    Python versions, and changes whenever the code does.  This is how the
    fingerprints in ``fsdp2_compat.integrations`` are computed from released
    files (``fsdp2-compat fingerprint FILE FUNCTION``).
    """
    import ast
    import hashlib
    import textwrap

    tree = ast.parse(textwrap.dedent(source))
    if name is not None:
        defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name]
        if not defs:
            raise LookupError("no top-level definition named %r" % name)
        tree = ast.Module(body=[defs[-1]], type_ignores=[])
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
                if isinstance(body[0].value.value, str):
                    node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.unparse(tree).encode()).hexdigest()[:16]


def describe(dist):
    """``"verl 0.9.1"`` or ``"verl (not installed)"``."""
    version = installed_version(dist)
    return "%s %s" % (dist, version) if version else "%s (not installed)" % dist


def loaded(module_name):
    return module_name in sys.modules
