"""What ``fsdp2-compat status`` prints: one row per target, the refusals first, fitted to the terminal."""

import fsdp2_compat
from fsdp2_compat import registry
from fsdp2_compat.core import engine
from fsdp2_compat.core.status import by_target, format_compact, headline, status

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python",)


def test_each_target_is_one_row_naming_every_patch_that_requested_it():
    fsdp2_compat.apply()  # everything: the torch accumulation targets are in most patches
    rows = by_target(status())
    keys = [r["target"] for r in rows]
    assert sorted(keys) == sorted(t.key for t in registry.targets())
    for target in registry.targets():
        [row] = [r for r in rows if r["target"] == target.key]
        assert sorted(row["patches"]) == sorted(p.name for p in registry.PATCHES if target in p.targets)


def test_compact_lines_fit_the_width_and_the_headline_names_what_was_refused():
    fsdp2_compat.apply()
    rows = by_target(status())
    assert all(len(line) <= 100 for line in format_compact(rows, 100).splitlines()[1:])
    assert headline(rows)[0].startswith("ok: nothing requested was refused")
    refused = dict(rows[0], outcome=engine.DRIFTED, detail="fingerprint 00 expected 11")
    lines = headline([refused] + rows[1:])
    assert lines[0].startswith("NOT APPLIED: 1 requested target(s) refused or failed")
    assert refused["what"] in lines[1] and "fingerprint 00 expected 11" in lines[1]
