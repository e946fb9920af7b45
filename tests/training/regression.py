"""Tiny runs of every experiment that trains, reduced to their numbers: the regression fixture.

:func:`tiny_numbers` trains a tiny MQAR (two mixers), recall, crowding, LM (one micro-batch per step,
and two accumulated micro-batches per step) and distillation (Phase A, Phase B, GDN-FT) run, each
single-threaded, and returns every number they produce except wall-clock times: per-step losses,
evaluations, accuracies and the SHA-256 of the final LM weights.  ``regression_numbers.json`` holds
what they gave before the two training loops (``experiments/harness.py`` and ``experiments/lm.py``)
became one (``bayeslayer/training/loop.py``); ``test_regression.py`` demands the same numbers now.

The bits depend on the machine as well as on the code: PyTorch's own vectorised kernels dispatch on
the CPU's instruction set (:func:`torch.backends.cpu.get_cpu_capability`), MKL's matrix products on
its own choice of instruction set (and on the CPU's vendor), oneDNN's convolutions on theirs.  So the
fixture holds one record per machine, each keyed by :func:`machine` (all of those, with the torch
version); the first is the reference recorded before the loops merged.

Add this machine's record (refused when its numbers are not within the test's tolerance of the
records already there, i.e. when the code, not the machine, moved them)::

    OMP_NUM_THREADS=1 python -m tests.training.regression --add

Start the fixture again from this machine only when a change is *meant* to move the numbers (say which
and why in the commit; the other machines' records are dropped, and each machine adds its own again)::

    OMP_NUM_THREADS=1 python -m tests.training.regression --reset
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from .faults import single_thread, tiny_lm

FIXTURE = Path(__file__).with_name("regression_numbers.json")
#: Keys whose values are wall-clock measurements or machine facts, not results of the computation.
TIMING_KEYS = frozenset({"train_seconds", "seconds", "wall_seconds", "tokens_per_second", "tokens_per_s", "time",
                         "finished_utc", "device", "run_dir", "teacher_dir", "tokenizer"})


def numbers(obj: Any) -> Any:
    """``obj`` without the :data:`TIMING_KEYS` (recursively), as JSON would give it back."""
    if isinstance(obj, dict):
        return {str(k): numbers(v) for k, v in obj.items() if k not in TIMING_KEYS}
    if isinstance(obj, (list, tuple)):
        return [numbers(v) for v in obj]
    return json.loads(json.dumps(obj)) if not isinstance(obj, (str, int, float, bool, type(None))) else obj


def _seed_records(record: dict) -> dict:
    """``{model: per-seed records}`` of a harness experiment's results record (MQAR: per width)."""
    out = {}
    for name, res in record["models"].items():
        out[name] = [run["seeds"] for run in res["runs"]] if "runs" in res else res["seeds"]
    return out


def mqar_numbers() -> dict:
    from bayeslayer.experiments.mqar import PRESETS, MQARConfig, run

    record = run(MQARConfig(task="update", preset=PRESETS["tiny"], mixers=["bayesian", "gated_deltanet_noconv"],
                            progress=False),
                 log=lambda *_: None)
    return numbers(_seed_records(record))


def recall_numbers() -> dict:
    from bayeslayer.experiments import recall

    record = recall.run(recall.RecallConfig(preset=recall.PRESETS["tiny"], models=["delta", "linear_attention"],
                                            progress=False))
    return numbers(_seed_records(record))


def crowding_numbers() -> dict:
    from bayeslayer.experiments import crowding

    record = crowding.run(crowding.CrowdingConfig(preset=crowding.PRESETS["tiny"], models=["delta", "gla"],
                                                  progress=False))
    return numbers(_seed_records(record))


def _lm_run(result) -> dict:
    return numbers({"step": result.step, "losses": result.losses, "evals": result.evals,
                    "final_train_loss": result.summary["final_train_loss"],
                    "weights_sha256": result.summary["weights_sha256"]})


def lm_numbers(root: Path) -> dict:
    from bayeslayer.experiments.common.lm_run import train_lm

    config, cache = tiny_lm(root, steps=6, eval_every=3)
    one = train_lm(config, root / "one_micro_batch", device="cpu", cache_dir=cache, progress=False)
    accumulated = replace(config, batch_size=4, micro_batch_size=2)  # two micro-batches per step
    two = train_lm(accumulated, root / "two_micro_batches", device="cpu", cache_dir=cache, progress=False)
    return {"one_micro_batch": _lm_run(one), "two_micro_batches": _lm_run(two)}


