"""Where a result came from: the one writer of every results record.

Every experiment writes its numbers with :func:`write_record`, which adds a ``"provenance"`` object
(:func:`provenance`) and writes the JSON atomically.  The object holds

* ``git_commit``, ``git_dirty``: the commit of the checkout the ``bayeslayer`` package was imported
  from and whether tracked files differ from it (``null`` for both when the package is not in a git
  checkout, e.g. installed from a wheel);
* ``command``: the full command line (``sys.argv``; a program or a path argument inside the checkout is named
  relative to it, so a record names no folder of the machine that wrote it);
* ``versions``: Python, bayeslayer, torch, triton, fla (``flash-linear-attention``) and
  transformers (``null`` for a package that is not installed);
* ``device`` (what the run used, e.g. ``"cpu"``, ``"cuda:0"``), ``cpu_model``, ``gpu`` (the GPU's
  name when the device is a GPU) and ``threads`` (torch's intra-op threads);
* ``seeds``, ``wall_seconds`` and ``optimizer_groups`` (the AdamW grouping rule,
  :data:`bayeslayer.training.optim.DECAY_POLICY`, or ``null`` for a result that trains nothing);
* ``backfilled``: ``false``.  Records committed before provenance was recorded carry the same keys
  with ``backfilled: true``, the commits that added and last changed the file, ``backfill_notes``, and
  ``null`` for everything that was not recorded at the time.
* ``record_notes`` (only when there is something to say): why ``git_commit`` is ``null``, that the
  checkout was dirty, or what was changed in the record after it was written.

The commit and the dirty flag are read from the files of the ``.git`` directory (:func:`git_commit`,
:func:`git_dirty`): no git command, hook or configured filter runs.  Anything that cannot be read gives
``null``: a record is never refused for want of provenance.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import struct
import sys
import zlib
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from ...files import atomic_write_text

#: Every key of a record's ``"provenance"`` object.
FIELDS = ("git_commit", "git_dirty", "command", "versions", "device", "cpu_model", "gpu", "threads", "seeds",
          "wall_seconds", "optimizer_groups", "backfilled")
#: The packages whose versions a record holds (keys of ``"versions"``), with their distribution names.
PACKAGES = {"bayeslayer": "bayeslayer", "torch": "torch", "triton": "triton", "fla": "flash-linear-attention",
            "transformers": "transformers"}

# The folder holding the bayeslayer package: one level up per dotted part of this module's name, so that
# moving this module inside the package cannot silently point it at a folder without a checkout.
_PACKAGE_ROOT = Path(__file__).resolve().parents[len(__name__.split(".")) - 1]


def jsonable(obj: Any) -> Any:
    """``obj`` with numpy scalars and tensors made plain numbers and lists, tuples lists, keys strings."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "tolist") and callable(obj.tolist):  # numpy scalars and arrays, torch tensors
        return obj.tolist()
    return obj


def _git_dir(root: Path) -> Path | None:
    """The git directory of the checkout ``root`` (a ``.git`` folder, or a worktree's ``gitdir:`` file)."""
    dot = root / ".git"
    if dot.is_dir():
        return dot
    if dot.is_file():
        text = dot.read_text(encoding="utf-8", errors="replace").strip()
        if text.startswith("gitdir:"):
            path = Path(text[len("gitdir:"):].strip())
            return path if path.is_absolute() else (root / path).resolve()
    return None


def _resolve_ref(git_dir: Path, ref: str) -> str | None:
    common = git_dir
    commondir = git_dir / "commondir"
    if commondir.is_file():  # a linked worktree keeps its branches in the main repository
        common = (git_dir / commondir.read_text().strip()).resolve()
    for base in (git_dir, common):
        path = base / ref
        if path.is_file():
            return path.read_text().strip()
    packed = common / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == ref:
                return parts[0]
    return None


