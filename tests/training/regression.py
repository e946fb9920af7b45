"""Tiny runs of every experiment that trains, reduced to their numbers: the regression fixture.

:func:`tiny_numbers` trains a tiny MQAR (two mixers), recall, crowding, LM (one micro-batch per step,
and two accumulated micro-batches per step) and distillation (Phase A, Phase B, GDN-FT) run, each
single-threaded, and returns every number they produce except wall-clock times: per-step losses,
evaluations, accuracies and the SHA-256 of the final LM weights.  ``regression_numbers.json`` holds
what they gave before the two training loops (``experiments/harness.py`` and ``experiments/lm.py``)
became one (``bayeslayer/training/loop.py``); ``test_regression.py`` demands the same numbers now.

Regenerate the fixture only when a change is *meant* to move the numbers (say which and why in the
commit)::

    OMP_NUM_THREADS=1 python -m tests.training.regression tests/training/regression_numbers.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import replace
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


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURE
    result = {"torch": torch.__version__, "runs": tiny_numbers()}
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
