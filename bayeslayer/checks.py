"""Input checks shared by every layer of the package (the one integer check lives here).

``bayeslayer.data`` and ``bayeslayer.experiments`` both validate counts; this module sits below both,
so each imports the same check instead of keeping its own copy with its own rules.
"""

from __future__ import annotations

import numbers


def check_int(name: str, value, *, minimum: int) -> int:
    """``value`` as an ``int`` when it is an integer ``>= minimum``: the one integer check of the experiments.

    Python and NumPy integers pass (``numbers.Integral``); ``bool``, floats (``3.0`` too), strings and
    everything else raise ``TypeError``; an integer below ``minimum`` raises ``ValueError``.  Both
    messages name the argument.

    >>> check_int("steps", 3, minimum=1)
    3
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


__all__ = ["check_int"]
