"""The README says what the catalogue says (no torch needed)."""

import os
import re

from fsdp2_compat import registry
from fsdp2_compat.cli import list_markdown

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ()

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


def test_the_patch_table_is_the_catalogue():
    text = open(README, encoding="utf-8").read()
    match = re.search(r"<!-- generated: fsdp2-compat list --markdown[^\n]*-->\n(.*?)<!-- end of generated table -->",
                      text, re.S)
    assert match, "the README lost its generated table markers"
    assert match.group(1).strip() == list_markdown().strip(), "regenerate it: fsdp2-compat list --markdown"


def test_every_patch_and_model_type_appears_in_the_table():
    table = list_markdown()
    for p in registry.PATCHES:
        assert "| `%s` |" % p.name in table
        for mt in p.model_types:
            assert "(`%s`)" % mt in table
