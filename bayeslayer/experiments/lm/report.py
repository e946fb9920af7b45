"""``lm eval``'s record: runs grouped by model label, PPL per token group (mean ± std over seeds), the paper's
Table 2 layout as markdown and a bar plot, both drawn from the JSON alone."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from ...files import atomic_write_text
from ..common.harness import results_record, summarize
from ..common.options import check_file_name
from ..common.plotting import save_figure
from ..common.provenance import write_record
from ..common.tables import check_records, markdown_row, mean_std, separator

# Table-2 columns, then the distance buckets, in the order of :meth:`ARHitAnnotation.masks`.
GROUPS = ("all", "ar_hit", "other", "ar_hit_1_64", "ar_hit_65_256", "ar_hit_257_1024")
GROUP_LABELS = {"all": "all", "ar_hit": "AR-hit", "other": "other", "ar_hit_1_64": "AR-hit 1–64",
                "ar_hit_65_256": "AR-hit 65–256", "ar_hit_257_1024": "AR-hit 257–1,024"}
# the paper's Table 2, docs/theory.md §8.5 (mean ± std over 3 seeds, WikiText-103 test, 32k BPE).
PAPER_TABLE2 = {
    "BL": {"all": (20.01, 0.15), "ar_hit": (18.15, 1.08), "other": (20.03, 0.15)},
    "GDN": {"all": (18.75, 0.07), "ar_hit": (23.72, 1.76), "other": (18.69, 0.08)},
    "Mamba-2": {"all": (21.36, 0.27), "ar_hit": (424.8, 120.4), "other": (20.58, 0.19)},
}


def summarize_runs(records: Sequence[dict]) -> dict:
    """Group per-run records by model label; mean ± std (ddof 1) of PPL per group over seeds.

    Returns the results layout of :func:`bayeslayer.experiments.common.harness.results_record` with
    ``models[label] = {"seeds": [records], "summary": {group: {"mean", "std", "values"}}}``.
    """
    if not records:
        raise ValueError("summarize_runs needs at least one run record")
    splits = {(r["split"], r["seq_len"]) for r in records}
    if len(splits) != 1:
        raise ValueError(f"runs were evaluated on different splits/lengths {sorted(splits)}; evaluate them alike")
    split, seq_len = splits.pop()
    models: dict[str, dict] = {}
    for rec in records:
        models.setdefault(rec["label"], {"seeds": [], "summary": {}})["seeds"].append(rec)
    for label, entry in models.items():
        seeds = [r["seed"] for r in entry["seeds"]]
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"model {label!r} has repeated seeds {seeds}: pass each run once (or set --label)")
        entry["summary"] = {g: summarize([r["groups"][g]["ppl"] for r in entry["seeds"]])
                            for g in GROUPS if all(r["groups"].get(g, {}).get("n_tokens", 0) for r in entry["seeds"])}
    presets = sorted({r.get("preset", "?") for r in records})
    return results_record("lm", ",".join(presets), {"split": split, "seq_len": seq_len}, models,
                          groups=list(GROUPS), paper_table2=PAPER_TABLE2)


def _cell(stats: dict | None) -> str:
    if not stats:
        return "–"
    n = len(stats["values"])
    return f"{stats['mean']:.2f} ± {stats['std']:.2f}" if n > 1 else f"{stats['mean']:.2f}"


def markdown_table(record: dict) -> str:
    """Table 2's layout (model | all | AR-hit | other), then AR-hit PPL per distance bucket and token counts."""
    models = record.get("models")
    if not isinstance(models, dict) or not models:
        raise ValueError("record has no models; pass the JSON written by `bayeslayer lm eval`")
    cfg = record.get("config", {})
    n_seeds = {label: len(m["seeds"]) for label, m in models.items()}
    lines = [f"PPL on packed windows of length {cfg.get('seq_len')} of the {cfg.get('split')} split "
             f"(mean ± std over seeds; seeds per model: "
             + ", ".join(f"{k} {v}" for k, v in n_seeds.items()) + ").", "",
             "| model | all | AR-hit | other |", "|---|---|---|---|"]
    for label, m in models.items():
        lines.append(f"| {label} | " + " | ".join(_cell(m["summary"].get(g)) for g in GROUPS[:3]) + " |")
    lines += ["", "| model | " + " | ".join(GROUP_LABELS[g] for g in GROUPS[3:]) + " |", "|---|---|---|---|"]
    for label, m in models.items():
        lines.append(f"| {label} | " + " | ".join(_cell(m["summary"].get(g)) for g in GROUPS[3:]) + " |")
    first = next(iter(models.values()))["seeds"][0]["groups"]
    lines += ["", "Tokens per group: " + ", ".join(
        f"{GROUP_LABELS[g]} {first[g]['n_tokens']:,}" for g in GROUPS if g in first) + "."]
    return "\n".join(lines) + "\n"


