"""The default test suite's time at two commits, run back to back on this machine with this environment.

    python benchmarks/suite_time.py --base a564ace --out results/tests/suite_time.json

Each commit is checked out into a temporary worktree of this checkout (``git worktree add --detach``) and its
default suite runs there with the current interpreter (``python -m pytest -q -p no:cacheprovider``: the
suite's own options, two xdist workers, whole files each), one intra-op thread, the worktree first on
``PYTHONPATH``. The record holds, per commit, the wall seconds, the user and system CPU seconds of the
process tree (children included: ``RUSAGE_CHILDREN`` before and after) and pytest's summary line. The CPU
seconds say more than the wall time on a machine other jobs share; the 1-minute load average before and
after each run is kept.
Failing tests do not stop the run: their count is in the summary line (an older commit may fail tests that
depend on the machine that recorded them).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bayeslayer.experiments.common.provenance import provenance  # noqa: E402
from bayeslayer.files import atomic_write_json  # noqa: E402


def _commit(rev: str) -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise ValueError(f"{rev!r} is not a commit of this checkout")
    return out.stdout.strip()


def run_suite(commit: str) -> dict:
    """The default suite of ``commit`` in a temporary worktree: wall and CPU seconds and pytest's summary."""
    with tempfile.TemporaryDirectory(prefix="suite_time_") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), commit], check=True)
        try:
            env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
            load_before = os.getloadavg()[0]
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=tree,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            wall = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_CHILDREN)  # pytest and its workers, all reaped now
            user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
            lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
            return {"commit": commit, "wall_seconds": round(wall, 1), "cpu_user_seconds": round(user, 1),
                    "cpu_system_seconds": round(system, 1), "summary": lines[-1] if lines else "",
                    "returncode": proc.returncode, "load_before": load_before,
                    "load_after": os.getloadavg()[0]}
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the earlier commit")
    parser.add_argument("--head", default="HEAD", help="the later commit (default: HEAD)")
    parser.add_argument("--out", type=Path, help="write the record here (JSON)")
    args = parser.parse_args(argv)
    try:
        base, head = _commit(args.base), _commit(args.head)
    except ValueError as err:
        parser.error(f"--base/--head: {err}")
    start = time.perf_counter()
    rows = []
    for label, commit in (("head", head), ("base", base)):
        row = {"label": label, **run_suite(commit)}
        rows.append(row)
        print(f"{label} {commit[:10]}: {row['wall_seconds']:.1f} s wall, "
              f"{row['cpu_user_seconds'] + row['cpu_system_seconds']:.1f} s CPU, {row['summary']}", flush=True)
    cpu = [r["cpu_user_seconds"] + r["cpu_system_seconds"] for r in rows]
    record = {"measurement": "the default test suite at two commits, back to back, same machine and environment",
              "how": __doc__.split("\n\n")[2].replace("\n", " "),
              "rows": rows, "wall_ratio_head_over_base": round(rows[0]["wall_seconds"] / rows[1]["wall_seconds"], 3),
              "cpu_ratio_head_over_base": round(cpu[0] / cpu[1], 3),
              "provenance": provenance(wall_seconds=time.perf_counter() - start)}
    print(f"head/base: wall {record['wall_ratio_head_over_base']}, CPU {record['cpu_ratio_head_over_base']}")
    if args.out is not None:
        atomic_write_json(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
