"""RULER needle-in-a-haystack evaluation (docs/theory.md §8.6): decoding, scoring, tables, plots, ``bayeslayer niah``.

The prompts (the eight RULER NIAH tasks, RULER's text, exact length and located depth) come
from :mod:`bayeslayer.data.niah`; its public names are re-exported here.  :func:`run` takes a
:class:`NiahConfig` and returns the results record; ``bayeslayer niah`` maps its arguments onto
one.

Scoring is RULER's ``string_match_all``: a sample scores the fraction of its
expected values found (case-insensitive substring) in the decoded continuation,
reported in percent.  The summary is the average over six tasks,
:data:`SUMMARY_TASKS` (see there for why these six).

Results are data: ``niah.json`` holds every cell's per-sample scores;
``--plot-only`` redraws the length plot, the markdown tables and the
depth × length difference heatmaps from it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..data.niah import (
    DEFAULT_MAX_NEW_TOKENS,
    NEEDLE,
    NOISE_PARAGRAPH,
    SEPARATORS,
    TASKS,
    WORDS,
    NiahGenerator,
    NiahSample,
    NiahTask,
    NiahTokenizer,
    check_task,
    load_essays,
    prompt_template,
    ruler_prompt,
)
from ..errors import UsageError
from ..evaluation.lengths import PAPER_LENGTHS, length_label
from ..files import atomic_write_text, read_json
from ..training.distributed import resolve_device
from ..training.lock import OutputLock
from .common.options import (
    DEVICE_HELP,
    PLOT_ONLY_HELP,
    check_in_dir,
    check_int,
    check_memory,
    check_out_dir,
    check_tokenizer,
    device_arg,
    model_arg,
    plot_only_json,
    positive_int_arg,
    redrawing,
)
from .common.plotting import save_figure
from .common.provenance import write_record
from .common.threads import TORCH_DEFAULT, add_threads_option

DESCRIPTION = (
    "RULER's needle-in-a-haystack tasks: hide key-value needles at each depth of "
    "prompts of each length, decode greedily and score the fraction of needles "
    "recalled, per model, task, length and depth. Writes OUT/niah.json with every "
    "sample's score, markdown tables, a length plot and depth-by-length difference "
    "heatmaps drawn from it (--plot-only redraws them). Prompts and scoring: "
    "python -m pydoc bayeslayer.experiments.niah."
)

#: The six tasks of the summary average.  The paper names niah_single_1, niah_single_2,
#: niah_multivalue and niah_multiquery among its six and excludes CWE; of the other four
#: NIAH variants we keep the two that share the essay haystack (niah_single_3,
#: niah_multikey_1) and drop niah_multikey_2/3, whose haystack is made of needles (a
#: key-value-list lookup rather than a needle in prose; small models score near zero
#: there, which would dilute the average).  ``--summary-tasks`` changes the choice.
SUMMARY_TASKS: tuple[str, ...] = (
    "niah_single_1", "niah_single_2", "niah_single_3",
    "niah_multikey_1", "niah_multivalue", "niah_multiquery",
)
DEFAULT_DEPTHS = tuple(float(d) for d in range(0, 101, 10))
#: Heatmap cells with fewer samples (per task) than this are hatched.
MIN_CELL_SAMPLES = 30


# ----------------------------------------------------------------------------- scoring


def score_prediction(prediction: str, answers: Sequence[str]) -> float:
    """RULER's ``string_match_all`` for one sample: the fraction of ``answers`` that occur in
    ``prediction`` (case-insensitive substring), in [0, 1]."""
    if not isinstance(prediction, str):
        raise TypeError(f"prediction must be a str, got {type(prediction).__name__}")
    if isinstance(answers, str) or not answers or not all(isinstance(a, str) and a for a in answers):
        raise ValueError(f"answers must be a non-empty list of non-empty str, got {answers!r}")
    text = prediction.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def score_predictions(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> float:
    """Mean per-sample score in percent (RULER reports 0..100)."""
    if len(predictions) != len(answers) or not predictions:
        raise ValueError(f"need as many predictions as answer lists (>0), got {len(predictions)} and {len(answers)}")
    return 100.0 * sum(score_prediction(p, a) for p, a in zip(predictions, answers, strict=True)) / len(predictions)


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def generate_answers(model: torch.nn.Module, samples: Sequence[NiahSample], tokenizer: Any,
                     *, batch_size: int = 1) -> list[str]:
    """Greedy continuations (``model.generate(do_sample=False)``, the recurrent cache) of
    ``samples``, decoded up to the first end-of-text token.  Samples of one batch must have
    the same length (a cell's samples do), so no padding is needed."""
    tok = tokenizer if isinstance(tokenizer, NiahTokenizer) else NiahTokenizer(tokenizer)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    eos = tok.eos_id()
    device = next(model.parameters()).device
    out: list[str] = []
    for i in range(0, len(samples), batch_size):
        batch = samples[i:i + batch_size]
        lengths = {len(s.input_ids) for s in batch}
        new_tokens = {s.max_new_tokens for s in batch}
        if len(lengths) != 1 or len(new_tokens) != 1:
            raise ValueError(f"a batch needs samples of one length and max_new_tokens, got {lengths}, {new_tokens}")
        ids = torch.tensor([s.input_ids for s in batch], dtype=torch.long, device=device)
        kwargs = {"eos_token_id": eos, "pad_token_id": eos} if eos is not None else {"pad_token_id": 0}
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens.pop(),
                             do_sample=False, **kwargs)
        for row in gen[:, ids.shape[1]:].tolist():
            if eos is not None and eos in row:
                row = row[: row.index(eos)]
            out.append(tok.decode(row))
    return out


