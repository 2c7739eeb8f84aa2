"""``docs/contributing.md``'s layout is the tree: every module of both packages is named there, every name exists.

The block after ``<!-- layout: ... -->`` is read as the tree it draws: two
spaces of indent per level, then one or more names (``a.py, b.py``; a
directory ends in ``/``) up to the first run of two spaces, then what they
are.  A line indented past the names' columns continues the line above.
"""

import os
import re

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python",)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(REPO, "docs", "contributing.md")
PACKAGES = ("fsdp2_compat", os.path.join("harness", "fsdp2_compat_harness"))
CONTINUATION = 14  # an indent this deep is a description's second line, not a deeper entry


def _block():
    text = open(DOC, encoding="utf-8").read()
    start = text.index("<!-- layout:")
    body = text[text.index("```\n", start) + 4:]
    return body[: body.index("```")].splitlines()


def named_paths():
    """Every path the layout names, relative to the repository (directories end in ``/``)."""
    out, parents = [], []
    for line in _block():
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent >= CONTINUATION:
            continue
        assert indent % 2 == 0, "odd indent: %r" % line
        depth = indent // 2
        names = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        parents = parents[:depth]
        assert len(parents) == depth, "an entry deeper than its parent: %r" % line
        for name in (n.strip() for n in names.split(",")):
            out.append("".join(parents) + name)
        if names.endswith("/") and "," not in names:
            parents.append(names)
    return out


def tree():
    """Every package directory and every module but ``__init__.py`` of both packages."""
    out = set()
    for package in PACKAGES:
        for base, dirs, files in os.walk(os.path.join(REPO, package)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            rel = os.path.relpath(base, REPO).replace(os.sep, "/")
            out.add(rel + "/")
            out.update("%s/%s" % (rel, f) for f in files if f.endswith(".py") and f != "__init__.py")
    return out


def test_every_name_in_the_layout_exists():
    for path in named_paths():
        full = os.path.join(REPO, path)
        assert (os.path.isdir(full) if path.endswith("/") else os.path.isfile(full)), path


def test_every_module_and_package_is_in_the_layout():
    named = set(named_paths())
    assert tree() - named == set(), "modules the layout in docs/contributing.md does not name"