def git_commit(root: str | os.PathLike | None = None) -> str | None:
    """The commit checked out in the git checkout ``root`` (default: the one holding this package), or None.

    Reads ``HEAD`` and the refs as files; runs nothing.
    """
    try:
        git_dir = _git_dir(Path(root) if root is not None else _PACKAGE_ROOT)
        if git_dir is None:
            return None
        head = (git_dir / "HEAD").read_text().strip()
        sha = _resolve_ref(git_dir, head[len("ref:"):].strip()) if head.startswith("ref:") else head
    except OSError:
        return None
    if sha is None or len(sha) != 40 or any(c not in "0123456789abcdef" for c in sha):
        return None
    return sha


def _head_tree(git_dir: Path, commit: str) -> str | None:
    """The tree of ``commit`` read from its object file (loose, or undeltified in a pack); None otherwise."""
    common = git_dir
    if (git_dir / "commondir").is_file():
        common = (git_dir / (git_dir / "commondir").read_text().strip()).resolve()
    objects = common / "objects"
    loose = objects / commit[:2] / commit[2:]
    if loose.is_file():
        data = zlib.decompress(loose.read_bytes())
        body = data[data.index(b"\0") + 1:]
    else:
        body = _packed_commit(objects / "pack", bytes.fromhex(commit))
        if body is None:
            return None
    first = body.split(b"\n", 1)[0].split()
    return first[1].decode() if len(first) == 2 and first[0] == b"tree" else None


def _packed_commit(pack_dir: Path, sha: bytes) -> bytes | None:
    for idx in sorted(pack_dir.glob("*.idx")) if pack_dir.is_dir() else []:
        data = idx.read_bytes()
        if data[:4] != b"\xfftOc" or struct.unpack(">I", data[4:8])[0] != 2:
            continue
        fanout = struct.unpack(">256I", data[8:8 + 1024])
        n = fanout[255]
        lo, hi = (fanout[sha[0] - 1] if sha[0] else 0), fanout[sha[0]]
        names = 8 + 1024
        while lo < hi:  # binary search of the sorted object names
            mid = (lo + hi) // 2
            name = data[names + 20 * mid:names + 20 * mid + 20]
            if name < sha:
                lo = mid + 1
            elif name > sha:
                hi = mid
            else:
                offsets = names + 20 * n + 4 * n
                offset = struct.unpack(">I", data[offsets + 4 * mid:offsets + 4 * mid + 4])[0]
                if offset & 0x80000000:  # a pack over 2 GiB: not read here
                    return None
                with open(idx.with_suffix(".pack"), "rb") as fh:
                    fh.seek(offset)
                    head = fh.read(32)
                    kind = (head[0] >> 4) & 7
                    i = 1
                    while head[i - 1] & 0x80:
                        i += 1
                    if kind != 1:  # a deltified commit: not read here
                        return None
                    fh.seek(offset + i)
                    return zlib.decompressobj().decompress(fh.read(1 << 16))
    return None


def _index_entries(index: bytes) -> tuple[list[tuple[str, int, int, int, int, bytes, int]], str | None] | None:
    """``([(path, mode, size, mtime_s, mtime_ns, sha1, flags)], root tree of the cache tree or None)``;
    None for an index this reader does not know (version 4, or damaged)."""
    if index[:4] != b"DIRC":
        return None
    version, count = struct.unpack(">II", index[4:12])
    if version not in (2, 3):
        return None
    entries, pos = [], 12
    for _ in range(count):
        (_cs, _cn, ms, mns, _dev, _ino, mode, _uid, _gid, size) = struct.unpack(">10I", index[pos:pos + 40])
        sha = index[pos + 40:pos + 60]
        flags = struct.unpack(">H", index[pos + 60:pos + 62])[0]
        start = pos + 62
        if version == 3 and flags & 0x4000:  # extended flags (skip-worktree, intent-to-add)
            flags |= struct.unpack(">H", index[start:start + 2])[0] << 16
            start += 2
        end = index.index(b"\0", start)
        entries.append((index[start:end].decode("utf-8", "surrogateescape"), mode, size, ms, mns, sha, flags))
        pos += ((start - pos) + (end - start) + 8) // 8 * 8  # 1 to 8 NULs pad an entry to a multiple of 8
    root = None
    while pos + 8 <= len(index) - 20:
        sig, size = index[pos:pos + 4], struct.unpack(">I", index[pos + 4:pos + 8])[0]
        if sig == b"TREE":
            data = index[pos + 8:pos + 8 + size]
            nul = data.index(b"\0")
            count_text = data[nul + 1:data.index(b"\n", nul)].split()[0]
            if data[:nul] == b"" and int(count_text) >= 0:
                root = data[data.index(b"\n", nul) + 1:][:20].hex()
        pos += 8 + size
    return entries, root


