"""The CI test matrix (.ci/matrix.py): what each pinned set runs, read from the set files."""

import importlib.util
import os

import pytest

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ()

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def matrix():
    spec = importlib.util.spec_from_file_location("fsdp2_ci_matrix_test", os.path.join(REPO, ".ci", "matrix.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_test_module_declares_what_it_depends_on(matrix):
    assert matrix.check() == []


def test_set_pins_come_from_the_set_files_with_build_labels_dropped(matrix):
    sets = matrix.order()
    assert sets[0] == "bare"
    pinned = matrix.all_pins(sets, default_python="3.11")
    assert pinned["bare"] == {"python": "3.11"}
    for name in sets[1:]:
        with open(os.path.join(REPO, ".ci", "sets", name + ".txt")) as f:
            text = f.read()
        [tf] = [l.split("#")[0].strip() for l in text.splitlines() if l.startswith("transformers==")]
        assert pinned[name]["transformers"] == tf.split("==")[1]
        assert "+" not in pinned[name]["torch"], "a local label names a build, not a release"
        declared = [l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith("# python:")]
        assert pinned[name]["python"] == (declared[0] if declared else "3.11")


def test_a_test_runs_in_the_first_set_pinning_each_distinct_release(matrix):
    pinned = {"a": {"torch": "1", "trl": "1"}, "b": {"torch": "1", "trl": "2"}, "c": {"torch": "1", "trl": "1"},
              "d": {"torch": "2"}}
    sets = ["a", "b", "c", "d"]
    assert [s for s in sets if matrix.runs_in(s, ("torch",), pinned, sets)] == ["a", "d"]
    assert [s for s in sets if matrix.runs_in(s, ("torch", "trl"), pinned, sets)] == ["a", "b", "d"]
    assert [s for s in sets if matrix.runs_in(s, (), pinned, sets)] == ["a"]


def test_framework_placeholder_takes_the_parameter_or_every_wrapping_framework(matrix):
    assert matrix.expand(("torch", "{framework}"), "skyrl_train") == ("torch", "skyrl-train")
    assert matrix.expand(("{framework}",)) == matrix.WRAPPING_FRAMEWORKS


def test_every_wrapping_framework_is_known_to_the_matrix(matrix):
    """The matrix is stdlib-only and cannot import the integrations: its list must follow them."""
    from fsdp2_compat import integrations

    assert set(matrix.WRAPPING_FRAMEWORKS) == {i.dist for i in integrations.wrapping()}


def test_the_plan_names_every_set_and_module(matrix):
    import io

    out = io.StringIO()
    matrix.plan(durations_path=None, out=out)
    text = out.getvalue()
    assert all(s[:8] in text.splitlines()[0] for s in matrix.order())
    assert all(m in text for m in matrix.test_modules())
