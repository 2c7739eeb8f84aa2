"""``fsdp2-compat check`` runs every scenario through one interface, and each proves a fix of the catalogue.

Each module of ``fsdp2_compat_harness.check`` that holds a ``SCENARIO`` is
found by ``check`` itself (adding a framework's rows is one module); its kinds
are its own, and every kind proves a fix that names it (``Fix.scenarios``),
as every kind a fix names is one a scenario makes.  Read without torch.
"""

import pytest

pytest.importorskip("fsdp2_compat_harness", reason="needs the harness (check's scenarios)")

from fsdp2_compat import fixes  # noqa: E402
from fsdp2_compat_harness.check import scenario  # noqa: E402

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("fsdp2-compat-harness",)


def test_every_scenario_module_is_found_and_speaks_the_one_interface():
    import importlib
    import pkgutil

    from fsdp2_compat_harness import check

    modules = [importlib.import_module("fsdp2_compat_harness.check." + m.name)
               for m in pkgutil.iter_modules(check.__path__)]
    holding = [m.SCENARIO for m in modules if hasattr(m, "SCENARIO")]
    found = scenario.scenarios()
    assert len(found) == len(holding) >= 10 and set(map(id, found)) == set(map(id, holding))
    assert [s.ORDER for s in found] == sorted({s.ORDER for s in found}), "one ORDER each"
    for s in found:
        assert isinstance(s, scenario.Scenario) and s.KINDS, s
        assert type(s).cases is not scenario.Scenario.cases and type(s).run is not scenario.Scenario.run, s
    kinds = [k for s in found for k in s.KINDS]
    assert len(kinds) == len(set(kinds)), "a kind belongs to one scenario"
    assert all(scenario.by_kind(k) is s for s in found for k in s.KINDS)


def test_every_check_kind_proves_a_fix_and_every_fix_names_real_kinds():
    kinds = {k for s in scenario.scenarios() for k in s.KINDS}
    named = {k for fix in fixes.FIXES for k in fix.scenarios}
    assert named <= kinds, named - kinds
    assert kinds <= named, "check rows that prove no fix: %s" % (kinds - named)


def test_a_row_is_built_from_typed_records():
    case = scenario.Case("verl", "0.9.1", "glm4v", "glm4v", "selection")
    bad = scenario.Result.failed("step 0: RuntimeError: boom")
    good = scenario.Result.of({"error": None, "loss_err": 0.0})
    row = scenario.row(case, bad, good, scenario.Scenario.fixed(None, case, bad, good))
    assert row["unpatched"] == "step 0: RuntimeError: boom" and row["patched"] == "ok"
    assert row["fixed"] is True and row["loss_match"] is True and row["tol"] == scenario.TOL
    assert set(row["output"]) == {"unpatched", "patched"}