def table(records: dict | Sequence[dict], *, ours: str = "ours, ", paper: Sequence[str] = ()) -> str:
    """The docs' layout of ``lm eval``'s record(s): each model's PPL per group (:data:`GROUPS`, mean ± std over
    seeds, two decimals), labelled ``LABEL (<ours>N seeds)``, then the paper's Table 2 rows named in ``paper``
    (all, AR-hit, other; the distance buckets empty).

    Several records (evaluations of the same split written by separate commands) give one table, their models
    in the order of the records; the paper's rows come from the first."""
    records = check_records(records)
    if not isinstance(ours, str):
        raise TypeError(f"ours must be a string (the label's prefix), got {type(ours).__name__}")
    missing = [label for label in paper if label not in records[0].get("paper_table2", {})]
    if missing:
        raise ValueError(f"paper: the record's paper_table2 has no {missing}; it has "
                         f"{sorted(records[0].get('paper_table2', {}))}")
    lines = [markdown_row(["model", *(GROUP_LABELS[g] for g in GROUPS)]), separator(len(GROUPS) + 1)]
    for label, m in [item for r in records for item in r["models"].items()]:
        cells = [mean_std(m["summary"][g]["mean"], m["summary"][g]["std"], 2) for g in GROUPS]
        lines.append(markdown_row([f"{label} ({ours}{len(m['seeds'])} seeds)", *cells]))
    for label in paper:
        p = records[0]["paper_table2"][label]
        cells = [f"{p[g][0]} ± {p[g][1]}" for g in GROUPS[:3]] + [""] * (len(GROUPS) - 3)
        lines.append(markdown_row([f"{label} (paper, 3 seeds)", *cells]))
    return "\n".join(lines)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def bar_plot(record: dict, path: str | os.PathLike) -> Path:
    """Grouped bars of PPL per group (log scale), one bar per model, error bars = std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = record["models"]
    groups = [g for g in GROUPS if any(g in m["summary"] for m in models.values())]
    width = 0.8 / max(1, len(models))
    drawn = False
    fig, ax = plt.subplots(figsize=(7.5, 4.0))
    try:
        for i, (label, m) in enumerate(models.items()):
            xs = [j + (i - (len(models) - 1) / 2) * width for j in range(len(groups))]
            means = [m["summary"][g]["mean"] if g in m["summary"] else float("nan") for g in groups]
            stds = [m["summary"][g]["std"] if g in m["summary"] else 0.0 for g in groups]
            # a diverged model's inf PPL has no bar (the table and the JSON say inf): marked "inf" instead
            finite = [v if _finite(v) else float("nan") for v in means]
            ax.bar(xs, finite, width, yerr=[s if _finite(s) else 0.0 for s in stds], capsize=3,
                   label=f"{label} ({len(m['seeds'])} seed(s))")
            drawn = drawn or any(_finite(v) for v in means)
            for x, v in zip(xs, means, strict=True):
                if v == math.inf:
                    ax.annotate("inf", (x, 0.98), xycoords=("data", "axes fraction"), ha="center", va="top",
                                fontsize=7)
        ax.set_xticks(range(len(groups)), [GROUP_LABELS[g] for g in groups], rotation=15, fontsize=8)
        if drawn:  # a log axis needs one positive bar
            ax.set_yscale("log")
        ax.set_ylabel("perplexity (log scale)" if drawn else "perplexity")
        cfg = record.get("config", {})
        ax.set_title(f"{cfg.get('split')} split, windows of {cfg.get('seq_len')} tokens", fontsize=10)
        ax.grid(axis="y", alpha=0.3, which="both")
        ax.legend(fontsize=8)
        return save_figure(fig, path)
    finally:
        plt.close(fig)


def write_report(record: dict, out_dir: str | os.PathLike, name: str = "lm") -> dict[str, Path]:
    """Write ``<name>.json`` (unless it is the source), ``<name>.md`` and ``<name>.png`` from ``record``."""
    out_dir = Path(out_dir)
    check_file_name(name, option="name")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{name}.json", "table": out_dir / f"{name}.md", "plot": out_dir / f"{name}.png"}
    seeds = sorted({r["seed"] for m in record["models"].values() for r in m["seeds"]})
    groups = {(r.get("provenance") or {}).get("optimizer_groups") for m in record["models"].values()
              for r in m["seeds"]}
    devices = {str(d) for m in record["models"].values() for r in m["seeds"]
               if (d := (r.get("provenance") or {}).get("device"))} or {"cpu"}
    write_record(paths["json"], record, device=",".join(sorted(devices)),
                 seeds=seeds, optimizer_groups=groups.pop() if len(groups) == 1 else None)
    atomic_write_text(paths["table"], markdown_table(record))
    bar_plot(record, paths["plot"])
    return paths


__all__ = ["GROUPS", "GROUP_LABELS", "PAPER_TABLE2", "bar_plot", "markdown_table", "summarize_runs", "table",
           "write_report"]
