"""One run per output folder: an advisory ``fcntl`` lock on ``<folder>/.lock``.

The lock is ``flock(LOCK_EX | LOCK_NB)`` on an open file, so the operating system releases it when
the holder exits or is killed — a crashed run never leaves a folder locked.  The holder writes its
pid, host, start time and command line into the file; a second run is refused with
:class:`FolderBusyError` naming them, before it reads or writes anything else in the folder.

The lock file is opened without following links (``O_NOFOLLOW``) and must be a regular file: a
``.lock`` that is a symbolic link (to a file the user can write), a FIFO or a folder is refused with
:class:`~bayeslayer.training.files.UnsafeFileError` naming it, and nothing is truncated.

The lock file itself is never deleted (deleting it would let a third process lock a new file while
the second still holds the old one).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from .files import open_regular

LOCK_NAME = ".lock"


class FolderBusyError(OSError):
    """Another live process holds the output folder's lock.

    An ``OSError`` (the folder is a resource this process cannot have now), so the command line
    reports it as one line with exit code 2 (:mod:`bayeslayer.errors`).
    """


def _holder_description(text: str) -> str:
    try:
        info = json.loads(text)
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(info["started"])))
        return f"pid {info['pid']} on {info['host']}, started {started}: {info['command']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its details yet"


class OutputLock:
    """Exclusive lock of ``folder`` for this process (a context manager; re-entrant per object).

    ``folder`` is created if needed.  :meth:`acquire` raises :class:`FolderBusyError` when another
    process (or another ``OutputLock`` of this process) holds it.
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None
        self._depth = 0

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> OutputLock:
        if self._fd is not None:
            self._depth += 1
            return self
        if self.folder.exists() and not self.folder.is_dir():
            raise NotADirectoryError(f"output folder {self.folder} is a file, not a folder")
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = open_regular(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_description(os.pread(fd, 1 << 16, 0).decode(errors="replace"))
            os.close(fd)
            raise FolderBusyError(f"{self.folder} is in use by another run ({holder}); wait for it to finish, "
                                  "stop it, or use another output folder") from None
        except BaseException:
            os.close(fd)
            raise
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd, self._depth = fd, 1
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        self._depth -= 1
        if self._depth > 0:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # a stale description must not name a process that has gone
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
