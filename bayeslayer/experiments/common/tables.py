"""Markdown table cells shared by the experiments' ``table(record)`` functions and the docs' table builder
(``tools/build_tables.py``), so that a generated table looks the same wherever it is made.

Each experiment lays out its own record (``table(record)`` beside ``plot(record)``, in the experiment's module
or a sibling module of its package); these are the pieces every layout uses: a row, a ``mean ± std`` cell, the
minus sign the docs print, and the check that a function was handed records."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown_row(cells: Iterable[str]) -> str:
    """``| a | b |``: one row of a Markdown table, runs of spaces squeezed to one (an empty cell is ``| |``)."""
    return " ".join(("| " + " | ".join(cells) + " |").split(" ")).replace("|  |", "| |").replace("|  |", "| |")


def separator(columns: int) -> str:
    """``|---|---|``: the rule under a header of ``columns`` cells."""
    return "|" + "---|" * columns


def mean_std(mean: float, std: float, digits: int) -> str:
    """``mean ± std`` with ``digits`` decimals each."""
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def minus(text: str) -> str:
    """A number as the docs print it: the minus sign U+2212, not a hyphen."""
    return text.replace("-", "−")


def signed_mean_std(mean: float, std: float, digits: int = 3) -> str:
    """:func:`mean_std` with the minus sign U+2212 (a margin or a change that may be negative)."""
    return minus(mean_std(mean, std, digits))


def check_record(record, name: str = "record") -> dict:
    """``record`` itself when it is a results record (a dict, as read from its JSON); a clear error otherwise."""
    if not isinstance(record, dict):
        raise TypeError(f"{name} must be a results record (a dict read from its JSON), got {type(record).__name__}")
    return record


def check_records(records, name: str = "records") -> list[dict]:
    """One record or a non-empty sequence of them (runs of one task written by separate commands), as a list."""
    if isinstance(records, dict):
        return [records]
    if isinstance(records, (str, bytes)) or not isinstance(records, Sequence) or not records:
        raise TypeError(f"{name} must be a results record or a non-empty sequence of them, "
                        f"got {type(records).__name__}")
    return [check_record(r, f"{name}[{i}]") for i, r in enumerate(records)]
