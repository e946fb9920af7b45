"""Ctrl-C tests need Python's own SIGINT handler in place.

A process started in the background by a non-interactive shell (`cmd &`, CI runners, nohup) inherits
SIGINT *ignored*, and Python then leaves it ignored; bayeslayer's interrupt guard (rightly) leaves an
ignored or custom handler alone, so a raised SIGINT would test nothing.  Each test here starts with
the default handler and gets the previous one back.
"""

from __future__ import annotations

import signal
import threading

import pytest


@pytest.fixture(autouse=True)
def _python_sigint_handler():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