def evaluate(
    model: torch.nn.Module,
    generator: NiahGenerator,
    *,
    tasks: Sequence[str] = tuple(TASKS),
    lengths: Sequence[int] = PAPER_LENGTHS,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    samples_per_cell: int = 30,
    max_new_tokens: int | dict[str, int] = DEFAULT_MAX_NEW_TOKENS,
    batch_size: int = 1,
    progress: Callable[[str], None] | None = None,
    predictions: list[dict] | None = None,
) -> list[dict]:
    """Score ``model`` on every task × length × depth cell.

    Returns one record per cell: ``{"task", "length", "depth", "n", "score", "scores",
    "depth_realized"}`` with ``score`` the mean of the per-sample ``scores`` (percent).
    Each decoded prediction is appended to ``predictions`` when a list is given.
    """
    for t in tasks:
        check_task(t)
    samples_per_cell = check_int("samples_per_cell", samples_per_cell, minimum=1)
    model.eval()
    cells = []
    for task in tasks:
        budget = max_new_tokens[task] if isinstance(max_new_tokens, dict) else max_new_tokens
        for length in lengths:
            for depth in depths:
                samples = [generator.sample(task, length, depth, i, max_new_tokens=budget)
                           for i in range(samples_per_cell)]
                answers = generate_answers(model, samples, generator.tokenizer, batch_size=batch_size)
                scores = [100.0 * score_prediction(p, s.answers) for p, s in zip(answers, samples, strict=True)]
                cells.append({
                    "task": task, "length": int(length), "depth": float(depth), "n": len(scores),
                    "score": sum(scores) / len(scores), "scores": scores,
                    "depth_realized": [round(s.depth_realized, 3) for s in samples],
                })
                if predictions is not None:
                    predictions.extend({"task": task, "length": length, "depth": depth, "index": s.index,
                                        "answers": s.answers, "prediction": p}
                                       for s, p in zip(samples, answers, strict=True))
                if progress is not None:
                    progress(f"{task} length={length} depth={depth:g}: {cells[-1]['score']:.1f}")
    return cells


