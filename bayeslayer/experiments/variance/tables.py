"""The docs' tables of ``bayeslayer variance``'s record (``variance.json``: per task, the AUROC of each score for a
wrong answer and the abstention curves) and of its presets' record (``results/variance/presets.json``, written by
``benchmarks/variance_presets.py``: what each preset measured and cost).  Each takes the record as read from its
JSON and returns Markdown; ``tools/build_tables.py`` finds the committed records and splices them into the docs."""

from __future__ import annotations

from ..common.tables import check_record, markdown_row, mean_std, separator

#: the abstention table's coverages, as indices into the deciles of
#: :func:`~bayeslayer.experiments.variance.coverage_curve`: 10%, 30%, 50%, 70%, 100%
ABSTENTION_COVERAGES = (0, 2, 4, 6, 9)


def table(record: dict) -> str:
    """The record's Markdown table: per task, the accuracy and the AUROC for a wrong answer of the variance
    (last layer; mean over layers), the entropy and both combined, mean ± std over seeds ("n/a" where a
    score had no wrong or no right answer to separate)."""
    check_record(record)
    keys = ("accuracy", "auroc_variance_last", "auroc_variance_mean", "auroc_entropy", "auroc_combined")
    lines = [markdown_row(["task", "accuracy", "AUROC variance (last layer)", "variance (mean over layers)",
                           "entropy", "combined"]), "|---|---|---|---|---|---|"]
    for task in record["models"].values():
        s = task["summary"]
        lines.append(markdown_row([task["label"]] + [mean_std(s[k]["mean"], s[k]["std"], 3) if s[k] else "n/a"
                                                     for k in keys]))
    return "\n".join(lines)


def abstention_table(record: dict) -> str:
    """MQAR Update's abstention as a Markdown table: the accuracy of the answered queries at a few coverages
    (:data:`ABSTENTION_COVERAGES`), abstaining on high variance or on high entropy, mean over seeds."""
    if "mqar_update" not in check_record(record).get("models", {}):
        raise ValueError("record: has no MQAR Update task (run with --tasks mqar_update)")
    s = record["models"]["mqar_update"]["summary"]
    at = ABSTENTION_COVERAGES
    cov = s["coverage_variance_last"]["coverage"]
    lines = [markdown_row(["MQAR Update, coverage"] + [f"{cov[i]:.0%}" for i in at]), separator(len(at) + 1)]
    for score, label in (("variance_last", "abstain on high variance"), ("entropy", "abstain on high entropy")):
        lines.append(markdown_row([label] + [f"{s[f'coverage_{score}']['mean'][i]:.3f}" for i in at]))
    return "\n".join(lines)


def presets_table(record: dict) -> str:
    """Per preset and task of the presets' record: the size, what the run measured (mean over seeds) and the whole
    command's CPU and wall time (one thread) with the 1-minute load average beside it."""
    rows = check_record(record)["rows"]
    lines = [markdown_row(["preset", "task", "seeds", "training steps", "queries per seed", "accuracy",
                           "AUROC variance", "AUROC entropy", "command CPU s", "command wall s (load)"]),
             separator(10)]
    for row in rows:
        for name, task in row["tasks"].items():
            cells = [f"{task[k]['mean']:.3f}" if task[k] else "n/a"
                     for k in ("accuracy", "auroc_variance_last", "auroc_entropy")]
            lines.append(markdown_row([
                f"`{row['preset']}`", name, str(row["seeds"]), f"{task['train_steps']:,}",
                f"{task['queries_per_seed']:,}", *cells, f"{row['command_cpu_seconds']:,.0f}",
                f"{row['command_seconds']:,.0f} ({row['load_start']:.0f}–{row['load_end']:.0f})"]))
    return "\n".join(lines)


__all__ = ["ABSTENTION_COVERAGES", "abstention_table", "presets_table", "table"]
