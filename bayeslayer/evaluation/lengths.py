"""The paper's context lengths and their names in every table and plot.

:data:`PAPER_LENGTHS` are the context lengths of the paper's NIAH and held-out tables (docs/theory.md §8.6);
:func:`length_label` names a length alike everywhere.

>>> [length_label(n) for n in PAPER_LENGTHS]
['2k', '4k', '8k', '16k']
>>> length_label(1000), length_label("3072")
('1,000', '3k')
"""

from __future__ import annotations

from ..checks import check_int

#: the context lengths of the paper's NIAH and held-out tables (Tables 6 and 7)
PAPER_LENGTHS = (2048, 4096, 8192, 16384)


def length_label(length: int | str) -> str:
    """``2048`` → ``"2k"`` (a multiple of 1,024), else the count with thousands separators (``"1,000"``).

    ``length`` may be the string form a JSON key holds (``"2048"``); it must name an integer >= 1.
    """
    if isinstance(length, str):
        try:
            length = int(length)
        except ValueError:
            raise ValueError(f"length must be an integer >= 1, got {length!r}") from None
    length = check_int("length", length, minimum=1)
    return f"{length // 1024}k" if length % 1024 == 0 else f"{length:,}"


__all__ = ["PAPER_LENGTHS", "length_label"]
