"""The test matrix: which pinned set runs which tests (stdlib only).

Every pinned set runs only the tests whose outcome it can change.  Each test
module declares, as a module-level tuple literal, the distributions whose
installed release its outcome depends on::

    DEPENDS_ON = ("torch", "transformers", "{framework}")

``"{framework}"`` stands for the dist name a test is parametrized with (an
argument named ``framework``); a test of such a module without that argument
depends on every wrapping framework.  ``"python"`` is the interpreter's X.Y.
``"fsdp2-compat-harness"`` is the harness distribution (``harness/``), which
``.ci/install-set`` installs from the clone into every set but ``bare``: a
test that needs it and nothing else runs in the first set after ``bare``.

A set runs a test when no earlier set (in ``order()``) pins the same
releases of everything the test depends on: that earlier set already proved
it on those releases.  Releases are read from the set files themselves
(``SET.txt`` / ``SET.nodeps.txt`` pins, the ``# python:`` / ``# torch:``
declarations), never from a venv, so the plan is known before anything is
installed; a local version label names a build, not other code (``2.13.0+cpu``
is release ``2.13.0``).  The set ``bare`` has no distribution but the test
tools: a module that depends on nothing runs there.

    python .ci/matrix.py plan [--durations .ci/durations.json]   set x module table, expected seconds
    python .ci/matrix.py check                                   every test module declares DEPENDS_ON
    python .ci/matrix.py order                                   the sets, in the order .ci/test runs them
    python .ci/matrix.py durations OUT.json SET.xml ...          per-set module seconds from junit files
    python .ci/matrix.py installs OUT.json < "SET SECONDS BUILT" lines   per-set install seconds (.ci/test)
    python .ci/matrix.py verify [VENV_ROOT]                      every test a set leaves out is run where it says

The tests' conftest applies the same rule to collected items when
``FSDP2_CI_SET`` names the set being run (``.ci/test`` sets it); without it
every test runs, as a developer expects from plain ``pytest``.
"""

import ast
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SETS_DIR = os.path.join(HERE, "sets")
TESTS_DIR = os.path.join(ROOT, "tests")
DURATIONS = os.path.join(HERE, "durations.json")
INSTALLS = os.path.join(HERE, "installs.json")  # per-set seconds of a build from empty caches (.ci/test writes them)
BARE = "bare"
HARNESS = "fsdp2-compat-harness"  # installed from the clone in every set but bare: one "release", the clone's
FRAMEWORK = "{framework}"
# The dists an item parametrized with no ``framework`` stands for (fsdp2_compat.integrations.wrapping()).
WRAPPING_FRAMEWORKS = ("verl", "skyrl", "skyrl-train", "areal", "llamafactory", "lmms-engine")
DEFAULT_TORCH = "2.13.0+cpu"  # .ci/install-set's default torch


def norm(name):
    """A distribution name as pip compares them (``skyrl_train`` == ``skyrl-train``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def release(version):
    """``2.13.0+cpu`` -> ``2.13.0``: the local label names a build of the same code."""
    return None if version is None else version.split("+", 1)[0]


def order():
    """The sets in the order ``.ci/test`` runs them: ``bare``, then the rest by name."""
    names = sorted(n[: -len(".nodeps.txt")] for n in os.listdir(SETS_DIR) if n.endswith(".nodeps.txt"))
    return [BARE] + names


def _declared(text, key):
    for line in text.splitlines():
        if line and not line.startswith("#"):
            break
        m = re.match(r"#\s*%s:\s*(\S+)" % key, line)
        if m:
            return m.group(1)
    return None


def pins(set_name, default_python=None):
    """``{dist: release}`` the set installs, plus ``"python"``: X.Y of its interpreter."""
    python = default_python or "%d.%d" % sys.version_info[:2]
    if set_name == BARE:
        return {"python": python}
    out = {}
    texts = []
    for suffix in (".txt", ".nodeps.txt"):
        with open(os.path.join(SETS_DIR, set_name + suffix)) as f:
            texts.append(f.read())
    for text in texts:
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*(\S+)$", line)
            if m:
                out[norm(m.group(1))] = release(m.group(2))
    torch = _declared(texts[0], "torch")
    out["torch"] = release(torch.split("==", 1)[1] if torch else DEFAULT_TORCH)
    out["python"] = _declared(texts[0], "python") or python
    out[HARNESS] = "clone"
    return out


def module_depends(path):
    """The ``DEPENDS_ON`` tuple of a test module, read without importing it (None when absent)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "DEPENDS_ON" for t in node.targets):
            value = ast.literal_eval(node.value)
            if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
                raise ValueError("%s: DEPENDS_ON must be a tuple of distribution names" % path)
            return value
    return None


