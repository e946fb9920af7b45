"""Ctrl-C during training: finish the step, save a checkpoint, stop with a clear message.

:func:`stop_on_interrupt` replaces Python's SIGINT handler for the duration of a training loop:
the first Ctrl-C only sets :attr:`StopRequest.requested`, which the loop checks after each
optimiser step (it then saves a checkpoint and raises :class:`TrainingInterrupted`); a second Ctrl-C
raises ``KeyboardInterrupt`` at once, and the loop still stops with the last complete checkpoint
on disk (checkpoint saves are crash-safe).  :class:`TrainingInterrupted` is a ``KeyboardInterrupt``,
so callers that run several trainings (seeds, stages) stop too; its message says where the run can
be resumed.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

from ..errors import Interrupted


class TrainingInterrupted(Interrupted):
    """A training loop stopped on Ctrl-C; ``step`` and ``checkpoint`` say what is on disk.

    An :class:`bayeslayer.errors.Interrupted` (a ``KeyboardInterrupt``), so the command line exits
    130 with one line naming the checkpoint to resume from.
    """

    def __init__(self, message: str, *, step: int | None = None, checkpoint: str | None = None) -> None:
        KeyboardInterrupt.__init__(self, message)
        self.step, self.checkpoint = step, None if checkpoint is None else str(checkpoint)

    def __str__(self) -> str:
        return str(self.args[0])


class StopRequest:
    """Whether a stop was asked for (first Ctrl-C)."""

    def __init__(self) -> None:
        self.requested = False


@contextlib.contextmanager
def stop_on_interrupt() -> Iterator[StopRequest]:
    """Defer the first SIGINT to the loop's next step boundary (see the module docstring).

    Outside the main thread, or when someone installed another SIGINT handler, nothing is changed
    (Ctrl-C raises ``KeyboardInterrupt`` as usual).
    """
    stop = StopRequest()
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is not signal.default_int_handler:
        yield stop
        return

    def handler(signum, frame):
        stop.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once
        print("\ninterrupt: stopping after this step and saving a checkpoint (Ctrl-C again to stop now)",
              file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)
