"""Durable, atomic file writes and file digests: the package's one writer.

A reader of ``path`` sees the old file or the new one, never half of one, and after a crash (a kill,
a power cut) the disk holds one of the two:

1. the bytes go to a temporary file in the same directory (``.tmp-<name>-<random>``);
2. the temporary file is flushed and ``fsync``-ed, so its data is on disk before it gets a name;
3. ``os.replace(tmp, path)`` switches the name atomically (POSIX rename);
4. the directory is ``fsync``-ed, so the rename itself survives a power cut.

On an error (or ``KeyboardInterrupt``) the temporary file is removed; a process killed between
1 and 3 leaves it behind, and :func:`remove_stale_temporaries` clears such leftovers — only a
process that holds the folder's lock (:mod:`bayeslayer.training.lock`) may call it, since a
running writer's temporary file looks the same.

Links are never written through.  A file the package creates or rewrites in a folder the user gave
(results, logs, the lock) must be a regular file or not exist yet: a symbolic link, a FIFO or a
device there is refused with :class:`UnsafeFileError` naming it, so a planted link cannot make a run
truncate or overwrite the file it points to.  :func:`open_regular` opens with ``O_NOFOLLOW`` for
the writers that cannot replace the file (appends, the lock).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

TMP_PREFIX = ".tmp-"


class UnsafeFileError(OSError):
    """A path the package would write is a symbolic link or not a regular file (see the module docstring)."""


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _refusal(path: Path, kind: str) -> UnsafeFileError:
    return UnsafeFileError(f"{path} is {kind}; bayeslayer writes only regular files and never through a link "
                           "— remove it or choose another output folder")


def check_writable_file(path: str | os.PathLike) -> Path:
    """``path`` as a file to create or replace: absent, or a regular file (not a link).  Returns it.

    Raises :class:`UnsafeFileError` naming the path otherwise.
    """
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    if not stat.S_ISREG(mode):
        raise _refusal(path, _kind(mode))
    return path


def open_regular(path: str | os.PathLike, flags: int, permissions: int = 0o644) -> int:
    """``os.open(path, flags | O_NOFOLLOW)``, refusing a link or anything but a regular file; returns the fd.

    For writers that keep the file (appends, locks): the check and the open are one system call for
    a link (``O_NOFOLLOW`` fails on it), and the opened file's own type is checked with ``fstat``.
    """
    path = Path(path)
    extra = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags | extra, permissions)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            try:
                kind = _kind(os.lstat(path).st_mode)
            except OSError:
                kind = "not a regular file"
            raise _refusal(path, kind) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _refusal(path, _kind(mode))
        if flags & getattr(os, "O_NONBLOCK", 0) == 0 and hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def append_text(path: str | os.PathLike, *, encoding: str = "utf-8") -> Iterator[IO[str]]:
    """Open ``path`` for appending text (created if absent) with :func:`open_regular`'s checks."""
    fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    with os.fdopen(fd, "a", encoding=encoding) as fh:
        yield fh


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(directory: str | os.PathLike) -> None:
    """``fsync`` a directory, so the names created, renamed or removed in it are on disk."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    """``fsync`` a file written by someone else (e.g. a library's ``save`` into a temporary directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", *, encoding: str | None = None,
                 permissions: int = 0o644) -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path``; on a clean exit make it ``path`` durably and atomically.

    ``mode``: ``"wb"`` or ``"w"`` (text, ``encoding`` default UTF-8).  ``permissions``: the new
    file's mode bits (``mkstemp`` makes 0600; results are for everyone to read).  The steps are
    those of the module docstring; on any exception the temporary file is removed and ``path`` is
    untouched.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"mode must be 'wb' or 'w', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    check_writable_file(path)  # a link is refused, not replaced (os.replace would not write through it)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{TMP_PREFIX}{path.name}-")
    try:
        with os.fdopen(fd, mode, encoding=(encoding or "utf-8") if mode == "w" else None) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, permissions)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` with :func:`atomic_write`."""
    with atomic_write(path, "wb") as fh:
        fh.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` with :func:`atomic_write`."""
    with atomic_write(path, "w") as fh:
        fh.write(text)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 1) -> None:
    """Write ``obj`` as JSON (and a final newline) to ``path`` with :func:`atomic_write`."""
    atomic_write_text(path, json.dumps(obj, indent=indent) + "\n")


def read_json(path: str | os.PathLike, *, what: str = "file") -> Any:
    """Parse a JSON file; a missing, unreadable or damaged file raises ``ValueError`` naming it."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what} {path} is damaged or not JSON ({exc}); delete it or restore it") from exc


def publish_directory(final: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Replace the folder ``final`` by what ``write(tmp)`` writes into a fresh temporary folder.

    The new folder's files and the folder itself are ``fsync``-ed before it gets its name; an old
    ``final`` is moved aside first (POSIX cannot rename over a non-empty folder) and removed only
    after the new one is in place.  A kill leaves the old folder, or neither and ``.tmp-`` folders
    for :func:`remove_stale_temporaries` — a caller must be able to write ``final`` again from its
    own checkpoint (the LM loop's last checkpoint does).
    """
    final = Path(final)
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        mode = os.lstat(final).st_mode
        if not stat.S_ISDIR(mode):
            raise UnsafeFileError(f"{final} is {_kind(mode)}, not a folder bayeslayer wrote; remove it or choose "
                                  "another output folder")
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f"{TMP_PREFIX}{final.name}-"))
    old = None
    try:
        write(tmp)
        for path in tmp.iterdir():
            fsync_file(path)
        fsync_dir(tmp)
        if final.exists():
            old = Path(tempfile.mkdtemp(dir=parent, prefix=f"{TMP_PREFIX}old-{final.name}-"))
            os.replace(final, old / final.name)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Remove the ``.tmp-*`` files and folders a killed writer left in ``directory``; returns them.

    Call only while holding the folder's lock: another process's write in progress looks the same.
    """
    directory = Path(directory)
    removed = []
    if not directory.is_dir():
        return removed
    for stale in directory.glob(f"{TMP_PREFIX}*"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
        removed.append(stale)
    return removed
