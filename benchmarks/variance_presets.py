"""How long each preset of ``bayeslayer variance`` takes, and how big it is: the times ``variance --help`` shows.

    python benchmarks/variance_presets.py                                      # every preset, print the table
    python benchmarks/variance_presets.py --out results/variance/presets.json  # and write the record

Every preset runs as a fresh process, ``bayeslayer variance --preset P --threads 1 --out TMP`` (the command's
own thread default), one after another.  Two times of the whole command (start-up and figure included):
its wall-clock seconds, and its CPU seconds (user + system of the process, from ``getrusage``).  With one
thread the CPU seconds are about what the wall clock shows on an idle machine; on a shared one the wall
clock runs longer (the 1-minute load average at the start and the end of each run is printed beside it).
The sizes (seeds, training steps, scored queries per seed) and the accuracy and AUROCs are read from the
record the command wrote, so the table says what the time bought.  Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRESETS = ("tiny", "default", "full")


def run_preset(preset: str) -> dict:
    """Run ``bayeslayer variance --preset preset`` once; its wall seconds, load averages and what it measured."""
    with tempfile.TemporaryDirectory(prefix="bench-variance-") as tmp:
        cmd = [sys.executable, "-m", "bayeslayer.cli", "variance", "--preset", preset, "--threads", "1",
               "--out", tmp]
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        load_start = os.getloadavg()[0]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        seconds = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        load_end = os.getloadavg()[0]
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        record = json.loads((Path(tmp) / "variance.json").read_text())
    tasks = {}
    for name, task in record["models"].items():
        seed0 = task["seeds"][0]
        tasks[name] = {"train_steps": task["train"]["steps"], "queries_per_seed": seed0["queries"],
                       "task_seconds": task["wall_seconds"],
                       **{key: task["summary"][key] for key in ("accuracy", "auroc_variance_last", "auroc_entropy")}}
    return {"preset": preset, "seeds": record["config"]["seeds"], "command_seconds": seconds,
            "command_cpu_seconds": cpu, "experiment_seconds": record["wall_seconds"], "load_start": load_start,
            "load_end": load_end, "tasks": tasks}


def _mean(summary: dict | None) -> str:
    return "n/a" if summary is None else f"{summary['mean']:.3f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", choices=PRESETS, default=list(PRESETS))
    parser.add_argument("--out", default=None, help="also write the rows as a JSON results record here")
    args = parser.parse_args(argv)
    import torch

    t_start = time.perf_counter()
    print(f"# {os.cpu_count()} CPUs, torch {torch.__version__}; `bayeslayer variance --threads 1`, one run each")
    print("| preset | seeds | task | steps | queries/seed | accuracy | AUROC variance | AUROC entropy | task s "
          "| command s | command CPU s | load start–end |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    rows = []
    for preset in args.presets:
        row = run_preset(preset)
        rows.append(row)
        for name, task in row["tasks"].items():
            print(f"| {preset} | {row['seeds']} | {name} | {task['train_steps']} | {task['queries_per_seed']} | "
                  f"{_mean(task['accuracy'])} | {_mean(task['auroc_variance_last'])} | "
                  f"{_mean(task['auroc_entropy'])} | {task['task_seconds']:.0f} | {row['command_seconds']:.0f} | "
                  f"{row['command_cpu_seconds']:.0f} | {row['load_start']:.1f}–{row['load_end']:.1f} |", flush=True)
    if args.out:
        from bayeslayer.experiments.common.provenance import write_record

        record = {"benchmark": "variance_presets", "cpus": os.cpu_count(), "threads": 1, "rows": rows}
        write_record(args.out, record, device="cpu", wall_seconds=time.perf_counter() - t_start)
        print(f"# record: {args.out}")


if __name__ == "__main__":
    main()
