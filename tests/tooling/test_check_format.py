"""``fsdp2-compat check``'s table: every cell in full, wrapped at word boundaries (no torch needed)."""

import pytest

pytest.importorskip("fsdp2_compat_harness", reason="needs the harness (check's table)")

from fsdp2_compat_harness.check import table as check  # noqa: E402

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("fsdp2-compat-harness",)

ERROR = ("step 0: RuntimeError: aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor, "
         "need to convert all torch.Tensor to DTensor before calling distributed operators!")


def _row(**kw):
    row = dict(framework="verl", version="0.9.1", family="glm4v", kind="selection", patch="glm4v",
               loss_match=True, loss_err=0.0, patched="ok", unpatched=ERROR, fixed=True)
    row.update(kw)
    return row


def test_long_cells_wrap_at_word_boundaries_and_lose_no_word():
    rows = [_row(), _row(family="qwen2_5_vl", patched="step 0: AttributeError: 'NoneType' object has no "
                                                        "attribute 'ndim'", loss_err=None, loss_match=None)]
    table = check.format_rows(rows, width=120)
    lines = table.splitlines()
    assert lines[0].split() == [c.upper() for c in check.COLUMNS]
    assert max(len(line) for line in lines) <= 120
    assert len(lines) > 3  # the long cells did wrap
    words = table.split()
    for cell in (ERROR, rows[1]["patched"]):
        for word in cell.split():
            assert word in words, word  # nothing cut mid-word, nothing dropped


def test_narrow_terminals_still_get_a_readable_last_column():
    table = check.format_rows([_row()], width=40)
    body = [line for line in table.splitlines()[1:]]
    last = [line.rstrip().rsplit("  ", 1)[-1].strip() for line in body]
    assert " ".join(last).split() == ERROR.split()  # the whole message, in order
    assert all(len(piece) <= check._LAST_MIN or " " not in piece for piece in last)


def test_by_default_each_case_is_one_line_with_a_short_symptom():
    from fsdp2_compat_harness.check import table as check_table

    rows = [_row(), _row(family="qwen3_vl", kind="fused, 2 ranks", patch="qwen3vl",
                         unpatched="runs, but the lm_head.weight gradient misses the data-parallel average by 0.11"),
            _row(family="lfm2_vl", unpatched="ok"), _row(family="step3p7", unpatched="AttributeError: x", patched="-",
                                                         fixed=None, loss_err=None)]
    lines = check_table.format_lines(rows).splitlines()
    assert len(lines) == 1 + len(rows)
    assert "crash: aten.grid_sampler_2d mixed Tensor/DTensor" in lines[1]
    assert "silent: lm_head.weight grad off the DP average by 0.11" in lines[2]
    assert "not reproduced on this stack" in lines[3]  # the patch ran, but upstream did not fail here
    assert "not reproduced" not in lines[4]  # not applicable: no claim either way
    summary = check_table.summary_line(rows, 1.0)
    assert summary.startswith("check: 3 cases, 3 fixed by their patch, 0 not fixed; the bug showed unpatched in 2")
