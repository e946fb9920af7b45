"""Input checks shared by every layer of the package (the one integer check lives here).

Layers, models, training, data and experiments all validate counts; this module sits below them all,
so each imports the same check instead of keeping its own copy with its own rules and wording.
"""

from __future__ import annotations

import numbers

from .errors import NotAnIntegerError

# The largest integer any count may be: PyTorch sizes, seeds and NumPy take a signed 64-bit integer, and a
# larger one fails deep inside them (an overflow with a C++ stack), not with a message naming the argument.
INT_MAX = 2**63 - 1


def check_int(name: str, value, *, minimum: int, maximum: int = INT_MAX) -> int:
    """``value`` as an ``int`` when it is an integer in ``[minimum, maximum]``: the package's one integer check.

    Python and NumPy integers pass (``numbers.Integral``); ``bool``, floats (``3.0`` too), strings and
    everything else raise :class:`~bayeslayer.errors.NotAnIntegerError` (a ``TypeError`` that is also a
    ``ValueError``); an integer below ``minimum`` or above ``maximum`` (by default the largest signed
    64-bit integer, :data:`INT_MAX`) raises ``ValueError``.  Both messages name the argument.

    >>> check_int("steps", 3, minimum=1)
    3
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise NotAnIntegerError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    if value > maximum:
        raise ValueError(f"{name} must be an integer <= {maximum}, got {value}")
    return int(value)


def check_optional_int(name: str, value, *, minimum: int, maximum: int = INT_MAX) -> int | None:
    """``None`` as it is, else :func:`check_int` (an optional count: a cap that may be absent)."""
    return None if value is None else check_int(name, value, minimum=minimum, maximum=maximum)


__all__ = ["INT_MAX", "check_int", "check_optional_int"]
