"""One home for the paper's lengths and their labels (bayeslayer.evaluation.lengths)."""

from __future__ import annotations

import doctest

import pytest

from bayeslayer.evaluation import lengths
from bayeslayer.evaluation.lengths import PAPER_LENGTHS, length_label


def test_doctests():
    assert doctest.testmod(lengths).failed == 0


def test_labels():
    assert PAPER_LENGTHS == (2048, 4096, 8192, 16384)
    assert [length_label(n) for n in (1024, 2048, 16384, 1000, 12345, 7)] == ["1k", "2k", "16k", "1,000", "12,345", "7"]
    assert length_label("8192") == "8k"  # JSON keys are strings


@pytest.mark.parametrize(("value", "exc"), [(0, ValueError), (-1024, ValueError), ("2k", ValueError),
                                            (2048.0, TypeError), (True, TypeError), (None, TypeError)])
def test_refuses_what_is_not_a_length(value, exc):
    with pytest.raises(exc, match="length must be an integer"):
        length_label(value)
