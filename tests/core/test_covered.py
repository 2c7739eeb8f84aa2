"""A framework with no seam of its own still shows in ``status``: its proven paths, read without importing it.

ms-swift's paths are fixed by targets other integrations own (``integrations.ms_swift``); ``core.covered``
says per installed release whether each path's code is what the tests ran on.  On the toy distribution
(``conftest.toy``; no torch).
"""

import sys

from fsdp2_compat.core import covered
from fsdp2_compat.core.records import Covered, Integration

DEPENDS_ON = ("python",)


def _integration(toy, **fingerprints):
    return Integration("f2c-toy", "f2c_toy", None, covered=(
        Covered("f2c_toy.utils", "select", fingerprints.get("select", {"1.2.0": toy.fp_select}), "shared fix A"),
        Covered("f2c_toy.utils", "Engine.prepare", fingerprints.get("prepare", {"1.2.0": toy.fp_prepare}),
                "upstream bug", fixed=False),
        Covered("f2c_toy.absent", "gone", {"1.2.0": "0"}, "nothing"),
    ))


def test_a_path_with_the_proven_code_is_proven_and_names_what_covers_it(toy):
    rows = covered.rows([_integration(toy)])
    assert [(r["path"], r["outcome"]) for r in rows] == [
        ("f2c_toy.utils.select", "proven"), ("f2c_toy.utils.Engine.prepare", "proven broken"),
        ("f2c_toy.absent.gone", "absent")]
    assert rows[0]["found"] == "1.2.0" and rows[0]["detail"] == "code of 1.2.0: shared fix A"
    assert "f2c_toy" not in sys.modules  # read from the installed files, never imported
    assert covered.format_lines(rows)[1].startswith("  f2c-toy 1.2.0  f2c_toy.utils.select: proven")


def test_other_code_is_unverified_not_assumed_covered(toy):
    rows = covered.rows([_integration(toy, select={"1.0.0": "feedfacefeedface"})])
    assert rows[0]["outcome"] == "unverified"
    assert "code differs from the proven release(s) 1.0.0 (fingerprint %s)" % toy.fp_select in rows[0]["detail"]


def test_an_integration_not_installed_or_without_paths_adds_no_row(toy):
    assert covered.rows([Integration("f2c-not-installed", "nope", None, covered=_integration(toy).covered)]) == []
    assert covered.rows([Integration("f2c-toy", "f2c_toy", None)]) == []
    assert covered.format_lines([]) == []
