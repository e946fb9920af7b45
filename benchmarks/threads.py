"""Each small-tensor command at its thread default against PyTorch's default, idle and beside a busy process.

    python benchmarks/threads.py                                   # every workload, both conditions, 1 repeat
    python benchmarks/threads.py --workloads collision demo --repeats 3 --competitors 2

For every workload (a ``bayeslayer`` command line) and every condition (``idle``: nothing started by this
script; ``contended``: ``--competitors`` CPU-bound processes that this script starts before the timed run
and stops after it; each also stops by itself after ``--competitor-limit`` seconds), the command runs as
a fresh process twice: at its default (``--threads`` left out: one thread for these workloads) and with
``--threads 0`` (PyTorch's default, one thread per core).  Wall-clock seconds are the median over
``--repeats`` (the language model first runs once untimed, to build its token cache).  ``--out FILE``
also writes every run's time, the medians and the load averages as a JSON results record (with its
provenance: commit, command, versions, CPU model).  The table also
prints the 1-minute load average when each cell started: "idle" means only that this script added no
load, so read the load column beside the times.  ``ratio`` is the PyTorch-default
time over the default time.  Nothing is asserted.  The table in docs/reliability.md is this script's output.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

# name -> the command's arguments after `bayeslayer`; "{out}" is a fresh temporary folder per run.
WORKLOADS = {
    "collision": ["collision", "--out", "{out}", "--no-progress"],
    "demo": ["demo"],
    "recall tiny": ["recall", "--preset", "tiny", "--models", "bayesian", "delta", "--out", "{out}", "--no-progress"],
    "lm train tiny": ["lm", "train", "--preset", "tiny", "--steps", "10", "--out", "{out}/run", "--no-progress",
                      "--cache-dir", "{cache}"],
}
NEEDS_WARMUP = {"lm train tiny"}
SETTINGS = (("default", []), ("PyTorch default", ["--threads", "0"]))
# A CPU-bound loop that ends by itself, so a killed benchmark never leaves it behind for long.
COMPETITOR = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


def run_once(argv: list[str], cache: str) -> float:
    """Wall-clock seconds of ``python -m bayeslayer.cli argv`` in a fresh temporary ``{out}`` folder."""
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as tmp:
        cmd = [sys.executable, "-m", "bayeslayer.cli", *(a.format(out=tmp, cache=cache) for a in argv)]
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return seconds


class Competitors:
    """``with Competitors(n, limit):`` ``n`` CPU-bound processes for the block (each ends after ``limit`` s)."""

    def __init__(self, n: int, limit: float):
        self.n, self.limit, self.procs = n, limit, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", COMPETITOR, str(self.limit)]) for _ in range(self.n)]
        time.sleep(1.0)  # let them reach the CPU before the timed run starts
        return self

    def __exit__(self, *exc):
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--conditions", nargs="+", choices=("idle", "contended"), default=["idle", "contended"])
    parser.add_argument("--repeats", type=int, default=1, help="runs per cell; the median is printed")
    parser.add_argument("--competitors", type=int, default=1, help="CPU-bound processes in the contended condition")
    parser.add_argument("--competitor-limit", type=float, default=1200.0,
                        help="seconds after which a competitor stops by itself")
    parser.add_argument("--out", default=None, help="also write the table as a JSON results record here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.competitors < 1:
        parser.error("--repeats and --competitors must be >= 1")
    import torch

    t_start = time.perf_counter()
    rows = []
    print(f"# {os.cpu_count()} CPUs, torch {torch.__version__}, PyTorch default threads here: "
          f"{torch.get_num_threads()}; {args.repeats} repeat(s), median; contended = {args.competitors} "
          f"CPU-bound process(es)")
    print("| workload | condition | default (s) | PyTorch default (s) | ratio | load at start |")
    print("|---|---|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory(prefix="bench-threads-cache-") as cache:
        for name in args.workloads:
            if name in NEEDS_WARMUP:
                run_once(WORKLOADS[name], cache)  # untimed: builds the token cache once
            for condition in args.conditions:
                loads, runs_by_label = [], {}
                for label, extra in SETTINGS:
                    runs = []
                    for _ in range(args.repeats):
                        if condition == "contended":
                            with Competitors(args.competitors, args.competitor_limit):
                                loads.append(os.getloadavg()[0])
                                runs.append(run_once(WORKLOADS[name] + extra, cache))
                        else:
                            loads.append(os.getloadavg()[0])
                            runs.append(run_once(WORKLOADS[name] + extra, cache))
                        print(f"  {name}, {condition}, {label}: {runs[-1]:.2f} s (load {loads[-1]:.1f})",
                              file=sys.stderr, flush=True)  # each run as it ends: a long table shows progress
                    runs_by_label[label] = runs
                a, b = (statistics.median(runs_by_label[k]) for k in ("default", "PyTorch default"))
                rows.append({"workload": name, "condition": condition, "default_s": a, "pytorch_default_s": b,
                             "ratio": b / a, "load_min": min(loads), "load_max": max(loads),
                             "runs_s": runs_by_label})
                print(f"| {name} | {condition} | {a:.2f} | {b:.2f} | {b / a:.2f} | "
                      f"{min(loads):.1f}–{max(loads):.1f} |", flush=True)
    if args.out:
        from bayeslayer.experiments.common.provenance import write_record

        record = {"benchmark": "threads", "cpus": os.cpu_count(), "pytorch_default_threads": torch.get_num_threads(),
                  "repeats": args.repeats, "competitors": args.competitors, "rows": rows}
        write_record(args.out, record, device="cpu", wall_seconds=time.perf_counter() - t_start)
        print(f"# record: {args.out}")


if __name__ == "__main__":
    main()
