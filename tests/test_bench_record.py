"""The one markdown table writer every benchmark uses."""

import pytest

from bench.record import table


def test_a_table_has_its_header_alignment_rule_and_one_line_per_row():
    lines = table(["case", "ms", "mark"], [["a", "1.5", "x"], ["b", 2, None]], "lrc")
    assert lines == ["| case | ms | mark |", "|---|---:|:---:|", "| a | 1.5 | x |", "| b | 2 | None |"]


@pytest.mark.parametrize(("rows", "align"), [([["a", "1"]], "lrr"), ([["a"]], "lr"), ([["a", "1"]], "lx")])
def test_a_row_or_alignment_that_does_not_fit_the_header_is_refused(rows, align):
    with pytest.raises(ValueError, match=r"align|cells"):
        table(["case", "ms"], rows, align)