def summarize(cells: Sequence[dict], summary_tasks: Sequence[str] = SUMMARY_TASKS) -> dict:
    """Per task × length means (over depths and samples, every cell weighted equally) and the
    summary: the mean over ``summary_tasks`` per length (tasks missing from ``cells`` are
    left out of the average and listed under ``"missing"``)."""
    by_task: dict[str, dict[str, list[float]]] = {}
    for c in cells:
        by_task.setdefault(c["task"], {}).setdefault(str(c["length"]), []).append(c["score"])
    task_length = {t: {L: sum(v) / len(v) for L, v in d.items()} for t, d in by_task.items()}
    present = [t for t in summary_tasks if t in task_length]
    lengths = sorted({L for d in task_length.values() for L in d}, key=int)
    summary = {}
    for L in lengths:
        vals = [task_length[t][L] for t in present if L in task_length[t]]
        if vals:
            summary[L] = sum(vals) / len(vals)
    return {"task_length": task_length, "summary": summary, "summary_tasks": present,
            "missing": [t for t in summary_tasks if t not in task_length]}


def depth_length_grid(cells: Sequence[dict], summary_tasks: Sequence[str] = SUMMARY_TASKS) -> dict:
    """``{(depth, length): (mean over summary tasks, fewest samples of any summary task)}``."""
    acc: dict[tuple[float, int], list[tuple[float, int]]] = {}
    for c in cells:
        if c["task"] in summary_tasks:
            acc.setdefault((float(c["depth"]), int(c["length"])), []).append((c["score"], c["n"]))
    return {k: (sum(s for s, _ in v) / len(v), min(n for _, n in v)) for k, v in acc.items()}


# ----------------------------------------------------------------------------- tables and plots


