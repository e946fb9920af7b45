"""The project's error types, and which failures the command line treats as expected.

``bayeslayer.cli.main`` turns an *expected* failure into one line on stderr,
``bayeslayer <command>: error: <message>``, and exit code 2; ``bayeslayer --debug ...`` shows the
traceback instead.  Expected means the cause lies in what the user gave or in the machine, not in
our code:

* :class:`UsageError` (a ``ValueError``): a bad command-line value found before any work starts
  (a malformed number, an unknown name, a bad ``--out``, ``--device cuda`` without a GPU, ...).
* any other ``ValueError``: every public function of the package validates its arguments and
  raises ``ValueError`` naming the argument (a bad preset override, a corrupt JSON file, ...);
  a non-integer where an integer is required is :class:`NotAnIntegerError`, both a ``TypeError``
  and a ``ValueError``.
* ``OSError``: a missing or unreadable file, a folder that is a file, a full disk, a busy output
  folder (the lock), ...; ``FileNotFoundError``, ``PermissionError`` and the rest are subclasses.
* ``FloatingPointError``: training diverged (a non-finite loss, or weights an update made NaN or Inf);
  the message names the step.
* ``SystemExit`` with a message (``raise SystemExit("...")``): printed as the same one line.
* running out of memory: ``torch.OutOfMemoryError`` (a GPU), ``MemoryError``, and the ``RuntimeError``
  of PyTorch's CPU allocator (``DefaultCPUAllocator: can't allocate memory``): the model or batch does
  not fit (:func:`is_out_of_memory`).

``KeyboardInterrupt`` (Ctrl-C) prints one line, ``interrupted; the last checkpoint is kept in
<dir>`` when the interrupted code raised :class:`Interrupted` with that folder, and exits 130.

Everything else (``TypeError``, ``RuntimeError``, ``KeyError``, ...) is a bug or an
unforeseen state: the traceback is shown and the exit code is 1.
"""

from __future__ import annotations

import os

EXIT_USAGE = 2  # an expected failure: bad input, missing file, busy folder, no GPU, ...
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C'd program


class UsageError(ValueError):
    """A bad command-line value, found before any work starts.  Its message names the option."""


class NotAnIntegerError(TypeError, ValueError):
    """A value that is not an integer where an integer is required (:func:`bayeslayer.checks.check_int`).

    The wrong type, so a ``TypeError``; and a bad argument like any other, so also the ``ValueError``
    every public function raises for one, which the command line reports as one line.
    """


class SizeError(ValueError):
    """A size no memory of the machine holds (an argument or a config field, which the message names), refused
    before anything is allocated."""


class NonFiniteError(ValueError):
    """A tensor holds NaN or Inf values where finite ones are required (the ops' input checks).

    In training, one raised after the first step means the run diverged (the training loop says so).
    """


class PrecisionWarning(UserWarning):
    """A result is computed, but in a precision that loses part of it (a float32 state holding a prior too
    wide for float32); the message says what to pass instead."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C after the work saved its state; ``checkpoint`` is the folder a rerun resumes from.

    A training loop that catches ``KeyboardInterrupt``, saves a checkpoint and re-raises this
    lets ``bayeslayer`` say where the run can be resumed.
    """

    def __init__(self, checkpoint: str | os.PathLike | None = None) -> None:
        super().__init__(checkpoint)
        self.checkpoint = None if checkpoint is None else str(checkpoint)


def expected_errors() -> tuple[type[BaseException], ...]:
    """The exception types :func:`bayeslayer.cli.main` reports as one line (see the module docstring)."""
    import torch

    return (ValueError, OSError, torch.OutOfMemoryError, MemoryError, FloatingPointError)


# what PyTorch's allocators say when an allocation fails (a RuntimeError, not torch.OutOfMemoryError, on the CPU)
_OUT_OF_MEMORY_TEXTS = ("can't allocate memory", "out of memory", "not enough memory")


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is a failed allocation: ``torch.OutOfMemoryError``, ``MemoryError`` or the
    ``RuntimeError`` of PyTorch's CPU allocator."""
    import torch

    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(t in text for t in _OUT_OF_MEMORY_TEXTS)


__all__ = [
    "EXIT_INTERRUPTED", "EXIT_USAGE", "Interrupted", "NonFiniteError", "PrecisionWarning", "SizeError", "UsageError",
    "expected_errors", "is_out_of_memory",
]
