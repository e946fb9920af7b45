"""Where a result came from: the one writer of every results record.

Every experiment writes its numbers with :func:`write_record`, which adds a ``"provenance"`` object
(:func:`provenance`) and writes the JSON atomically.  The object holds

* ``git_commit``, ``git_dirty``: the commit of the checkout the ``bayeslayer`` package was imported
  from and whether tracked files differ from it (``null`` for both when the package is not in a git
  checkout, e.g. installed from a wheel);
* ``command``: the full command line (``sys.argv``);
* ``versions``: Python, bayeslayer, torch, triton, fla (``flash-linear-attention``) and
  transformers (``null`` for a package that is not installed);
* ``device`` (what the run used, e.g. ``"cpu"``, ``"cuda:0"``), ``cpu_model``, ``gpu`` (the GPU's
  name when the device is a GPU) and ``threads`` (torch's intra-op threads);
* ``seeds``, ``wall_seconds`` and ``optimizer_groups`` (the AdamW grouping rule,
  :data:`bayeslayer.training.optim.DECAY_POLICY`, or ``null`` for a result that trains nothing);
* ``backfilled``: ``false``.  Records committed before provenance was recorded carry the same keys
  with ``backfilled: true``, the commits that added and last changed the file, and ``null`` for
  everything that was not recorded at the time (``python -m bayeslayer.results backfill``).

The commit is read from the files of the ``.git`` directory; the dirty flag asks ``git status``
with hooks and the file-system monitor switched off, and only in a repository owned by the current
user.  Anything that fails gives ``null``: a record is never refused for want of provenance.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from ..training.files import atomic_write_text
from .harness import _jsonable

#: Every key of a record's ``"provenance"`` object.
FIELDS = ("git_commit", "git_dirty", "command", "versions", "device", "cpu_model", "gpu", "threads", "seeds",
          "wall_seconds", "optimizer_groups", "backfilled")
#: The packages whose versions a record holds (keys of ``"versions"``), with their distribution names.
PACKAGES = {"bayeslayer": "bayeslayer", "torch": "torch", "triton": "triton", "fla": "flash-linear-attention",
            "transformers": "transformers"}

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the bayeslayer package


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


def git_dirty(root: str | os.PathLike | None = None) -> bool | None:
    """Whether tracked files of the checkout ``root`` differ from its commit; None when that cannot be told.

    Runs ``git status --porcelain --untracked-files=no`` with hooks, the file-system monitor and the
    system configuration switched off, and only when the repository belongs to the current user.
    """
    root = Path(root) if root is not None else _PACKAGE_ROOT
    git_dir = _git_dir(root)
    if git_dir is None:
        return None
    try:
        if hasattr(os, "getuid") and git_dir.stat().st_uid != os.getuid():
            return None
        env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_OPTIONAL_LOCKS": "0", "GIT_TERMINAL_PROMPT": "0"}
        out = subprocess.run(
            ["git", "-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null", "-C", str(root), "status",
             "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=30, env=env, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return bool(out.stdout.strip())


def package_versions() -> dict[str, str | None]:
    """``{"python": ..., "bayeslayer": ..., "torch": ..., "triton": ..., "fla": ..., "transformers": ...}``.

    Read from the installed distributions' metadata (nothing is imported); None for one not installed.
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
    return {
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "command": list(sys.argv if command is None else command),
        "versions": package_versions(),
        "device": device,
        "cpu_model": cpu_model(),
        "gpu": _gpu_name(device),
        "threads": threads,
        "seeds": seeds,
        "wall_seconds": process_seconds() if wall_seconds is None else wall_seconds,
        "optimizer_groups": optimizer_groups,
        "backfilled": False,
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
    text = json.dumps(_jsonable(obj), indent=1, allow_nan=allow_nan)
    path = Path(path)
    atomic_write_text(path, text + "\n")
    return path


def missing_fields(record: Any) -> list[str]:
    """The provenance keys a loaded record lacks (all of :data:`FIELDS` when it has no ``"provenance"``)."""
    prov = record.get("provenance") if isinstance(record, dict) else None
    if not isinstance(prov, dict):
        return list(FIELDS)
    return [k for k in FIELDS if k not in prov]


__all__ = ["FIELDS", "PACKAGES", "cpu_model", "git_commit", "git_dirty", "missing_fields", "package_versions",
           "process_seconds", "provenance", "write_record"]