def marker_depends(path):
    """The argument tuples of every ``@pytest.mark.depends_on(...)`` decorator in a test module (ast)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in ast.walk(tree):
        for deco in getattr(node, "decorator_list", ()):
            if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                    and deco.func.attr == "depends_on"):
                out.append(tuple(ast.literal_eval(a) for a in deco.args))
    return out


def expand(depends, framework=None):
    """The concrete dists of ``depends`` for one item (``framework``: its parameter, if any)."""
    out = []
    for dep in depends:
        if dep == FRAMEWORK:
            out.extend([framework] if framework else WRAPPING_FRAMEWORKS)
        else:
            out.append(dep)
    return tuple(norm(d) if d != "python" else d for d in out)


def key(set_pins, dists):
    return tuple(set_pins.get(d) for d in dists)


def first_set(dists, all_pins, sets):
    """The first set in ``sets`` with each distinct key: ``{key: set}``."""
    firsts = {}
    for s in sets:
        firsts.setdefault(key(all_pins[s], dists), s)
    return firsts


def runs_in(set_name, dists, all_pins, sets):
    """True when ``set_name`` is the first of ``sets`` pinning these releases of ``dists``."""
    k = key(all_pins[set_name], dists)
    return first_set(dists, all_pins, sets)[k] == set_name


def all_pins(sets=None, default_python=None):
    sets = sets or order()
    return {s: pins(s, default_python) for s in sets}


def test_modules():
    out = []
    for dirpath, _, files in os.walk(TESTS_DIR):
        for f in files:
            if f.startswith("test_") and f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(dirpath, f), ROOT))
    return sorted(out)


def _groups(depends):
    """The concrete dependency tuples of one DEPENDS_ON: one per framework for ``{framework}``."""
    if FRAMEWORK in depends:
        return [expand(depends, fw) for fw in WRAPPING_FRAMEWORKS]
    return [expand(depends)]


def _rows():
    """``[(module, [dists, ...])]``: the dependency groups of the module's tests (its DEPENDS_ON, each
    framework of a ``{framework}`` module, each ``depends_on`` marker); None when undeclared."""
    rows = []
    for path in test_modules():
        full = os.path.join(ROOT, path)
        depends = module_depends(full)
        if depends is None:
            rows.append((path, None))
            continue
        groups = []
        for d in [depends] + marker_depends(full):
            for g in _groups(d):
                if g not in groups:
                    groups.append(g)
        rows.append((path, groups))
    return rows


def _skips(set_pins, dists):
    """Whether a group's tests can only skip in a set: it lacks torch they need, or every framework
    they name (the display's guess; the tests themselves decide, by skipping)."""
    if ("torch" in dists and set_pins.get("torch") is None) or (HARNESS in dists and set_pins.get(HARNESS) is None):
        return True
    frameworks = [d for d in dists if d in WRAPPING_FRAMEWORKS + ("trl", "axolotl", "ms-swift")]
    return bool(frameworks) and all(set_pins.get(d) is None for d in frameworks)


def plan(durations_path=DURATIONS, out=sys.stdout):
    """Print the set x module table and each set's expected pytest seconds; returns {set: seconds}.

    A cell is ``x`` when the set runs every dependency group of the module, ``p`` when it runs
    some (a framework's share, a marked test), ``.`` when earlier sets proved all of them, and
    ``-`` when what it runs lacks a dist in this set (those tests skip there).  The
    expected seconds count a module's measured time (``durations.json``: per set, summed over
    tests, so about twice the wall time under ``-n 2``) in proportion to the groups run.
    """
    sets = order()
    pinned = all_pins(sets)
    durations = {}
    if durations_path and os.path.exists(durations_path):
        with open(durations_path) as f:
            durations = json.load(f)
    rows = _rows()
    width = max(len(r) for r, _ in rows)
    out.write("%-*s  %s\n" % (width, "module (x: runs, p: part, .: proven earlier, -: skips)",
                                " ".join("%-8s" % s[:8] for s in sets)))
    expected = dict.fromkeys(sets, 0.0)
    for module, groups in rows:
        cells = []
        for s in sets:
            share = 1.0 if groups is None else sum(runs_in(s, g, pinned, sets) for g in groups) / len(groups)
            lacking = groups is not None and share and all(
                _skips(pinned[s], g) for g in groups if runs_in(s, g, pinned, sets))
            cells.append("%-8s" % ("-" if lacking else "x" if share == 1.0 else "p" if share else "."))
            if share:
                seconds = durations.get(s, {}).get(module)
                if seconds is None:  # not measured in this set: the most it took anywhere
                    seconds = max([d.get(module, 0.0) for d in durations.values()] or [0.0])
                expected[s] += seconds * share
        out.write("%-*s  %s\n" % (width, module, " ".join(cells)))
    if durations:
        out.write("%-*s  %s\n" % (width, "expected test seconds, both workers (%s)" % os.path.basename(durations_path),
                                    " ".join("%-8d" % expected[s] for s in sets)))
        # -n 2 on 2 cores overlaps the two workers' tests only partly: 1.5x is what the measured run gave.
        out.write("expected pytest wall time: ~%d s over all sets under -n 2 (test seconds / 1.5, on the machine "
                  "that measured them)\n" % (sum(expected.values()) / 1.5))
    _install_estimate(sets, out)
    undeclared = [r for r, d in rows if d is None]
    if undeclared:
        out.write("modules without DEPENDS_ON (run in every set): %s\n" % ", ".join(undeclared))
    return expected


def _install_estimate(sets, out, path=INSTALLS):
    """Print what building the venvs costs: each set's seconds from the last cold run (``installs.json``)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        measured = json.load(f)
    cold = {s: measured[s]["seconds"] for s in sets if s in measured and measured[s].get("built")}
    if not cold:
        return
    unmeasured = [s for s in sets if s not in cold]
    out.write("expected install seconds on a machine without the venvs (%s; empty uv cache): %s = %d s%s;"
              " with the venvs built (stamps match): ~2 s a set\n"
              % (os.path.basename(path), " ".join("%s %d" % (s, cold[s]) for s in sets if s in cold), sum(cold.values()),
                 " (not measured yet: %s)" % ", ".join(unmeasured) if unmeasured else ""))


def installs(out_path, lines):
    """``SET SECONDS BUILT`` lines (``.ci/test``) -> ``{set: {"seconds": s, "built": bool}}`` in ``out_path``."""
    table = {}
    for line in lines:
        parts = line.split()
        if len(parts) == 3:
            table[parts[0]] = {"seconds": int(parts[1]), "built": parts[2] == "true"}
    with open(out_path, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    return table


def check():
    """Every test module declares DEPENDS_ON with known placeholders; returns the problems."""
    problems = []
    for path in test_modules():
        try:
            depends = module_depends(os.path.join(ROOT, path))
        except (ValueError, SyntaxError) as exc:
            problems.append(str(exc))
            continue
        if depends is None:
            problems.append("%s declares no DEPENDS_ON (a tuple of the dists whose release changes its outcome)" % path)
        elif any(d.startswith("{") and d != FRAMEWORK for d in depends):
            problems.append("%s: unknown placeholder in DEPENDS_ON %r (only %s)" % (path, depends, FRAMEWORK))
    return problems


def durations(out_path, junit_paths):
    """Sum each test module's seconds per set from pytest's junit files (``SET.xml``) into ``out_path``."""
    import xml.etree.ElementTree as ET

    table = {}
    for path in junit_paths:
        set_name = os.path.basename(path)[: -len(".xml")]
        per_module = table.setdefault(set_name, {})
        for case in ET.parse(path).iter("testcase"):
            module = case.get("file") or (case.get("classname", "").replace(".", "/") + ".py")
            per_module[module] = round(per_module.get(module, 0.0) + float(case.get("time") or 0.0), 1)
    with open(out_path, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    return table


def verify(venv_root, out=sys.stdout):
    """Collect every set that has a venv (``pytest --collect-only`` under FSDP2_CI_SET) and check that each
    test a set leaves out is collected, and selected, in the set the matrix says proves it.  Returns the
    problems (a missing venv is one)."""
    import subprocess
    import tempfile

    sets = order()
    selected, proven_by, problems = {}, {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for s in sets:
            python = os.path.join(venv_root, s, "bin", "python")
            if not os.path.exists(python):
                problems.append("%s: no venv at %s (bash .ci/install-set %s)" % (s, python, s))
                continue
            report = os.path.join(tmp, s + ".json")
            env = dict(os.environ, FSDP2_CI_SET=s, FSDP2_CI_COLLECT_REPORT=report)
            if s == BARE:
                env["PYTHONPATH"] = ROOT
            proc = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "tests"],
                                  cwd=ROOT, env=env, capture_output=True, text=True)
            if not os.path.exists(report):
                problems.append("%s: collection failed (%d): %s" % (s, proc.returncode, proc.stdout[-500:]))
                continue
            with open(report) as f:
                data = json.load(f)
            selected[s] = set(data["selected"])
            proven_by[s] = data["proven_by"]
            out.write("%-10s %4d selected, %4d proven by an earlier set\n" % (s, len(selected[s]), len(proven_by[s])))
    for s, left in proven_by.items():
        for nodeid, by in left.items():
            if by in selected and nodeid not in selected[by]:
                problems.append("%s leaves out %s, but %s (which should prove it) does not run it" % (s, nodeid, by))
    return problems


def main(argv):
    if argv[:1] == ["verify"]:
        root = argv[1] if len(argv) > 1 else os.environ.get("FSDP2_CI_VENV_ROOT", os.path.join(ROOT, ".venv"))
        problems = verify(root)
        for p in problems:
            print(p)
        return 1 if problems else 0
    if argv[:1] == ["order"]:
        print(" ".join(order()))
        return 0
    if argv[:1] == ["durations"]:
        durations(argv[1], argv[2:])
        return 0
    if argv[:1] == ["installs"]:
        installs(argv[1], sys.stdin.read().splitlines())
        return 0
    if argv[:1] == ["plan"]:
        path = argv[argv.index("--durations") + 1] if "--durations" in argv else DURATIONS
        plan(path)
        return 0
    if argv[:1] == ["check"]:
        problems = check()
        for p in problems:
            print(p)
        return 1 if problems else 0
    print(__doc__.split("\n\n")[-2], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