def markdown_summary(results: dict) -> str:
    """Table 6 layout: one row per model, the six-task average per length."""
    models = results["models"]
    lengths = sorted({L for m in models.values() for L in m["summary"]}, key=int)
    lines = ["| model | " + " | ".join(length_label(L) for L in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for label, m in models.items():
        lines.append(f"| {label} | " + " | ".join(
            f"{m['summary'][L]:.2f}" if L in m["summary"] else "–" for L in lengths) + " |")
    return "\n".join(lines)


def markdown_tasks(results: dict) -> str:
    """Per task × length score of every model."""
    models = results["models"]
    lengths = sorted({L for m in models.values() for t in m["task_length"].values() for L in t}, key=int)
    lines = ["| model | task | " + " | ".join(length_label(L) for L in lengths) + " |",
             "|---|---|" + "---|" * len(lengths)]
    for label, m in models.items():
        for task, row in m["task_length"].items():
            lines.append(f"| {label} | {task} | " + " | ".join(
                f"{row[L]:.2f}" if L in row else "–" for L in lengths) + " |")
    return "\n".join(lines)


def heatmap_difference(path: str | os.PathLike, results: dict, model_a: str, model_b: str,
                       *, min_samples: int = MIN_CELL_SAMPLES) -> Path:
    """Depth × length heatmap of ``model_a − model_b`` (six-task average, percentage points).
    Cells where either model has fewer than ``min_samples`` samples per task are hatched
    and labelled ``n<min_samples``."""
    models = results["models"]
    for name in (model_a, model_b):
        if name not in models:
            raise ValueError(f"no model {name!r} in the results; have {sorted(models)}")
    tasks = results["config"]["summary_tasks"]
    grid_a = depth_length_grid(models[model_a]["cells"], tasks)
    grid_b = depth_length_grid(models[model_b]["cells"], tasks)
    keys = sorted(set(grid_a) & set(grid_b))
    if not keys:
        raise ValueError(f"{model_a} and {model_b} share no depth × length cell of the summary tasks")
    depths = sorted({d for d, _ in keys})
    lengths = sorted({L for _, L in keys})

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    diff = np.full((len(depths), len(lengths)), np.nan)
    few = np.zeros_like(diff, dtype=bool)
    for (d, L) in keys:
        i, j = depths.index(d), lengths.index(L)
        diff[i, j] = grid_a[(d, L)][0] - grid_b[(d, L)][0]
        few[i, j] = min(grid_a[(d, L)][1], grid_b[(d, L)][1]) < min_samples
    vmax = max(1.0, float(np.nanmax(np.abs(diff))))
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(lengths), 1.0 + 0.38 * len(depths)))
    try:
        im = ax.imshow(diff, cmap="RdBu", vmin=-vmax, vmax=vmax, aspect="auto", origin="upper")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if np.isnan(diff[i, j]):
                    continue
                text = f"{diff[i, j]:+.1f}" + (f"\nn<{min_samples}" if few[i, j] else "")
                ax.text(j, i, text, ha="center", va="center", fontsize=7)
                if few[i, j]:
                    ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//",
                                               edgecolor="0.4", linewidth=0))
        ax.set_xticks(range(len(lengths)), [length_label(L) for L in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth")
        ax.set_title(f"{model_a} − {model_b} (NIAH six-task avg, points)", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.05)
        return save_figure(fig, path)
    finally:
        plt.close(fig)


def _safe(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label)


def length_bars(path: str | os.PathLike, results: dict) -> Path:
    """Table 6 as a figure: per context length, one bar per model (six-task average, %)."""
    models = results["models"]
    lengths = sorted({L for m in models.values() for L in m["summary"]}, key=int)
    if not lengths:
        raise ValueError("no summary numbers to plot: did any summary task run?")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / len(models)
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(lengths), 3.6))
    try:
        for k, (label, m) in enumerate(models.items()):
            xs = [j + (k - (len(models) - 1) / 2) * width for j, L in enumerate(lengths) if L in m["summary"]]
            ys = [m["summary"][L] for L in lengths if L in m["summary"]]
            bars = ax.bar(xs, ys, width * 0.95, label=label)
            ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=1)
        ax.set_xticks(range(len(lengths)), [length_label(L) for L in lengths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("NIAH six-task average (%)")
        ax.set_ylim(0, 100)
        ax.set_title("RULER NIAH: " + ", ".join(t.removeprefix("niah_") for t in results["config"]["summary_tasks"]),
                     fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
        return save_figure(fig, path)
    finally:
        plt.close(fig)


def draw(results: dict, out_dir: str | os.PathLike, diffs: Sequence[tuple[str, str]] | None = None) -> list[Path]:
    """All figures from a results dict: the per-length bars and one heatmap per pair in ``diffs``
    (default: the first model minus each other model)."""
    out_dir = Path(out_dir)
    models = list(results["models"])
    paths = [length_bars(out_dir / "niah_length.png", results)]
    if diffs is None:
        diffs = [(models[0], other) for other in models[1:]]
    for a, b in diffs:
        paths.append(heatmap_difference(out_dir / f"niah_diff_{_safe(a)}_minus_{_safe(b)}.png", results, a, b))
    return paths


# ----------------------------------------------------------------------------- models and CLI


def _parse_list(kind: type, text: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}: {text!r}") from err


#: ``--dtype``: the dtype models are loaded in.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class NiahConfig:
    """One ``bayeslayer niah`` evaluation; each field is the option of the same name (``--model`` → ``models``).

    models: ``(label, directory)`` pairs (HF format or a flash-linear-attention Gated DeltaNet checkpoint).
    tokenizer: ``tokenizer.json`` or a directory holding one (``None``: each model's directory).
    lengths: context lengths in tokens, prompt + answer budget; depths: needle depths in percent.
    tasks: the tasks run; summary_tasks: those averaged in the summary.
    haystack, haystack_split: the essay source (:func:`bayeslayer.data.niah.load_essays`).
    diff: ``(A, B)`` label pairs drawn as A − B heatmaps (``None``: the first model minus each other).
    out: where ``niah.json``, ``niah.md``, the predictions and the figures go.
    trust_remote_code: let a folder whose ``config.json`` has ``auto_map`` run its own code (off: refused).
    """

    models: tuple[tuple[str, str], ...] = ()
    out: str = "results/niah"
    tokenizer: str | None = None
    lengths: tuple[int, ...] = PAPER_LENGTHS
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    tasks: tuple[str, ...] = tuple(TASKS)
    summary_tasks: tuple[str, ...] = SUMMARY_TASKS
    samples_per_cell: int = 30
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    haystack: str = "python-docs"
    haystack_split: str = "test"
    seed: int = 0
    batch_size: int = 1
    device: str = "auto"
    dtype: str = "float32"
    diff: tuple[tuple[str, str], ...] | None = None
    quiet: bool = False
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        def pairs(name: str, value) -> tuple[tuple[str, str], ...]:
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise TypeError(f"{name} must be a sequence of (str, str) pairs, got {type(value).__name__}")
            out = tuple(tuple(p) if isinstance(p, (tuple, list)) else p for p in value)
            if not all(isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, (str, os.PathLike)) for x in p)
                       for p in out):
                raise TypeError(f"{name} must be a sequence of (str, str) pairs, got {value!r}")
            return tuple((str(a), str(b)) for a, b in out)

        object.__setattr__(self, "models", pairs("models", self.models))
        if self.diff is not None:
            object.__setattr__(self, "diff", pairs("diff", self.diff))
        for name in ("lengths", "depths", "tasks", "summary_tasks"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise TypeError(f"{name} must be a sequence, got {type(value).__name__}")
            object.__setattr__(self, name, tuple(value))
        for name in ("samples_per_cell", "max_new_tokens", "batch_size"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("seed", self.seed, minimum=-(2**63))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")


def check_config(config: NiahConfig) -> None:
    """Every check of a :class:`NiahConfig` that can fail, before any model is loaded.

    A mistake in the second model, its tokenizer or a ``diff`` label would otherwise surface
    only after the first model's evaluation.  Raises :class:`~bayeslayer.errors.UsageError`
    naming the option.
    """
    check_out_dir(config.out)
    if not config.models:
        raise UsageError("give at least one --model [LABEL=]DIR (or --plot-only to redraw from --out)")
    labels = [label for label, _ in config.models]
    if len(set(labels)) != len(labels):
        raise UsageError(f"--model labels must be distinct, got {labels}")
    for t in list(config.tasks) + list(config.summary_tasks):
        if t not in TASKS:
            raise UsageError(f"unknown task {t!r}; known: {', '.join(TASKS)}")
    if not config.tasks:
        raise UsageError("--tasks names no task")
    if not config.depths:
        raise UsageError("--depths names no depth")
    for d in config.depths:
        if not (math.isfinite(d) and 0 <= d <= 100):
            raise UsageError(f"--depths are percentages in [0, 100], got {d:g}")
    if not config.lengths or any(L < 16 for L in config.lengths):
        raise UsageError(f"--lengths must be integers >= 16, got {list(config.lengths)}")
    for a, b in config.diff or []:
        for label in (a, b):
            if label not in labels:
                raise UsageError(f"--diff {a},{b}: {label!r} is not a --model label ({', '.join(labels)})")
    if config.tokenizer:
        check_tokenizer(config.tokenizer)
    for label, path in config.models:
        directory = check_in_dir(path, option=f"--model {label}=", what="model folder")
        if not (directory / "config.json").is_file():
            raise UsageError(f"--model {label}={path}: no config.json in that folder (not a model directory)")
        from ..models.loading import check_remote_code, read_model_config

        check_remote_code(directory, read_model_config(directory), trust_remote_code=config.trust_remote_code)
        if not config.tokenizer:
            check_tokenizer(path, option=f"--model {label}=")
        check_memory(niah_memory(config, directory), device=resolve_device(config.device),
                     what=f"--lengths {max(config.lengths)} (batch {config.batch_size}) with --model {label}")


def niah_memory(config: NiahConfig, model_dir: Path) -> int:
    """A lower bound of the bytes one NIAH prompt of the longest length needs with the model in ``model_dir``:
    its token ids and two hidden states of the model's width (``hidden_size`` of its ``config.json``)."""
    model_config = read_json(model_dir / "config.json", what="model config")
    hidden = model_config.get("hidden_size") if isinstance(model_config, dict) else None
    hidden = hidden if isinstance(hidden, int) and hidden > 0 else 1
    return max(config.lengths) * config.batch_size * (8 + 2 * 4 * hidden)


def run(config: NiahConfig) -> dict:
    """Evaluate every model of ``config``; write ``niah.json``, the predictions, tables and plots to
    ``config.out``; return the results (what ``niah.json`` holds)."""
    if not isinstance(config, NiahConfig):
        raise TypeError(f"config must be a NiahConfig, got {type(config).__name__}")
    from ..models.pretrained import load_model

    out = check_out_dir(config.out)
    check_config(config)
    tasks = list(config.tasks)
    needs_essay = any(TASKS[t].haystack == "essay" for t in tasks)
    essays = load_essays(config.haystack, config.haystack_split) if needs_essay else None
    dtype = DTYPES[config.dtype]
    results: dict = {"config": {
        "tasks": tasks, "lengths": list(config.lengths), "depths": list(config.depths),
        "samples_per_cell": config.samples_per_cell, "max_new_tokens": config.max_new_tokens,
        "seed": config.seed, "summary_tasks": list(config.summary_tasks), "haystack": str(config.haystack),
        "scoring": "RULER string_match_all: per sample, % of expected values contained in the output",
        "length_counts": "prompt tokens + max_new_tokens",
    }, "models": {}}
    for label, path in config.models:
        tokenizer = config.tokenizer or path
        generator = NiahGenerator(tokenizer, essays, seed=config.seed)
        model = load_model(path, device=str(resolve_device(config.device)), dtype=dtype,
                           trust_remote_code=config.trust_remote_code)
        predictions: list[dict] = []
        cells = evaluate(model, generator, tasks=tasks, lengths=list(config.lengths), depths=list(config.depths),
                         samples_per_cell=config.samples_per_cell, max_new_tokens=config.max_new_tokens,
                         batch_size=config.batch_size, predictions=predictions,
                         progress=None if config.quiet else lambda m, _l=label: print(f"[{_l}] {m}", flush=True))
        results["models"][label] = {"path": str(path), "cells": cells, **summarize(cells, config.summary_tasks)}
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / f"predictions_{_safe(label)}.jsonl", "".join(json.dumps(p) + "\n" for p in predictions))
        write_record(out / "niah.json", results, device=resolve_device(config.device), seeds=[config.seed],
                     allow_nan=False)  # after every model: partial results survive
        del model
    _report(results, out, list(config.diff) if config.diff is not None else None)
    return results


def redraw(out: str | os.PathLike, diff: Sequence[tuple[str, str]] | None = None) -> dict:
    """``bayeslayer niah --plot-only``: redraw the tables and plots in ``out`` from ``<out>/niah.json``."""
    out = check_out_dir(out)
    results = plot_only_json(out, "niah")
    with redrawing(out / "niah.json"):
        _report(results, out, None if diff is None else list(diff))
    return results


def _report(results: dict, out: Path, diff: list[tuple[str, str]] | None) -> None:
    tables = "## NIAH six-task average\n\n" + markdown_summary(results) + "\n\n## Per task\n\n" \
        + markdown_tasks(results) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "niah.md", tables)
    print(tables)
    for p in draw(results, out, diff):
        print(f"wrote {p}")


def _parse_pair(text: str) -> tuple[str, str]:
    a, sep, b = text.partition(",")
    if not sep or not a or not b:
        raise argparse.ArgumentTypeError(f"--diff takes A,B (two model labels), got {text!r}")
    return a, b


def add_parser(sub) -> None:
    p = sub.add_parser("niah", help="RULER needle-in-a-haystack evaluation (docs/theory.md §8.6)",
                       description=DESCRIPTION)
    p.add_argument("--model", action="append", type=model_arg, default=[], metavar="[LABEL=]DIR",
                   help="a model directory (HF format or an fla Gated DeltaNet checkpoint); repeat for several")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json or a directory holding one (default: each model's directory)")
    p.add_argument("--lengths", type=lambda s: _parse_list(int, s), default=list(PAPER_LENGTHS),
                   help="context lengths in tokens, prompt + answer budget (default 2048,4096,8192,16384)")
    p.add_argument("--depths", type=lambda s: _parse_list(float, s), default=list(DEFAULT_DEPTHS),
                   help="needle depths in percent (default 0,10,...,100)")
    p.add_argument("--tasks", type=lambda s: _parse_list(str, s), default=list(TASKS),
                   help="comma-separated tasks (default: all eight)")
    p.add_argument("--summary-tasks", type=lambda s: _parse_list(str, s), default=list(SUMMARY_TASKS),
                   help="the tasks averaged in the summary (default: " + ",".join(SUMMARY_TASKS) + ")")
    p.add_argument("--samples-per-cell", type=positive_int_arg, default=30, help="samples per task × length × depth")
    p.add_argument("--max-new-tokens", type=positive_int_arg, default=DEFAULT_MAX_NEW_TOKENS,
                   help="greedy tokens generated per sample (RULER: 128)")
    p.add_argument("--haystack", default="python-docs",
                   help="essay source: 'python-docs', 'hf:<name>[:<config>]' or a text/HTML path")
    p.add_argument("--haystack-split", default="test", help="split of the haystack source to draw essays from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=positive_int_arg, default=1,
                   help="samples decoded together (one cell at a time)")
    p.add_argument("--device", type=device_arg, default="auto", help=DEVICE_HELP)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--diff", action="append", type=_parse_pair, default=None, metavar="A,B",
                   help="draw the heatmap of A − B (default: the first model minus each other)")
    p.add_argument("--out", default="results/niah", help="output directory")
    p.add_argument("--plot-only", action="store_true", help=PLOT_ONLY_HELP)
    p.add_argument("--quiet", action="store_true", help="no per-cell progress lines")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let a model folder whose config.json has auto_map run its own Python code (only for "
                        "folders you checked; off by default, such a folder is refused)")
    add_threads_option(p, TORCH_DEFAULT)
    p.set_defaults(func=_main)


def config_from_args(args: argparse.Namespace) -> NiahConfig:
    """The :class:`NiahConfig` of ``bayeslayer niah``'s parsed arguments (each option is the field of its name)."""
    return NiahConfig(
        models=args.model, out=args.out, tokenizer=args.tokenizer, lengths=args.lengths, depths=args.depths,
        tasks=args.tasks, summary_tasks=args.summary_tasks, samples_per_cell=args.samples_per_cell,
        max_new_tokens=args.max_new_tokens, haystack=args.haystack, haystack_split=args.haystack_split,
        seed=args.seed, batch_size=args.batch_size, device=args.device, dtype=args.dtype, diff=args.diff,
        quiet=args.quiet, trust_remote_code=args.trust_remote_code)


def _main(args: argparse.Namespace) -> dict:
    """``bayeslayer niah``: :func:`run` on the arguments' config, or :func:`redraw` with ``--plot-only``."""
    out = check_out_dir(args.out)
    # one writer per output folder, as for training runs; a refused command leaves no folder behind
    with OutputLock(out, remove_if_unused=True):
        if args.plot_only:
            return redraw(args.out, args.diff)
        return run(config_from_args(args))


__all__ = [
    "DEFAULT_DEPTHS", "DEFAULT_MAX_NEW_TOKENS", "MIN_CELL_SAMPLES", "NEEDLE", "NOISE_PARAGRAPH", "PAPER_LENGTHS",
    "SEPARATORS", "SUMMARY_TASKS", "TASKS", "WORDS", "NiahConfig", "NiahGenerator", "NiahSample", "NiahTask",
    "NiahTokenizer", "check_config", "config_from_args", "depth_length_grid", "draw", "evaluate",
    "generate_answers", "heatmap_difference", "length_bars", "markdown_summary", "markdown_tasks",
    "prompt_template", "redraw", "ruler_prompt", "run", "score_prediction", "score_predictions", "summarize",
]
