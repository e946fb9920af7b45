"""One two-rank gloo job on the CPU for the default suite's distributed checks: sharded training
(``tests/training/fsdp_train_workers.py``), context-parallel training (``tests/training/cp_train_workers.py``), the
context-parallel ops (``tests/ops/cp_workers.py``), ``bayeslayer lm train`` with DDP (the command line's own
``main``, which joins the job through ``torchrun``'s environment) and docs/distributed.md's Hugging Face Trainer
recipes (``tests/training/trainer_recipe_worker.py``) run one after the other in the same two processes, each in a
process group of its own, and write their records to folders of their own.

Starting a rank costs more than most of its checks (an interpreter importing torch, transformers and the model),
so the five test files share one job, and its two ranks are forked from the test process (:func:`start`), each
with the environment ``torchrun --standalone --nproc_per_node 2`` gives its workers (rank 0 holding the store, as
``TORCHELASTIC_USE_AGENT_STORE=False`` says): they inherit what the test process has imported instead of importing
it twice more.  The session fixture :func:`two_rank_job` (``tests/conftest.py``) starts the job once per test run,
also under pytest-xdist, where the first worker that asks runs it and the others read its records.  A failed job
names the part it failed in, with each failing rank's traceback.  ``torchrun`` itself starts the workers of the
slow tests (``tests/training/test_sharded_training.py``, ``test_trainer_recipe.py``, ``test_titan.py``).

``python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.two_rank_job ROOT`` runs the job by hand
(``ROOT`` made by :func:`prepare`).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the parts, in the order each rank runs them; each writes its records under <root>/<part>/ and, when done on a
# rank, <root>/<part>/done-rank{r}.  The Trainer recipes come last: they switch Accelerate to its FSDP path on
# the CPU for the rest of the process (tests/training/accelerate_cpu.py).
PARTS = ("fsdp", "cp_train", "cp_ops", "lm_ddp", "trainer")


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


def prepare(root: Path) -> dict:
    """Write what the parts read (the corpora, the ``lm train`` command line) under ``root``; the job's set-up."""
    from .experiments.test_lm import _write_corpus, ddp_argv

    text, cache = corpus(root)
    lm = root / "lm_ddp"
    setup = {"text": text, "cache": cache, "lm_argv": ddp_argv(lm / "run", _write_corpus(lm / "text"), lm / "cache")}
    (root / "setup.json").write_text(json.dumps(setup))
    return setup


def lm_ddp(out: Path, argv: list[str]) -> None:
    """``bayeslayer lm train`` on this rank, as ``torchrun -m bayeslayer.cli lm train ...`` runs it."""
    from bayeslayer.cli import main

    code = main(argv)
    if code != 0:
        raise RuntimeError(f"bayeslayer {' '.join(argv)} ended with exit code {code}")


def trainer(rank: int, world: int, init_file: str, out: Path) -> None:
    """Both Trainer recipes, run as written with Accelerate on its FSDP path, in ``out`` (their ``runs/``).

    Accelerate joins a process group that is already initialised; this part gives it one of its own (a file
    rendezvous), since ``lm_ddp`` already initialised and destroyed a group through ``torchrun``'s store, and a
    second group on that store can read the first one's stale addresses."""
    import torch.distributed as dist

    from .training import trainer_recipe_worker

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    here = os.getcwd()
    os.chdir(out)
    try:
        trainer_recipe_worker.main(str(out), "fsdp", *trainer_recipe_worker.RECIPES)
    finally:
        os.chdir(here)


def job(root: str) -> None:
    """One rank (its number from ``torchrun``'s environment): every part in turn.  A failure on any rank ends the
    job (the other rank is stopped)."""
    from .ops import cp_workers
    from .training import cp_train_workers, fsdp_train_workers

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    base = Path(root)
    setup = json.loads((base / "setup.json").read_text())
    text, cache = setup["text"], setup["cache"]
    for part in PARTS:
        out = base / part
        out.mkdir(exist_ok=True)
        try:
            if part == "fsdp":
                fsdp_train_workers.job(rank, world, str(base / "init-fsdp"), str(out), "two_ranks", text, cache,
                                       str(out))
            elif part == "cp_train":
                cp_train_workers.default_suite(rank, world, str(base / "init-cp_train"), str(out))
            elif part == "cp_ops":
                cp_workers.run_all(rank, world, str(base / "init-cp_ops"), str(out), *ops_cases())
            elif part == "lm_ddp":
                lm_ddp(out, setup["lm_argv"])
            else:
                trainer(rank, world, str(base / "init-trainer"), out)
        except BaseException:
            (out / f"error-rank{rank}.txt").write_text(traceback.format_exc())
            raise
        (out / f"done-rank{rank}").touch()


def failure(root: Path) -> str:
    """The first part some rank did not finish, and the traceback of each rank that failed in it."""
    part = next((p for p in PARTS if not all((root / p / f"done-rank{r}").exists() for r in range(2))), None)
    if part is None:
        return "after its last part"
    errors = sorted((root / part).glob("error-rank*.txt"))
    return f"in part {part!r}" + "".join(f"\n{e.stem}:\n{e.read_text()}" for e in errors)


#: what ``torchrun --standalone --nproc_per_node 2`` sets for its workers besides the rank and the store's port
#: (``TORCHELASTIC_USE_AGENT_STORE``: False, since rank 0 holds the store here, where no agent does)
TORCHRUN_ENV = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                "ROLE_NAME": "default", "ROLE_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_USE_AGENT_STORE": "False", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(root: Path, timeout: float = 900.0) -> list[int]:
    """Fork the job's two ranks from this process and wait for both: their exit codes.  A rank that fails ends
    the job: the other is killed (as ``torchrun`` stops the workers when one fails), and so are both after
    ``timeout`` seconds."""
    import torch  # noqa: F401  (imported before forking: the ranks inherit it)
    import transformers.modeling_utils  # noqa: F401

    from .training.faults import Forked, single_thread

    port = str(_free_port())

    def rank(r: int):
        def child(say) -> None:  # noqa: ARG001  (Forked's line to the parent: not used)
            os.environ.update(TORCHRUN_ENV, RANK=str(r), LOCAL_RANK=str(r), ROLE_RANK=str(r), MASTER_PORT=port,
                              TORCHELASTIC_RUN_ID=f"two-rank-job-{port}")
            os.chdir(ROOT)
            job(str(root))
        return child

    with single_thread():
        ranks = [Forked(rank(r)) for r in range(2)]
    deadline = time.monotonic() + timeout
    while None in (codes := [f.poll() for f in ranks]):
        if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
            for f in ranks:
                f.kill()
            break
        time.sleep(0.05)
    return [f.wait() for f in ranks]


def run_once(shared: Path) -> Path:
    """The job's folder under ``shared`` (a folder every xdist worker of this run sees): started here unless a
    worker already ran it; a worker that asks while another runs it waits for it."""
    root = shared / "two_rank_job"
    done = root / "done.json"
    with open(shared / "two_rank_job.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not done.exists():
                shutil.rmtree(root, ignore_errors=True)  # what a failed start left (its error is the first report)
                root.mkdir()
                setup = prepare(root)
                codes = start(root)
                if codes != [0, 0]:
                    raise RuntimeError(f"the two-rank job (the ranks' exit codes {codes}) failed {failure(root)}")
                done.write_text(json.dumps({"text": setup["text"], "cache": setup["cache"]}))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return root


def records(root: Path, part: str) -> list:
    """Every rank's record of ``part``."""
    return [json.loads((root / part / f"rank{r}.json").read_text()) for r in range(2)]


if __name__ == "__main__":
    job(*sys.argv[1:])