def distill_numbers(root: Path) -> dict:
    from bayeslayer.experiments.common.lm_run import train_lm
    from bayeslayer.experiments.distill import PRESETS, run_distill

    config, cache = tiny_lm(root, mixer="gated_deltanet", num_layers=2, steps=4, mlp_dropout=0.0)
    teacher = train_lm(config, root / "teacher", device="cpu", cache_dir=cache, progress=False)
    dcfg = replace(PRESETS["tiny"], teacher=str(teacher.run_dir / "final"), source=config.source, seq_len=16,
                   phase_a_steps=2, phase_b_steps=2, checkpoint_every=0)
    report = run_distill(dcfg, root / "distill", device="cpu", cache_dir=cache, progress=False)
    stages = {}
    for stage, summary in report["stages"].items():
        log = [json.loads(line) for line in (root / "distill" / stage / "log.jsonl").read_text().splitlines()]
        stages[stage] = numbers({"losses": [r["loss"] for r in log if r["event"] == "train"],
                                 "parts": [r.get("parts") for r in log if r["event"] == "train"],
                                 "final_train_loss": summary["final_train_loss"],
                                 "weights_sha256": summary["weights_sha256"]})
    return stages


RUNS = ("mqar", "recall", "crowding", "lm", "distill")


def tiny_numbers(which=RUNS) -> dict:
    """The numbers of the tiny runs named in ``which`` (single-threaded, CPU)."""
    out = {}
    with single_thread(), tempfile.TemporaryDirectory() as tmp:
        for name in which:
            torch.manual_seed(0)
            if name in ("lm", "distill"):
                out[name] = globals()[f"{name}_numbers"](Path(tmp) / name)
            else:
                out[name] = globals()[f"{name}_numbers"]()
    return out


#: The comparison used where the fixture holds no record of this machine: ``|got - recorded| <= ABS_TOL +
#: REL_TOL * |recorded|`` for every float, equality for everything else but the weights' SHA-256.  See
#: test_regression.py for the spread between instruction sets it was chosen from, and what it catches.
REL_TOL = 1e-5
ABS_TOL = 2e-7

_PROBE = """
import torch
a = torch.ones(8, 8)
with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
    torch.mm(a, a)
with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
    torch.nn.functional.conv1d(torch.ones(1, 8, 16), torch.ones(8, 1, 4), groups=8)
print("aten_capability:" + torch.backends.cpu.get_cpu_capability(), flush=True)
"""


def _cpuinfo(field: str) -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return None


@lru_cache(maxsize=1)
def machine() -> dict:
    """What decides the bits of the tiny runs besides the code: the torch version, the CPU (vendor and
    model), PyTorch's CPU capability, and the instruction sets MKL and oneDNN chose (each library says
    which on its first call only, so a fresh interpreter, with this process's environment, asks them)."""
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, check=True)
    mkl = re.search(r"^MKL_VERBOSE .*? architecture (.*?), \w+ [\d.]+GHz", out.stdout, re.M)
    onednn = re.search(r"^onednn_verbose,.*,cpu,isa:(.*)$", out.stdout, re.M)
    capability = re.search(r"^aten_capability:(.*)$", out.stdout, re.M)
    return {"torch": torch.__version__, "cpu_vendor": _cpuinfo("vendor_id"), "cpu_model": _cpuinfo("model name"),
            "aten_capability": capability[1] if capability else None, "mkl_isa": mkl[1] if mkl else None,
            "onednn_isa": onednn[1] if onednn else None}


def differences(got, recorded, path: str = "") -> list[str]:
    """Where ``got`` and ``recorded`` differ by more than the tolerance (floats: :data:`REL_TOL`,
    :data:`ABS_TOL`; ``weights_sha256`` not compared; everything else equal), one line each."""
    if isinstance(recorded, dict) and isinstance(got, dict):
        if set(got) != set(recorded):
            return [f"{path}: keys {sorted(set(got) ^ set(recorded))} differ"]
        return [line for k in recorded if k != "weights_sha256"
                for line in differences(got[k], recorded[k], f"{path}/{k}")]
    if isinstance(recorded, list) and isinstance(got, list):
        if len(got) != len(recorded):
            return [f"{path}: {len(got)} items, recorded {len(recorded)}"]
        return [line for i, (g, r) in enumerate(zip(got, recorded)) for line in differences(g, r, f"{path}[{i}]")]
    if isinstance(recorded, float) and isinstance(got, float):
        ok = math.isclose(got, recorded, rel_tol=REL_TOL, abs_tol=ABS_TOL)
        return [] if ok else [f"{path}: {got!r}, recorded {recorded!r}"]
    return [] if got == recorded else [f"{path}: {got!r}, recorded {recorded!r}"]


def _main(argv: list[str]) -> int:
    if argv not in (["--add"], ["--reset"]):
        print("usage: python -m tests.training.regression --add | --reset", file=sys.stderr)
        return 2
    fixture = json.loads(FIXTURE.read_text()) if argv == ["--add"] else {"records": []}
    key = machine()
    runs = tiny_numbers()
    for record in fixture["records"]:
        if record["machine"].get("torch") == key["torch"]:
            bad = differences(json.loads(json.dumps(runs)), record["runs"])
            if bad:
                print(f"not added: {len(bad)} number(s) differ from the record of {record['machine']} by more than "
                      f"the tolerance (first: {bad[0]}); if the change is meant, use --reset", file=sys.stderr)
                return 1
    fixture["records"] = [r for r in fixture["records"] if r["machine"] != key] + [{"machine": key, "runs": runs}]
    FIXTURE.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {FIXTURE} ({len(fixture['records'])} machine(s))")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
