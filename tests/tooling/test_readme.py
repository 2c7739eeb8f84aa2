"""The README says what the catalogue says (no torch needed)."""

import os
import re

import pytest

from fsdp2_compat import registry
pytest.importorskip("fsdp2_compat_harness", reason="needs the harness (the README tables live there)")
from fsdp2_compat_harness import tables  # noqa: E402

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("fsdp2-compat-harness",)

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


def _block(text, name):
    match = re.search(r"<!-- generated: fsdp2-compat list --markdown \(%s;[^\n]*-->\n(.*?)<!-- end of generated %s -->"
                      % (name, name), text, re.S)
    assert match, "the README lost its generated %s markers" % name
    return match.group(1).strip()


@pytest.mark.parametrize("name, make", [("patches", tables.patch_table), ("matrix", tables.matrix_table)])
def test_the_generated_tables_are_the_catalogue(name, make):
    text = open(README, encoding="utf-8").read()
    assert _block(text, name) == make().strip(), "regenerate it: fsdp2-compat list --markdown"


def test_every_patch_and_model_type_appears_in_the_family_table():
    table = tables.patch_table()
    for p in registry.PATCHES:
        for mt in p.model_types:
            assert "| `%s` | `%s` |" % (mt, p.name) in table


def test_the_readme_reads_in_two_minutes():
    """Under 200 lines, no table cell over 200 characters; the detail lives in docs/."""
    lines = open(README, encoding="utf-8").read().splitlines()
    assert len(lines) < 200
    cells = [c.strip() for line in lines if line.startswith("|") for c in line.strip("|").split("|")]
    assert max(len(c) for c in cells) <= 200, max(cells, key=len)
    for link in re.findall(r"\]\((docs/[^)#]+)\)", "\n".join(lines)):
        assert os.path.exists(os.path.join(os.path.dirname(README), link)), link
