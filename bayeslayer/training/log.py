"""A training run's log: ``log.jsonl``, one JSON object per logged step or evaluation (:class:`JsonLog`)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from ..files import append_text, atomic_write_text


class JsonLog:
    """A run's ``log.jsonl``: one JSON object per line, flushed as written; ``enabled=False`` (every rank but 0)
    writes nothing.  :meth:`truncate_after` cuts it back to the step a resumed run starts from, so no step is
    logged twice."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled

    def truncate_after(self, step: int) -> None:
        """Drop entries logged after ``step`` (a killed run logged past its last checkpoint)."""
        if not self.enabled or not self.path.exists():
            return
        kept, damaged, last = [], 0, -1
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:  # the half-written last line of a killed run, or a truncated/edited file
                damaged += 1
                continue
            if not isinstance(entry, dict):
                damaged += 1
            elif entry.get("step", 0) <= step:
                kept.append(line)
                last = max(last, int(entry.get("step", 0)) if isinstance(entry.get("step", 0), int) else -1)
        if damaged:
            warnings.warn(f"{self.path}: {damaged} damaged line(s) dropped (not JSON objects: a half-written last "
                          "line of a killed run, or a truncated or edited file)", RuntimeWarning, stacklevel=2)
        if step > 0 and last < step:
            warnings.warn(f"{self.path}: the log ends at step {max(last, 0)} but the run resumes from step {step}; "
                          f"the entries of steps {max(last, 0) + 1}..{step} are lost (the file was truncated)",
                          RuntimeWarning, stacklevel=2)
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))

    def write(self, **entry) -> None:
        if self.enabled:
            with append_text(self.path) as fh:  # never through a link planted in the run folder
                fh.write(json.dumps(entry, allow_nan=True) + "\n")


__all__ = ["JsonLog"]
