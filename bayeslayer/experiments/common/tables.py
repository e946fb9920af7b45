"""Markdown table cells shared by the experiments' ``table(record)`` functions and the docs' table builder
(``tools/build_tables.py``), so that a generated table looks the same wherever it is made."""

from __future__ import annotations

from collections.abc import Iterable


def markdown_row(cells: Iterable[str]) -> str:
    """``| a | b |``: one row of a Markdown table, runs of spaces squeezed to one (an empty cell is ``| |``)."""
    return " ".join(("| " + " | ".join(cells) + " |").split(" ")).replace("|  |", "| |").replace("|  |", "| |")


def mean_std(mean: float, std: float, digits: int) -> str:
    """``mean ± std`` with ``digits`` decimals each."""
    return f"{mean:.{digits}f} ± {std:.{digits}f}"
