"""The NIAH run that ``bayeslayer niah`` and ``bayeslayer distill eval`` share: its configuration, the checks of it,
the evaluation of each model folder (:func:`bayeslayer.evaluation.niah.evaluate`) into ``niah.json`` and the
predictions, and the tables and figures drawn from that JSON alone.

Results are data: ``niah.json`` holds every cell's per-sample scores; :func:`redraw` (``--plot-only``) redraws
the length plot, the markdown tables and the depth × length difference heatmaps from it.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ...data.niah import DEFAULT_MAX_NEW_TOKENS, TASKS, NiahGenerator, load_essays
from ...errors import UsageError
from ...evaluation.lengths import PAPER_LENGTHS, length_label
from ...evaluation.niah import DEFAULT_DEPTHS, SUMMARY_TASKS, depth_length_grid, evaluate, summarize
from ...files import atomic_write_text, read_json
from ...training.distributed import resolve_device
from ...training.lock import lock_output
from .options import (
    check_in_dir,
    check_int,
    check_memory,
    check_out_dir,
    check_tokenizer,
    plot_only_json,
    redrawing,
)
from .plotting import save_figure
from .provenance import write_record

#: Heatmap cells with fewer samples (per task) than this are hatched.
MIN_CELL_SAMPLES = 30
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
    out: str = "runs/niah"
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
        from ...models.loading import check_remote_code, read_model_config

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
    ``config.out`` (locked for the call: :func:`~bayeslayer.training.lock.lock_output`); return the results
    (what ``niah.json`` holds)."""
    if not isinstance(config, NiahConfig):
        raise TypeError(f"config must be a NiahConfig, got {type(config).__name__}")
    out = check_out_dir(config.out)
    check_config(config)
    with lock_output(out):  # one writer per output folder
        return _run(config, out)


def _run(config: NiahConfig, out: Path) -> dict:
    from ...models.pretrained import load_model

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
        atomic_write_text(out / f"predictions_{safe_label(label)}.jsonl",
                          "".join(json.dumps(p) + "\n" for p in predictions))
        write_record(out / "niah.json", results, device=resolve_device(config.device), seeds=[config.seed],
                     allow_nan=False)  # after every model: partial results survive
        del model
    write_tables(results, out, list(config.diff) if config.diff is not None else None)
    return results


def redraw(out: str | os.PathLike, diff: Sequence[tuple[str, str]] | None = None) -> dict:
    """``bayeslayer niah --plot-only``: redraw the tables and plots in ``out`` from ``<out>/niah.json`` (locked)."""
    out = check_out_dir(out)
    with lock_output(out):  # a redraw writes into out too: one writer per output folder
        results = plot_only_json(out, "niah")
        with redrawing(out / "niah.json"):
            write_tables(results, out, None if diff is None else list(diff))
    return results


def write_tables(results: dict, out: Path, diff: list[tuple[str, str]] | None) -> None:
    """``niah.md`` (both tables, also printed) and the figures of :func:`draw`, from ``results`` alone."""
    tables = "## NIAH six-task average\n\n" + markdown_summary(results) + "\n\n## Per task\n\n" \
        + markdown_tasks(results) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "niah.md", tables)
    print(tables)
    for p in draw(results, out, diff):
        print(f"wrote {p}")


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


def safe_label(label: str) -> str:
    """``label`` as part of a file name (anything but letters, digits, ``_.-`` becomes ``_``)."""
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
        name = f"niah_diff_{safe_label(a)}_minus_{safe_label(b)}.png"
        paths.append(heatmap_difference(out_dir / name, results, a, b))
    return paths


__all__ = ["DTYPES", "MIN_CELL_SAMPLES", "NiahConfig", "check_config", "draw", "heatmap_difference", "length_bars",
           "markdown_summary", "markdown_tasks", "niah_memory", "redraw", "run", "safe_label", "write_tables"]