def git_dirty(root: str | os.PathLike | None = None) -> bool | None:
    """Whether the tracked files of the checkout ``root`` (default: the one holding this package) differ
    from its commit; None when that cannot be told.

    Reads git's files and runs nothing: a file differs from the index when its bytes hash to another blob
    (files whose size and modification time match the index are taken as unchanged, as git does), and
    the index differs from the commit when its cached root tree is another tree than the commit's.  An
    index whose cached tree is invalid (changes staged since the last commit or checkout), a version-4
    index or a commit stored as a delta gives None.
    """
    root = Path(root) if root is not None else _PACKAGE_ROOT
    commit = git_commit(root)
    git_dir = _git_dir(root)
    if commit is None or git_dir is None:
        return None
    try:
        parsed = _index_entries((git_dir / "index").read_bytes())
        if parsed is None:
            return None
        entries, cached_root = parsed
        for path, mode, size, mtime_s, mtime_ns, sha, flags in entries:
            if flags & 0x3000 or flags & (0x4000 << 16) or mode >> 12 == 0o16:  # merge stages, skip-worktree, gitlinks
                continue
            file = os.path.join(root, path)
            st = os.lstat(file) if os.path.lexists(file) else None  # 2 system calls a file, not pathlib's 3 + 1
            if mode >> 12 == 0o12:  # a symbolic link: the blob is its target
                if st is None or st.st_mode >> 12 != 0o12:
                    return True
                data = os.readlink(file).encode("utf-8", "surrogateescape")
            else:
                if st is None or st.st_mode >> 12 != 0o10:  # gone, or a link, a folder ... where a file was
                    return True
                if st.st_size == size and int(st.st_mtime) == mtime_s and st.st_mtime_ns % 10**9 == mtime_ns:
                    continue
                data = Path(file).read_bytes()
            if hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).digest() != sha:
                return True
        if cached_root is None:
            return None
        tree = _head_tree(git_dir, commit)
        return None if tree is None else tree != cached_root
    except (OSError, ValueError, IndexError, struct.error, zlib.error):
        return None


@functools.cache
def package_versions() -> dict[str, str | None]:
    """``{"python": ..., "bayeslayer": ..., "torch": ..., "triton": ..., "fla": ..., "transformers": ...}``.

    Read once per process (one dict, shared) from the installed distributions' metadata; None if not installed.
    """
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for key, dist in PACKAGES.items():
        try:
            versions[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[key] = None
    return versions


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else :func:`platform.processor`), or None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


def _gpu_name(device: str) -> str | None:
    if not device.startswith("cuda"):
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        index = int(device.split(":", 1)[1]) if ":" in device else torch.cuda.current_device()
        return torch.cuda.get_device_name(index)
    except (RuntimeError, ValueError, AssertionError):
        return None


