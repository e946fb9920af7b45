"""Durable, atomic file writes, file digests and the formats every saved folder shares: the package's one writer.

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

Two formats every folder the package saves shares (training checkpoints, model folders):
``manifest.json`` (:func:`write_manifest`, checked by :func:`verify_checkpoint`: the SHA-256 and size
of each file) and safetensors files (:func:`write_safetensors`, :func:`read_safetensors`: tensors
without pickle).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

TMP_PREFIX = ".tmp-"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "bayeslayer-checkpoint-1"


class UnsafeFileError(OSError):
    """A path the package would write is a symbolic link or not a regular file (see the module docstring)."""


class CheckpointError(ValueError):
    """A checkpoint is damaged or incomplete; the message names the file."""


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


def _files_digest(files: dict) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_manifest(directory: str | os.PathLike, names: list[str] | None = None, *, step: int | None = None) -> Path:
    """Write ``directory/manifest.json``: the SHA-256 and size of each file (``names``, default every file).

    Each file is ``fsync``-ed first; the manifest is written last and ``fsync``-ed, so its presence
    means the files it lists are complete.  The one integrity format of the package: training
    checkpoints (:meth:`bayeslayer.training.CheckpointStore.save`, with their ``step``) and the model folders it saves
    (``final/``, ``save_pretrained``) both use it, and :func:`verify_checkpoint` checks it.
    """
    directory = Path(directory)
    if names is None:
        names = sorted(p.name for p in directory.iterdir() if p.name != MANIFEST)
    files = {}
    for name in sorted(names):
        path = directory / name
        if name == MANIFEST or path.is_symlink() or not path.is_file():
            raise ValueError(f"a manifest lists plain files other than {MANIFEST}; got {path}")
        fsync_file(path)
        files[name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    manifest = {"format": MANIFEST_FORMAT, **({} if step is None else {"step": step}), "files": files,
                "sha256": _files_digest(files)}
    target = directory / MANIFEST
    atomic_write_text(target, json.dumps(manifest, indent=1))  # fsync-ed, then the folder
    return target


def verify_checkpoint(directory: str | os.PathLike, *, allow_unlisted: bool = False) -> dict:
    """Check ``directory``'s manifest and every file's SHA-256; return the manifest.

    Raises :class:`CheckpointError` naming the first file that is missing, extra, resized or whose
    bytes changed (the manifest included).  ``allow_unlisted``: files the manifest does not list
    are not an error (a model folder a user added a README or a tokenizer to); the listed ones
    must still match.
    """
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path} is missing: {directory} is not a complete checkpoint of this "
                              "version (a checkpoint written by an older bayeslayer, with a pickle "
                              "trainer_state.pt, is not loaded)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        ok = (manifest.get("format") == MANIFEST_FORMAT and isinstance(files, dict)
              and manifest.get("sha256") == _files_digest(files))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest_path} is damaged ({exc})") from exc
    if not ok:
        raise CheckpointError(f"{manifest_path} is damaged (its own checksum does not match)")
    present = [] if allow_unlisted else sorted(p.name for p in directory.iterdir() if p.name != MANIFEST)
    for name in present:
        if name not in files:
            raise CheckpointError(f"{directory / name} is not listed in {manifest_path} (the checkpoint was altered)")
    for name, entry in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (listed in {manifest_path})")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{path} has {size} bytes, its manifest says {entry['bytes']} (truncated or "
                                  "overwritten)")
        if sha256_file(path) != entry["sha256"]:
            raise CheckpointError(f"{path} fails its SHA-256 check (the file is corrupt)")
    return manifest


def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor] | None = None, *,
                      model: torch.nn.Module | None = None, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (or ``model``'s ``state_dict``, shared tensors once) to the safetensors file ``path``.

    A failed write (a full disk, a missing folder) raises ``OSError`` with its ``errno`` and the path,
    not safetensors' own error type that names neither.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file, save_model

    if (tensors is None) == (model is None):
        raise TypeError("write_safetensors takes tensors or model=, exactly one")
    try:
        if model is not None:
            save_model(model, str(path), metadata=metadata)
        else:
            save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as exc:
        found = re.search(r"os error (\d+)", str(exc))
        code = int(found.group(1)) if found else errno.EIO
        raise OSError(code, f"{os.strerror(code)} (writing a safetensors file)", str(path)) from exc


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path`` on the CPU; a damaged file raises ``ValueError`` naming it."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (or is not a file)")
    try:
        return load_file(str(path), device="cpu")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for a bad header or body
        raise ValueError(f"{path} is damaged or not a safetensors file ({' '.join(str(exc).split())})") from exc
