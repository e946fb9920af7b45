"""Input checks shared by every layer of the package (the one integer check and the memory check live here).

Layers, models, training, data and experiments all validate counts and sizes; this module sits below them
all, so each imports the same check instead of keeping its own copy with its own rules and wording.
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path

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


def format_bytes(n: float) -> str:
    """``n`` bytes as ``"512 bytes"``, ``"1.5 GB"``, ... (powers of 1000, up to TB)."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


# a container's memory limit (cgroup v2, then v1): past it the kernel kills the process, no error is raised
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_size(device="cpu") -> int | None:
    """Bytes of memory of ``device``: for the CPU the machine's RAM or the container's limit, whichever is
    smaller; the GPU's for CUDA (None: unknown)."""
    import torch

    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev.index or 0).total_memory
    sizes = []
    try:
        sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        pass
    for path in _CGROUP_LIMITS:
        try:
            sizes.append(int(Path(path).read_text().strip()))  # "max" (no limit) is not an int
        except (OSError, ValueError):
            continue
    return min(sizes) if sizes else None


def check_fits(nbytes: float, *, what: str, device="cpu", error: type[ValueError] = ValueError) -> None:
    """Refuse work whose ``nbytes`` (a lower bound of what it allocates) exceed the memory of ``device``.

    The estimate runs before the work, so a size that can never fit fails at once with a line naming the
    argument (``what``, e.g. ``"--T 100000000"`` or ``"vocab_size=10**12"``), instead of after minutes or
    with the allocator's error.  Raises ``error`` (a ``ValueError`` class).
    """
    import torch

    total = memory_size(device)
    if total is not None and nbytes > total:
        where = "this machine's memory" if torch.device(device).type == "cpu" else f"the memory of {device}"
        raise error(f"{what} needs at least {format_bytes(nbytes)} of memory, more than {where} "
                    f"({format_bytes(total)}); use smaller sizes")


__all__ = ["INT_MAX", "check_fits", "check_int", "check_optional_int", "format_bytes", "memory_size"]