def process_seconds() -> float | None:
    """Seconds since this process started (Linux ``/proc``), or None where that cannot be read."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _command(argv: Sequence[str]) -> list[str]:
    """The command line, its program named relative to the checkout when it lies inside it
    (``python -m bayeslayer.cli`` gives ``bayeslayer/cli.py``, not the folder the checkout happens to be in)."""
    argv = [str(a) for a in argv]
    for i, arg in enumerate(argv):  # the program, and any path argument (``--out /x/y`` or ``--out=/x/y``)
        option, eq, value = arg.partition("=") if i and arg.startswith("-") else ("", "", arg)
        if Path(value).is_absolute():
            try:
                argv[i] = option + eq + Path(value).resolve().relative_to(_PACKAGE_ROOT).as_posix()
            except (ValueError, OSError):
                pass  # a path outside the checkout keeps its path (the committed records are checked for it)
    return argv


def _notes(commit: str | None, dirty: bool | None) -> list[str]:
    """The ``record_notes`` a record written now needs: why it has no commit, or that its checkout was dirty."""
    if commit is None:
        return ["git_commit is null: the bayeslayer package that wrote this record was not imported from a git "
                "checkout whose .git could be read (an installed package, or a copy of the files)"]
    if dirty:
        return [f"git_dirty is true: the checkout had uncommitted changes on commit {commit} (git_commit), which "
                "the record does not hold"]
    return []


def provenance(*, device: Any = "cpu", seeds: Sequence[int] | None = None, wall_seconds: float | None = None,
               optimizer_groups: str | None = None, command: Sequence[str] | None = None) -> dict[str, Any]:
    """The provenance of a result made now in this process (keys :data:`FIELDS`; see the module docstring).

    Args:
        device: the device the run used (``"cpu"``, ``"cuda"``, ``"cuda:0"`` or a ``torch.device``).
        seeds: the seeds the record's numbers come from (None: the result has no seed).
        wall_seconds: the wall time of the work behind the record; None: the time since the process started.
        optimizer_groups: the AdamW grouping rule of the training behind the record (None: nothing trained).
        command: the command line; None: ``sys.argv``.
    """
    device = str(device)
    if not device:
        raise ValueError("device must name a device such as 'cpu' or 'cuda:0'")
    if seeds is not None:
        seeds = [int(s) for s in seeds]
    if wall_seconds is not None:
        wall_seconds = float(wall_seconds)
        if not wall_seconds >= 0:
            raise ValueError(f"wall_seconds must be a non-negative number of seconds, got {wall_seconds}")
    if optimizer_groups is not None and not isinstance(optimizer_groups, str):
        raise TypeError(f"optimizer_groups must be a string (the grouping rule) or None, got "
                        f"{type(optimizer_groups).__name__}")
    try:
        import torch

        threads: int | None = torch.get_num_threads()
    except ImportError:
        threads = None
    commit, dirty = git_commit(), git_dirty()
    notes = _notes(commit, dirty)
    return {
        "git_commit": commit,
        "git_dirty": dirty,
        "command": _command(sys.argv if command is None else command),
        "versions": dict(package_versions()),
        "device": device,
        "cpu_model": cpu_model(),
        "gpu": _gpu_name(device),
        "threads": threads,
        "seeds": seeds,
        "wall_seconds": process_seconds() if wall_seconds is None else wall_seconds,
        "optimizer_groups": optimizer_groups,
        "backfilled": False,
        **({"record_notes": notes} if notes else {}),
    }


def write_record(path: str | os.PathLike, record: dict, *, device: Any = "cpu",
                 seeds: Sequence[int] | None = None, wall_seconds: float | None = None,
                 optimizer_groups: str | None = None, allow_nan: bool = True) -> Path:
    """Write the results record ``record`` with its ``"provenance"`` to ``path`` (atomic, parents created).

    ``record`` must be a dict; numpy scalars and tensors become numbers and lists.  A ``"provenance"``
    already in ``record`` is replaced.  ``allow_nan=False`` refuses NaN and infinities.  Returns ``path``.
    """
    if not isinstance(record, dict):
        raise TypeError(f"record must be a dict (a JSON object), got {type(record).__name__}")
    prov = provenance(device=device, seeds=seeds, wall_seconds=wall_seconds, optimizer_groups=optimizer_groups)
    obj = {**{k: v for k, v in record.items() if k != "provenance"}, "provenance": prov}
    text = json.dumps(jsonable(obj), indent=1, allow_nan=allow_nan)
    path = Path(path)
    atomic_write_text(path, text + "\n")
    return path


def missing_fields(record: Any) -> list[str]:
    """The provenance keys a loaded record lacks (all of :data:`FIELDS` when it has no ``"provenance"``)."""
    prov = record.get("provenance") if isinstance(record, dict) else None
    if not isinstance(prov, dict):
        return list(FIELDS)
    return [k for k in FIELDS if k not in prov]


__all__ = ["FIELDS", "PACKAGES", "cpu_model", "git_commit", "git_dirty", "jsonable", "missing_fields",
           "package_versions", "process_seconds", "provenance", "write_record"]
