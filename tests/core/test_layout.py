"""The packages' shape, read from their source (no import of them beyond this test's own).

The runtime (``fsdp2_compat``, the wheel every training process loads) and
the harness that proves it (``harness/fsdp2_compat_harness``, a distribution
of its own):

- no module over 500 lines;
- no import circle between their modules (module-level and function-level
  imports alike);
- the runtime core imports only the standard library and itself at module
  top (it runs at interpreter start-up);
- the runtime never imports the harness (``check`` / ``audit`` find it by name);
- nothing in either imports the test-suite's helpers.
"""

import ast
import os
import sys

import pytest

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python",)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = (os.path.join(REPO, "fsdp2_compat"), os.path.join(REPO, "harness", "fsdp2_compat_harness"))
MAX_LINES = 500


def _modules():
    """``{dotted name: path}`` of every module in both packages."""
    out = {}
    for package in PACKAGES:
        for base, _, files in os.walk(package):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(base, f), os.path.dirname(package))[:-3].replace(os.sep, ".")
                    out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(base, f)
    return out


MODULES = _modules()


def _imports(name, path, top_level_only=False):
    """Modules of the package (and others, as given) that ``name`` imports."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    is_pkg = path.endswith("__init__.py")
    package = name if is_pkg else name.rpartition(".")[0]
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.add(mod)
            for alias in node.names:  # ``from . import engine`` imports a submodule
                if "%s.%s" % (mod, alias.name) in MODULES:
                    out.add("%s.%s" % (mod, alias.name))
    return out


def test_every_relative_import_names_a_module_of_its_package():
    """Function-level imports run late (a rank, a command): one that names no module fails only there."""
    for name, path in MODULES.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                assert mod in MODULES, "%s: from %s%s import ... names no module" % (
                    name, "." * node.level, node.module or "")


def test_no_module_is_over_500_lines():
    long = {n: sum(1 for _ in open(p, encoding="utf-8")) for n, p in MODULES.items()}
    assert {n: k for n, k in long.items() if k > MAX_LINES} == {}


def test_no_import_circle_inside_the_package():
    graph = {}
    for name, path in MODULES.items():
        # A module's own parent packages are imported implicitly first; an edge to
        # them is not a dependency on their contents.
        parents = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)}
        graph[name] = {m for m in _imports(name, path) if m in MODULES and m != name and m not in parents}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "active"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "active":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith(("fsdp2_compat.core", "fsdp2_compat.integrations")))
                         + ["fsdp2_compat", "fsdp2_compat.auto", "fsdp2_compat.registry", "fsdp2_compat.fixes",
                            "fsdp2_compat.activation.bootstrap"])
def test_the_start_up_path_imports_only_the_standard_library_at_module_top(name):
    """What ``import fsdp2_compat.auto`` loads: the core, the catalogue (registry, the fixes' declarations in
    ``fixes/__init__``, the integrations' targets), never a fix's code (``fixes.<mechanism>``)."""
    stdlib = set(sys.stdlib_module_names)
    for mod in _imports(name, MODULES[name], top_level_only=True):
        assert mod.split(".")[0] in stdlib or mod.startswith("fsdp2_compat"), (name, mod)
        if mod.startswith("fsdp2_compat"):
            assert not mod.startswith(("fsdp2_compat_harness", "fsdp2_compat.fixes.")), (name, mod)


def test_the_wheel_holds_no_test_only_code():
    for name, path in MODULES.items():
        for mod in _imports(name, path):
            assert mod.split(".")[0] not in ("tests", "support", "conftest"), (name, mod)
    assert not any(n.startswith("fsdp2_compat.examples") for n in MODULES)


def test_the_runtime_never_imports_the_harness():
    runtime = [n for n in MODULES if n.split(".")[0] == "fsdp2_compat"]
    assert runtime and any(n.startswith("fsdp2_compat_harness.") for n in MODULES)
    for name in runtime:
        assert not any(m.split(".")[0] == "fsdp2_compat_harness" for m in _imports(name, MODULES[name])), name
