"""Crash-safe, verified checkpoints: a folder of step directories and a ``latest`` pointer.

Layout of a checkpoint folder (``root``)::

    latest                   the name of the newest complete checkpoint (one line)
    step-00000100/           one checkpoint: the caller's files, then manifest.json
        manifest.json        {"format", "step", "files": {name: {"sha256", "bytes"}}, "sha256"}
    step-00000100.1/         a second save of the same step (e.g. a finished run saved again)

:meth:`CheckpointStore.save` keeps, at every instant, either the previous complete checkpoint or
the new complete one reachable from ``latest``:

1. the caller writes its files into a fresh temporary directory ``.tmp-<random>``;
2. each file is ``fsync``-ed and hashed; ``manifest.json`` (every file's SHA-256 and size, and the
   SHA-256 of its own ``files`` entry) is written last and ``fsync``-ed, then the directory;
3. the directory is renamed to a name no checkpoint has (``step-N``, else ``step-N.1``, ...), and
   the folder is ``fsync``-ed;
4. ``latest`` is replaced atomically (:func:`~bayeslayer.files.atomic_write_text`);
5. only then are older checkpoints beyond ``keep`` deleted.

A kill before 4 leaves ``latest`` naming the previous checkpoint; a kill after it leaves the new one
named and at most an extra old directory.  Nothing is ever deleted or renamed over before the new
checkpoint is named.

:meth:`CheckpointStore.load` verifies the manifest and every file's SHA-256 before the caller reads
anything; a damaged checkpoint is reported with the file it is about and, when an older one
verifies, the run falls back to it (a ``RuntimeWarning`` says so) and the damaged directory is
renamed ``damaged-<name>`` so it is never loaded or mistaken for the newest again.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

from ..checks import check_int
from ..files import (
    MANIFEST,
    TMP_PREFIX,
    CheckpointError,
    atomic_write_text,
    fsync_dir,
    remove_stale_temporaries,
    verify_checkpoint,
    write_manifest,
)

POINTER = "latest"
_NAME = re.compile(r"^step-(\d{8,})(?:\.(\d+))?$")


def _order(name: str) -> tuple[int, int] | None:
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


class CheckpointStore:
    """The checkpoints of one run in ``root`` (see the module docstring).

    ``keep``: how many complete checkpoints to keep (the newest; at least 1).  A store is meant to
    be used by one process at a time — take :class:`~bayeslayer.training.lock.OutputLock` on the run
    folder first.
    """

    def __init__(self, root: str | os.PathLike, *, keep: int = 2) -> None:
        keep = check_int("keep", keep, minimum=1)
        self.root = Path(root)
        self.keep = keep

    # ------------------------------------------------------------------ listing

    def checkpoints(self) -> list[Path]:
        """Checkpoint directories by (step, revision), oldest first (complete or not)."""
        if not self.root.is_dir():
            return []
        found = [(order, p) for p in self.root.iterdir() if p.is_dir() and (order := _order(p.name)) is not None]
        return [p for _, p in sorted(found)]

    def pointed(self) -> Path | None:
        """The directory ``latest`` names, or ``None`` (no pointer, or one naming no checkpoint)."""
        pointer = self.root / POINTER
        try:
            name = pointer.read_text(encoding="utf-8").strip()
        except (FileNotFoundError, UnicodeDecodeError):
            return None
        if _order(name) is None or not (self.root / name).is_dir():
            return None
        return self.root / name

    def exists(self) -> bool:
        """Whether any checkpoint (or pointer) is here."""
        return (self.root / POINTER).exists() or bool(self.checkpoints())

    # ------------------------------------------------------------------ loading

    def recover(self) -> None:
        """Remove temporary directories a killed save left (call with the folder's lock held)."""
        remove_stale_temporaries(self.root)

    def load(self) -> Path | None:
        """The newest checkpoint that verifies, or ``None`` when there is none at all.

        Tries the one ``latest`` names first, then the others newest first.  A damaged one is renamed
        ``damaged-<name>`` and a ``RuntimeWarning`` names the file and the checkpoint used instead;
        when every checkpoint is damaged, :class:`CheckpointError` is raised with each one's reason.
        """
        pointed = self.pointed()
        candidates = list(reversed(self.checkpoints()))
        if pointed is not None:
            candidates.remove(pointed)
            candidates.insert(0, pointed)
        elif (self.root / POINTER).exists() and candidates:
            warnings.warn(f"{self.root / POINTER} is damaged or names no checkpoint; using the newest checkpoint "
                          "that verifies", RuntimeWarning, stacklevel=2)
        problems: list[str] = []
        for path in candidates:
            try:
                verify_checkpoint(path)
            except CheckpointError as exc:
                problems.append(str(exc))
                continue
            if problems:
                self._set_aside([Path(p) for p in candidates[: candidates.index(path)]])
                warnings.warn(f"{'; '.join(problems)} — falling back to the older checkpoint {path} "
                              f"(the damaged one is kept as damaged-<name>)", RuntimeWarning, stacklevel=2)
                atomic_write_text(self.root / POINTER, path.name + "\n")
            return path
        if problems:
            raise CheckpointError("; ".join(problems) + " — no complete checkpoint is left; remove "
                                  f"{self.root} to start over")
        if (self.root / POINTER).exists():
            raise CheckpointError(f"{self.root / POINTER} exists but {self.root} holds no checkpoint; remove "
                                  f"{self.root} to start over")
        return None

    def discard(self) -> None:
        """Remove every checkpoint and the pointer (the pointer first: a kill midway leaves no pointer
        to a removed directory)."""
        (self.root / POINTER).unlink(missing_ok=True)
        for path in self.checkpoints():
            shutil.rmtree(path, ignore_errors=True)

    def _set_aside(self, damaged: list[Path]) -> None:
        for path in damaged:
            target = path.with_name(f"damaged-{path.name}")
            if target.exists():
                shutil.rmtree(target, ignore_errors=True)
            os.replace(path, target)
        fsync_dir(self.root)

    # ------------------------------------------------------------------ saving

    def begin(self) -> Path:
        """A fresh temporary directory for a checkpoint that several processes write (each its shards),
        before one of them finishes it with ``save(step, write, started=directory)``."""
        self.root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=self.root, prefix=TMP_PREFIX))

    def save(self, step: int, write: Callable[[Path], object], *, started: Path | None = None) -> Path:
        """Save checkpoint ``step``: ``write(directory)`` writes the files; returns the final directory.

        ``started``: a directory from :meth:`begin` that already holds files (other processes' shards): it
        is finished (``write``, manifest, rename) instead of a new one; it is removed if the save fails."""
        step = check_int("step", step, minimum=0)
        if started is not None and (Path(started).parent != self.root or not Path(started).name.startswith(TMP_PREFIX)
                                    or not Path(started).is_dir()):
            raise ValueError(f"started must be a directory from this store's begin(), got {started}")
        tmp = self.begin() if started is None else Path(started)
        try:
            write(tmp)
            for path in sorted(tmp.iterdir()):
                if path.name == MANIFEST or not path.is_file() or path.is_symlink():
                    raise ValueError(f"a checkpoint holds plain files other than {MANIFEST}; got {path.name}")
            write_manifest(tmp, step=step)  # last: its presence means complete
            name, rev = f"step-{step:08d}", 0
            while (self.root / name).exists() or (self.root / f"damaged-{name}").exists():
                rev += 1
                name = f"step-{step:08d}.{rev}"
            final = self.root / name
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(self.root)
        atomic_write_text(self.root / POINTER, name + "\n")
        # older ones beyond `keep`, and any newer leftover (a checkpoint saved after the one a run resumed
        # from but never named in `latest`): only now that the new one is named
        older = [p for p in self.checkpoints() if p != final and _order(p.name) < _order(name)]
        kept = older[max(0, len(older) - (self.keep - 1)):] if self.keep > 1 else []
        doomed = [p for p in self.checkpoints() if p != final and p not in kept]
        for old in doomed:
            shutil.rmtree(old, ignore_errors=True)
        return final
