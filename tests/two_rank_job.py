"""One two-rank gloo job on the CPU for the default suite's distributed checks: sharded training
(``tests/training/fsdp_train_workers.py``), context-parallel training (``tests/training/cp_train_workers.py``) and
the context-parallel ops (``tests/ops/cp_workers.py``) run one after the other in the same two processes, each in
a process group of its own, and write their records to folders of their own.

Starting a rank costs more than most of its checks (importing torch, transformers and the model), so the three test
files share one job: the session fixture :func:`two_rank_job` (``tests/conftest.py``) starts it once per test run,
also under pytest-xdist, where the first worker that asks runs it and the others read its records.
"""

from __future__ import annotations

import fcntl
import json
import shutil
from pathlib import Path

# the parts, in the order each rank runs them; each writes <root>/<part>/rank{r}.json
PARTS = ("fsdp", "cp_train", "cp_ops")


def corpus(root: Path) -> tuple[str, str]:
    """The word corpus the sharded run folders train on and its tokenizer cache (both under ``root``)."""
    from .experiments.corpus import write_word_corpus

    text = write_word_corpus(root / "text", {"train": 20, "validation": 4, "test": 4}, sentences=10,
                             repeat_phrase=True)
    return str(text), str(root / "cache")


def ops_cases() -> tuple[list, list, list]:
    """The context-parallel ops cases: float64 grid, its G = 2 cases in float32, the lengths whose bytes sent are
    compared."""
    from .ops.test_cp import grid

    cases64 = grid(40, 2)
    return cases64, [c for c in cases64 if c["G"] == 2], [4096, 16384]


def job(rank: int, world: int, root: str, text: str, cache: str) -> None:
    """One rank: every part in turn (a failure on any rank ends the job: ``mp.spawn`` stops the other)."""
    from .ops import cp_workers
    from .training import cp_train_workers, fsdp_train_workers

    base = Path(root)
    for part in PARTS:
        (base / part).mkdir(exist_ok=True)
    out = str(base / "fsdp")
    fsdp_train_workers.job(rank, world, str(base / "init-fsdp"), out, "two_ranks", text, cache, out)
    cp_train_workers.default_suite(rank, world, str(base / "init-cp_train"), str(base / "cp_train"))
    cp_workers.run_all(rank, world, str(base / "init-cp_ops"), str(base / "cp_ops"), *ops_cases())


def run_once(shared: Path) -> Path:
    """The job's folder under ``shared`` (a folder every xdist worker of this run sees): started here unless a
    worker already ran it; a worker that asks while another runs it waits for it."""
    import torch.multiprocessing as mp

    root = shared / "two_rank_job"
    done = root / "done.json"
    with open(shared / "two_rank_job.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not done.exists():
                shutil.rmtree(root, ignore_errors=True)  # what a failed start left (its error is the first report)
                root.mkdir()
                text, cache = corpus(root)
                mp.spawn(job, args=(2, str(root), text, cache), nprocs=2, join=True)
                done.write_text(json.dumps({"text": text, "cache": cache}))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return root


def records(root: Path, part: str) -> list:
    """Every rank's record of ``part``."""
    return [json.loads((root / part / f"rank{r}.json").read_text()) for r in range(2)]
