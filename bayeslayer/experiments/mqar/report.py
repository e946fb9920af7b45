"""``bayeslayer mqar``'s record: its file stem, each mixer's summary over seeds, and the figure and table drawn
from the JSON alone."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ...errors import UsageError
from ..common.harness import summarize
from ..common.mqar_setup import TASK_NAMES, MQARPreset, mixer_label
from ..common.options import plot_only_json, redrawing
from ..common.plotting import RefLine, Series, line_plot


def results_stem(task: str, preset: MQARPreset) -> str:
    """File stem of a run's JSON and PNG: ``mqar_<task>``, plus ``_<layout>`` and ``_gate-<on|off>`` when
    not the stacked layout / the default gate, so runs of different layouts never overwrite each other."""
    stem = f"mqar_{task}"
    if preset.layout != "stacked":
        stem += f"_{preset.layout}"
    if preset.gate != "default":
        stem += f"_gate-{preset.gate}"
    return stem


def summarize_mixer(task: str, runs: list[dict]) -> dict[str, Any]:
    """Accuracy vs the swept variable (mean ± std over seeds), validation accuracy and train time."""
    xs, acc, val, secs = [], [], [], []
    for run in runs:
        seeds = run["seeds"]
        for i, point in enumerate(seeds[0]["test"]):
            xs.append(point["x"])
            acc.append(summarize([s["test"][i]["accuracy"] for s in seeds]))
        val.append(summarize([s["val_accuracy"] for s in seeds]))
        secs.extend(s["train_seconds"] for s in seeds)
    return {"x": xs, "accuracy": {"mean": [a["mean"] for a in acc], "std": [a["std"] for a in acc]},
            "val_accuracy": {"mean": [v["mean"] for v in val], "std": [v["std"] for v in val]},
            "train_seconds": summarize(secs)}


_XLABELS = {"base": "model width", "update": "number of updates (length {L}, {n} pairs)",
            "block": "number of pairs (length {L}, block size {b})"}


def plot_mqar(record: dict, path: str) -> str:
    """Query accuracy vs the swept variable, one line per mixer (± std over seeds), from the results dict."""
    cfg = record["config"]
    task = cfg["task"]
    series = [Series(res["label"], x=res["summary"]["x"], y=res["summary"]["accuracy"]["mean"],
                     err=res["summary"]["accuracy"]["std"] if cfg["seeds"] > 1 else None,
                     style={"marker": "o", "markersize": 3})
              for res in record["models"].values()]
    if not series:
        raise ValueError("the results hold no finished mixer to plot")
    xlabel = _XLABELS[task].format(L=cfg["update_test_seq_len"] if task == "update" else cfg["block_seq_len"],
                                   n=cfg["update_test_pairs"], b=cfg["block_size"])
    vlines = []
    if task == "update":
        trained = sorted({u for _, _, us in cfg["update_train"] for u in us})
        vlines = [RefLine(max(trained), "max trained")]
    elif task == "block":
        vlines = [RefLine(max(cfg["block_train_pairs"]), "max trained")]
    layout = cfg.get("layout", "stacked")  # results written before layouts existed are stacked
    title = (f"MQAR {task} — preset '{record['preset']}', {layout} layout (gate: {cfg.get('gate', 'default')}; "
             f"V = {cfg['vocab_size']}, state {cfg['budget']}\nfloats/layer, {cfg['epochs']} epochs, "
             f"{cfg['seeds']} seed{'s' * (cfg['seeds'] > 1)})")
    chance = [RefLine(1 / cfg["vocab_size"], f"chance (1/{cfg['vocab_size']})")]
    return str(line_plot(path, series, xlabel=xlabel, ylabel="query accuracy", title=title, vlines=vlines,
                         hlines=chance, xscale="log" if task == "base" else "linear", ylim=(-0.02, 1.02)))


def format_table(record: dict) -> str:
    """Accuracy per mixer at every sweep point, as a Markdown table."""
    models = record["models"]
    if not models:
        return "(no finished mixer)"
    xs = next(iter(models.values()))["summary"]["x"]
    lines = ["| mixer | " + " | ".join(str(x) for x in xs) + " | val acc | lr |",
             "|---" * (len(xs) + 3) + "|"]
    for res in models.values():
        s = res["summary"]
        lrs = ",".join(f"{r['best_lr']:g}" for r in res["runs"])
        lines.append(f"| {res['label']} | " + " | ".join(f"{a:.3f}" for a in s["accuracy"]["mean"])
                     + " | " + "/".join(f"{v:.3f}" for v in s["val_accuracy"]["mean"]) + f" | {lrs} |")
    paper = record.get("paper_reported")
    if paper:
        lines.append(f"\npaper (docs/theory.md §8.4) at {paper['x']}: " + ", ".join(
            f"{mixer_label(m)} ≈ {v:.2f}" for m, v in paper["values"].items()))
    return "\n".join(lines)


def redraw(out_dir: Path, task: str | None) -> int:
    """``mqar --plot-only``: redraw the named task's figures and tables, or every task's found in ``out_dir``
    (``mqar_<task>*.json``, every layout and gate), from the JSON alone."""
    tasks = [task] if task else list(TASK_NAMES)
    stems = sorted(p.stem for t in tasks for p in out_dir.glob(f"mqar_{t}*.json"))  # every layout/gate
    if not stems and task:
        plot_only_json(out_dir, f"mqar_{task}", experiment="mqar")  # raises: names the missing file
    if not stems:
        raise UsageError(f"--plot-only: {out_dir} holds no mqar_<task>*.json; pass the --out folder of an "
                         "earlier run")
    for stem in stems:
        record = plot_only_json(out_dir, stem, experiment="mqar")
        out = os.path.join(out_dir, f"{stem}.png")
        with redrawing(out_dir / f"{stem}.json"):
            plot_mqar(record, out)
            print(format_table(record))
        print(f"\nredrew {out}")
    return 0


__all__ = ["format_table", "plot_mqar", "redraw", "results_stem", "summarize_mixer"]
