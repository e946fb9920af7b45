"""Kill a process at the i-th filesystem step: the fault injector of the crash-safety tests.

:func:`run_killed_at` forks; the child counts every call of the operations that change what is on
disk — ``os.mkdir``, ``os.fsync``, ``os.replace``, ``os.rename``, ``os.unlink``, ``os.remove``,
``os.rmdir``, ``os.ftruncate``, ``os.chmod``, ``shutil.rmtree`` (and with them every file write,
since each write is followed by its ``fsync``) — and calls ``os._exit`` just before the
``crash_at``-th one: no ``finally`` block, no cleanup, no flush, like ``kill -9``.  Forking keeps
each kill cheap (no interpreter start); the parent then resumes in-process from whatever the child
left on disk.  Torch runs single-threaded in both (see :func:`single_thread`), so a fork never
inherits a busy OpenMP pool and the resumed floats are reduced in the same order.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

KILLED = 77
_OPS = [(os, name) for name in ("mkdir", "fsync", "replace", "rename", "unlink", "remove", "rmdir", "ftruncate",
                                "chmod")] + [(shutil, "rmtree")]


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_killed_at(fn: Callable[[], object], crash_at: int | None) -> tuple[int, int]:
    """Run ``fn()`` in a forked child killed before its ``crash_at``-th disk operation (never when
    ``None``); returns ``(exit code, operations counted)`` — exit code :data:`KILLED` when killed, 0
    when ``fn`` finished first, 1 when it raised."""

    def child(say: Callable[[str], None]) -> None:
        count = [0]
        try:
            for module, name in _OPS:
                original = getattr(module, name)

                def counted(*args, _original=original, **kwargs):
                    if crash_at is not None and count[0] == crash_at:
                        os._exit(KILLED)
                    count[0] += 1
                    return _original(*args, **kwargs)

                setattr(module, name, counted)
            fn()
        finally:
            say(str(count[0]))

    proc = Forked(child)
    counted_ops = int(proc.readline() or 0)  # '' when killed: the count is sent only by a child that ends itself
    return proc.wait(), counted_ops


class Forked:
    """``fn(say)`` in a forked child, for tests that need a second process (one that holds a folder's lock, or is
    killed mid-run) but not a fresh interpreter: forking costs no interpreter start and no imports.

    ``say(line)`` sends a line to the parent, which reads it with :meth:`readline`; the child ends with exit code 0
    when ``fn`` returns, 1 when it raises (its traceback on stderr), or as a signal kills it (:meth:`wait` gives
    ``-signal``, as ``subprocess`` does).  Fork under :func:`single_thread` where the child runs torch, so that it
    never inherits a busy OpenMP pool.
    """

    def __init__(self, fn: Callable[[Callable[[str], None]], object]):
        read_fd, write_fd = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.close(read_fd)
                to_parent = os.fdopen(write_fd, "w")

                def say(line: str) -> None:
                    to_parent.write(line + "\n")
                    to_parent.flush()

                fn(say)
                code = 0
            except BaseException:  # noqa: BLE001 - reported to the parent as exit code 1
                import traceback

                traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    sys.stderr.flush()  # the traceback (stdout is not flushed: it may hold the parent's text)
                os._exit(code)
        os.close(write_fd)
        self._lines = os.fdopen(read_fd)
        self.returncode: int | None = None

    def readline(self) -> str:
        """The child's next line ('' once it has ended without one)."""
        return self._lines.readline().strip()

    def kill(self) -> None:
        """SIGKILL the child (if it still runs)."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def poll(self) -> int | None:
        """The child's exit code if it has ended (as :meth:`wait` gives it), else None; does not block."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        """Wait for the child to end; its exit code (``-signal`` when a signal ended it)."""
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        self._lines.close()
        return self.returncode


def hold_until_killed() -> None:
    """Block a :class:`Forked` child until the parent kills it."""
    while True:
        signal.pause()


def tiny_lm(root: Path, **overrides):
    """A one-layer Bayesian LM run on a seeded written corpus under ``root``: ``(LMConfig, cache_dir)``.

    The LM reliability and fault tests share it; ``overrides`` set their steps and evaluation.
    """
    from bayeslayer.training.lm_config import LMConfig

    from ..experiments.corpus import write_word_corpus

    source = write_word_corpus(root / "text", {"train": 20, "validation": 4, "test": 4}, sentences=10,
                               repeat_phrase=True)
    settings = dict(preset="test", mixer="bayesian", hidden_size=16, num_layers=1, num_heads=2, head_dim=8,
                    mlp_dropout=0.1, source=str(source), vocab_size=280, seq_len=16, steps=4, batch_size=2,
                    micro_batch_size=2, lr=3e-3, warmup_steps=1, eval_every=0, eval_windows=2, eval_batch_size=4,
                    checkpoint_every=2, log_every=1, seed=0)
    settings.update(overrides)
    return LMConfig(**settings), str(root / "cache")
