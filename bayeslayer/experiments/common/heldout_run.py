"""The held-out run that ``bayeslayer heldout`` and ``bayeslayer distill eval`` share: its configuration
(:class:`HeldoutConfig`), :func:`run` (:func:`bayeslayer.evaluation.heldout.evaluate_heldout`, then the record),
and the record's table (the paper's Table 7 layout) and figure drawn from the JSON alone: ``<name>.json``,
``<name>.md`` and ``<name>.png``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ...errors import UsageError
from ...evaluation.heldout import evaluate_heldout
from ...evaluation.lengths import PAPER_LENGTHS, length_label
from ...files import atomic_write_text
from ...training.lock import lock_output
from .options import check_file_name, check_in_dir, check_out_dir, plot_only_json, redrawing
from .plotting import load_json, save_figure
from .provenance import write_record
from .tables import markdown_row, minus, separator


def check_record(record: dict) -> None:
    """Raise ``ValueError`` unless ``record`` is a held-out record (what ``evaluate_heldout`` returns)."""
    if not isinstance(record, dict) or record.get("experiment") != "heldout" or not record.get("models"):
        seen = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError("record must be the JSON written by evaluate_heldout / `bayeslayer heldout` "
                         f"(experiment 'heldout' with models), got {seen}")


def table7_markdown(record: dict) -> str:
    """Table 7's layout: one row per model, one column per corpus × length, cells ``PPL (+x.x%)``.

    The percentage is the change against the reference model (its own row shows the PPL only);
    "–" marks a skipped cell, "†" a model whose tokenizer differs from the reference's.
    """
    check_record(record)
    cfg = record.get("config", {})
    models = record["models"]
    reference = record.get("reference")
    sources = [s["label"] for s in cfg.get("sources", [])] or list(next(iter(models.values()))["cells"])
    lengths = [str(L) for L in cfg.get("lengths", [])]
    columns = [(s, L) for s in sources for L in lengths]
    rule = cfg.get("windows", "non-overlapping")
    if rule == "sliding":
        rule = f"sliding (stride {cfg.get('stride')})"
    splits = {s["label"]: s.get("split", cfg.get("split")) for s in cfg.get("sources", [])}
    where = (f"the {cfg.get('split')} split" if set(splits.values()) <= {cfg.get("split")}
             else "splits " + ", ".join(f"{k} {v}" for k, v in splits.items()))
    lines = [f"Held-out PPL on {where}, {rule} windows"
             + (f", first {cfg['max_windows']} windows per cell" if cfg.get("max_windows") else "")
             + f"; change vs {reference} in parentheses.", "",
             "| model | " + " | ".join(f"{s} {length_label(L)}" for s, L in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for label, m in models.items():
        cells = []
        for s, L in columns:
            cell = m["cells"].get(s, {}).get(L, {})
            if cell.get("ppl") is None:
                cells.append("–")
            elif cell.get("rel_change_pct") is None:
                cells.append(f"{cell['ppl']:.2f}")
            else:
                cells.append(f"{cell['ppl']:.2f} ({cell['rel_change_pct']:+.1f}%)")
        mark = "" if m.get("same_tokenizer_as_reference", True) else " †"
        lines.append(f"| {label}{mark} | " + " | ".join(cells) + " |")
    ref_cells = models[reference]["cells"] if reference in models else {}
    counts = [f"{s} {length_label(L)}: {c['windows']} windows, {c['n_tokens']:,} tokens"
              for s, L in columns if (c := ref_cells.get(s, {}).get(L, {})).get("ppl") is not None]
    lines.append("")
    if counts:
        lines.append(f"Scored ({reference}): " + "; ".join(counts) + ".")
    skipped = sorted({c["skipped"] for m in models.values() for row in m["cells"].values() for c in row.values()
                      if "skipped" in c})
    if skipped:
        lines.append("Skipped (–): " + "; ".join(skipped) + ".")
    if any(not m.get("same_tokenizer_as_reference", True) for m in models.values()):
        lines.append("† tokenizer differs from the reference's: different windows and tokens, so the PPLs "
                     "are not directly comparable.")
    target = record.get("target") or {}
    if target.get("statement"):
        lines.append(f"Paper target (docs/theory.md §8.6): {target['statement']}.")
    return "\n".join(lines) + "\n"


def plot(record: dict, path: str | os.PathLike) -> Path:
    """PPL vs window length (log-2 x axis), one panel per corpus, one line per model; from the JSON only."""
    check_record(record)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = record.get("config", {})
    models = record["models"]
    sources = [s["label"] for s in cfg.get("sources", [])] or list(next(iter(models.values()))["cells"])
    fig, axes = plt.subplots(1, len(sources), figsize=(4.2 * len(sources), 3.6), squeeze=False)
    try:
        for ax, source in zip(axes[0], sources, strict=True):
            for label, m in models.items():
                row = m["cells"].get(source, {})
                # a diverged model's inf has no point on the axis (the table and the JSON say inf)
                points = sorted((int(L), c["ppl"]) for L, c in row.items()
                                if c.get("ppl") is not None and math.isfinite(c["ppl"]))
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, marker="o", label=label)
            lengths = sorted(int(L) for L in cfg.get("lengths", []))
            ax.set_xscale("log", base=2)
            if lengths:
                ax.set_xticks(lengths, [length_label(L) for L in lengths])
                ax.minorticks_off()
            ax.set_xlabel("window length (tokens)")
            ax.set_ylabel("perplexity")
            split = next((s.get("split") for s in cfg.get("sources", []) if s.get("label") == source), None)
            ax.set_title(f"{source} ({split or cfg.get('split')})", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        return save_figure(fig, path)
    finally:
        plt.close(fig)


def table(record: dict) -> str:
    """The docs' layout of a held-out record's first corpus: one row per model, one column per window length,
    cells ``PPL (+x.x%)`` (the change against the reference model, with the minus sign U+2212)."""
    check_record(record)
    source = record["config"]["sources"][0]["label"]
    lengths = [str(L) for L in record["config"]["lengths"]]
    lines = [markdown_row(["model", *(length_label(int(L)) for L in lengths)]), separator(len(lengths) + 1)]
    for label, m in record["models"].items():
        cells = []
        for L in lengths:
            cell = m["cells"][source][L]
            rel = cell.get("rel_change_pct")
            cells.append(f"{cell['ppl']:.2f}" + ("" if rel is None else minus(f" ({rel:+.1f}%)")))
        lines.append(markdown_row([label, *cells]))
    return "\n".join(lines)


def write_report(record: dict, out_dir: str | os.PathLike, name: str = "heldout") -> dict[str, Path]:
    """Write ``<name>.json``, ``<name>.md`` (Table 7 layout) and ``<name>.png``; the last two from the JSON."""
    check_record(record)
    out_dir = Path(out_dir)
    check_file_name(name, option="name")
    paths = {"json": out_dir / f"{name}.json", "table": out_dir / f"{name}.md", "plot": out_dir / f"{name}.png"}
    write_record(paths["json"], record, device=record["config"].get("device", "cpu"))
    saved = load_json(paths["json"])  # draw from what was written, as a later --plot-only would
    atomic_write_text(paths["table"], table7_markdown(saved))
    plot(saved, paths["plot"])
    return paths



@dataclass(frozen=True)
class HeldoutConfig:
    """One held-out evaluation (``bayeslayer heldout``); each field is the option of the same name.

    models: ``(label, directory)`` pairs (a model directory or an ``lm train`` run directory).
    sources: corpora, ``"SOURCE"`` or ``"LABEL=SOURCE"``; lengths: window lengths.
    max_documents: one cap for every source, or ``{source: cap}``; source_splits: ``{source: split}``.
    out, name: the report is ``<out>/<name>.json``, ``.md`` and ``.png``.
    The rest are :func:`evaluate_heldout`'s arguments of the same name.
    """

    models: tuple[tuple[str, str], ...] = ()
    sources: tuple[str, ...] = ("python-docs",)
    lengths: tuple[int, ...] = PAPER_LENGTHS
    split: str = "test"
    reference: str | None = None
    tokenizer: str | None = None
    windows: str = "non-overlapping"
    stride: int | None = None
    max_windows: int | None = None
    max_documents: int | Mapping[str, int] | None = None
    source_splits: Mapping[str, str] | None = None
    batch_size: int = 4
    device: str = "auto"
    precision: str = "fp32"
    cache_dir: str | None = None
    out: str = "runs/heldout"
    name: str = "heldout"
    progress: bool = True

    def __post_init__(self) -> None:
        models = self.models
        if isinstance(models, (str, bytes)) or not isinstance(models, Sequence):
            raise TypeError(f"models must be a sequence of (label, path) pairs, got {type(models).__name__}")
        for item in models:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ValueError(f"models: each entry must be a (label, path) pair, got {item!r}")
        object.__setattr__(self, "models", tuple((label, str(path)) for label, path in models))
        for name in ("sources", "lengths"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise TypeError(f"{name} must be a sequence, got {type(value).__name__}")
            object.__setattr__(self, name, tuple(value))
        check_file_name(self.name, option="name")


def run(config: HeldoutConfig) -> dict:
    """Evaluate ``config``; write ``<out>/<name>.json``, ``.md`` (Table 7 layout) and ``.png``; return the record.

    Checks the output folder and every model folder before any corpus is resolved or a model loaded; the
    output folder is locked for the call (:func:`~bayeslayer.training.lock.lock_output`, rank 0 of a job).
    """
    if not isinstance(config, HeldoutConfig):
        raise TypeError(f"config must be a HeldoutConfig, got {type(config).__name__}")
    check_out_dir(config.out)
    if not config.models:
        raise UsageError("give at least one --model [LABEL=]DIR")
    for label, path in config.models:  # before the corpora are resolved or a model is loaded
        check_in_dir(path, option=f"--model {label}=", what="model or run folder")
    with lock_output(config.out):  # one writer per output folder
        return _run(config)


def _run(config: HeldoutConfig) -> dict:
    record = evaluate_heldout(
        list(config.models), list(config.sources), list(config.lengths), split=config.split,
        reference=config.reference, tokenizer=config.tokenizer, windows=config.windows, stride=config.stride,
        max_windows=config.max_windows, max_documents=config.max_documents, source_splits=config.source_splits,
        batch_size=config.batch_size, device=config.device, precision=config.precision, cache_dir=config.cache_dir,
        progress=config.progress)
    if int(os.environ.get("RANK", "0")) == 0:
        paths = write_report(record, config.out, config.name)
        print(table7_markdown(record))
        print(f"wrote {paths['json']}, {paths['table']}, {paths['plot']}")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return record


def redraw(out: str | os.PathLike, name: str = "heldout") -> dict:
    """``bayeslayer heldout --plot-only``: redraw ``<out>/<name>.md`` and ``.png`` from ``<out>/<name>.json``
    (``out`` locked)."""
    out_dir = check_out_dir(out)
    check_file_name(name, option="name")
    with lock_output(out_dir):  # a redraw writes into out too: one writer per output folder
        record = plot_only_json(out_dir, name, experiment="heldout")
        with redrawing(out_dir / f"{name}.json"):
            check_record(record)
            atomic_write_text(out_dir / f"{name}.md", table7_markdown(record))
            plot(record, out_dir / f"{name}.png")
            print(table7_markdown(record))
    return record

__all__ = ["HeldoutConfig", "check_record", "plot", "redraw", "run", "table", "table7_markdown", "write_report"]
