"""The README's generated cells say each range once: overlapping and adjacent ranges are merged."""

import pytest

pytest.importorskip("packaging")
pytest.importorskip("fsdp2_compat_harness", reason="needs the harness (the README tables live there)")

from fsdp2_compat_harness.tables import merge_specs  # noqa: E402

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("fsdp2-compat-harness",)


def test_ranges_sharing_an_end_become_the_widest_one():
    specs = [">=4.44.0,<4.57.0", ">=4.45.0,<4.57.0", ">=4.49.0,<4.57.0", ">=4.56.0,<4.57.0", "==5.0.0rc3"]
    assert merge_specs(specs) == [">=4.44.0,<4.57.0", "==5.0.0rc3"]


def test_adjacent_ranges_become_one():
    assert merge_specs(["<1.6.0", ">=1.6.0,<1.14.0"]) == ["<1.14.0"]
    assert merge_specs(["<0.9.4", "==0.9.4"]) == ["<=0.9.4"]
    assert merge_specs(["<0.5", ">=0.5,<=0.6", ">0.6,<0.9"]) == ["<0.9"]


def test_disjoint_ranges_stay_apart_in_release_order():
    assert merge_specs([">=2.15.0", "<2.6.0"]) == ["<2.6.0", ">=2.15.0"]
    # excluded on both sides of 1.0: a gap, not adjacency
    assert merge_specs(["<1.0", ">1.0"]) == ["<1.0", ">1.0"]


def test_a_range_that_merges_with_nothing_keeps_its_spelling():
    assert merge_specs(["< 1.1.0"]) == ["< 1.1.0"]


def test_a_spec_that_is_not_one_interval_is_kept_as_written():
    assert merge_specs(["!=1.5", ">=1.0,<2.0", "~=3.1"]) == [">=1.0,<2.0", "!=1.5", "~=3.1"]


def test_the_union_is_unchanged():
    from packaging.specifiers import SpecifierSet

    specs = ["<1.6.0", ">=1.6.0,<1.14.0", ">=2.0,<2.5", ">=2.4,<3.0", "==5.0.0rc3", ">=7.0"]
    merged = merge_specs(specs)
    probes = ["0.1", "1.6.0", "1.13.9", "1.14.0", "1.99", "2.0", "2.4.5", "2.9", "3.0", "5.0.0rc3", "5.0.0", "7.0", "9"]
    for v in probes:
        before = any(SpecifierSet(s).contains(v, prereleases=True) for s in specs)
        after = any(SpecifierSet(s).contains(v, prereleases=True) for s in merged)
        assert before == after, (v, merged)
