"""One writer per output folder: an advisory ``fcntl`` lock on ``<folder>/.lock``.

Every command that writes into a folder takes this lock on that folder before it reads or writes
anything there (:func:`lock_output`): training runs, the experiments and their ``--plot-only``
redraws, the evaluations.  A command given a folder another one is writing into (``recall --out X``
while ``lm train --out X`` runs) is refused with :class:`FolderBusyError`, which names the folder
and the holder (pid, host, start time and command line, written into the file by the holder), and
writes nothing there.  A command that also keeps files in subfolders (the per-seed cache
``<out>/runs``, each checkpoint folder) locks each of those as well, with the same lock.

The lock is ``flock(LOCK_EX | LOCK_NB)`` on an open file, so the operating system releases it when
the holder exits or is killed — a crashed run never leaves a folder locked.  Two locks of one folder
exclude each other even within one process.

The lock file is opened without following links (``O_NOFOLLOW``) and must be a regular file: a
``.lock`` that is a symbolic link (to a file the user can write), a FIFO or a folder is refused with
:class:`~bayeslayer.files.UnsafeFileError` naming it, and nothing is truncated.

The lock file of a folder that holds anything else is never deleted.  A lock made with
``remove_if_unused=True`` (:func:`lock_output`'s default) removes the folder it created
when, at release, it still holds nothing but ``.lock``, so a command refused before it wrote
anything leaves no folder behind.  A process that opened the old ``.lock`` just before it was
removed would lock a file without a name; :meth:`OutputLock.acquire` checks, after locking, that
its file is still the one at ``<folder>/.lock`` and otherwise tries again, so two processes never
both hold one folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from ..files import open_regular

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

    def __init__(self, folder: str | os.PathLike, *, remove_if_unused: bool = False) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.remove_if_unused = remove_if_unused
        self._fd: int | None = None
        self._depth = 0
        self._created: list[Path] = []

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> OutputLock:
        if self._fd is not None:
            self._depth += 1
            return self
        if self.folder.exists() and not self.folder.is_dir():
            raise NotADirectoryError(f"output folder {self.folder} is a file, not a folder")
        for _ in range(100):
            missing = [d for d in (self.folder, *self.folder.parents) if not d.exists()]  # made here, deepest first
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
            if self._still_named(fd):
                break
            os.close(fd)  # the holder removed the unused folder meanwhile: lock the new one
        else:
            raise FolderBusyError(f"could not lock {self.path}: it keeps being replaced")
        self._created = missing
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
            if self.remove_if_unused and self._created:
                self._remove_unused()
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _still_named(self, fd: int) -> bool:
        try:
            named = os.lstat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (named.st_ino, named.st_dev) == (mine.st_ino, mine.st_dev)

    def _remove_unused(self) -> None:
        """Remove ``.lock`` and the folder this lock created, if nothing else was written there (lock held)."""
        try:
            if [p.name for p in self.folder.iterdir()] == [LOCK_NAME]:
                self.path.unlink()
                for folder in self._created:  # the folder, then the parents made for it, while empty
                    folder.rmdir()
        except OSError:  # another file appeared, or the folder is not ours to remove: keep it
            pass

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def lock_output(folder: str | os.PathLike | None, *,
                remove_if_unused: bool = True) -> contextlib.AbstractContextManager:
    """The lock a command takes on the folder it writes into, as a context manager.

    ``OutputLock(folder, remove_if_unused=...)`` in the process that writes: the only one, or rank 0 of a
    ``torchrun`` job (``RANK`` unset or ``0``; the other ranks write nothing).  No lock where nothing is
    written: ``folder=None`` (an experiment run without ``out``) and the other ranks.
    """
    if folder is None or int(os.environ.get("RANK", "0") or 0) != 0:
        return contextlib.nullcontext()
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be a folder path or None, got {type(folder).__name__}")
    return OutputLock(folder, remove_if_unused=remove_if_unused)
