"""The docs' tables of the records that :mod:`~bayeslayer.experiments.common.recall_sweep` writes for the
learned recall and crowding tasks (``recall.json``, ``crowding.json``): a curve of the core models over the
test sweep, the low-rank cores beside the dense ones, and recall's answers to the paper's claims.

The two experiments share the record's layout, so its renderings live here beside it; ``recall`` and
``crowding`` expose them (``recall.table``, ``recall.claims_table``, ``crowding.lowrank_table``, ...) and
``tools/build_tables.py`` calls them on the committed records.  Each takes the record(s) as read from their JSON
and returns Markdown.
"""

from __future__ import annotations

from collections.abc import Callable

from .tables import check_record, markdown_row, mean_std, minus, separator, signed_mean_std

#: the core models of the sweep tables, in column order, with their headers
CORE_COLUMNS = (("bayesian", "BL"), ("delta", "Delta-style"), ("linear_attention", "LA-style"), ("gla", "GLA-style"))


def sweep_table(record: dict, curve: str, *, head: str, axis: str, x_format: Callable[[dict, float], str]) -> str:
    """One row per point of ``config[axis]`` (labelled ``x_format(config, x)``, under the header ``head``), one
    column per core model of :data:`CORE_COLUMNS`: ``summary[curve]`` mean ± std over seeds, three decimals."""
    check_record(record)
    models = record["models"]
    lines = [markdown_row([head, *(label for _, label in CORE_COLUMNS)]), separator(len(CORE_COLUMNS) + 1)]
    for i, x in enumerate(record["config"][axis]):
        cells = [mean_std(models[k]["summary"][curve]["mean"][i], models[k]["summary"][curve]["std"][i], 3)
                 for k, _ in CORE_COLUMNS]
        lines.append(markdown_row([x_format(record["config"], x), *cells]))
    return "\n".join(lines)


def core_state_floats(config: dict, key: str) -> int:
    """State floats per head of a recall/crowding core (heads of ``D = m = address_dim``): the memory ``D·m``,
    plus a dense covariance ``D²`` (BL) or a low-rank one ``D·(r + 1)`` (``bayesian_lowrank<r>``)."""
    d = config["address_dim"]
    if key == "bayesian":
        return 2 * d * d
    if key.startswith("bayesian_lowrank"):
        return d * d + d * (int(key.removeprefix("bayesian_lowrank")) + 1)
    return d * d


def _index(record: dict, axis: str, x) -> int:
    xs = [round(v, 6) for v in record["config"][axis]]
    if round(x, 6) not in xs:
        raise ValueError(f"x: {axis} of the record has no point {x}; it has {record['config'][axis]}")
    return xs.index(round(x, 6))


def point(record: dict, key: str, curve: str, axis: str, x, digits: int = 3, *, std: bool = True) -> str:
    """Model ``key``'s ``curve`` at the point ``x`` of ``config[axis]``: mean ± std over seeds (or the mean
    alone), with the minus sign U+2212."""
    s, i = record["models"][key]["summary"][curve], _index(record, axis, x)
    return signed_mean_std(s["mean"][i], s["std"][i], digits) if std else minus(f"{s['mean'][i]:.{digits}f}")


def core_comparison_table(ours: dict, paper: dict) -> str:
    """Our recall cores (per-token noise maps, ``ours``) against the paper's (per-head scalars, ``paper``, a run
    with ``--core paper``) for BL and Delta: accuracy at ``n_f ∈ {64, 128, 256}`` (ρ = 0.80) and margin at
    ρ ∈ {0.80, 0.90, 0.95} (``n_f = 64``), mean ± std over seeds; a model a record lacks is "not run"."""
    rows = (("accuracy at n_f = 64", "test_n_f", 64, "accuracy_vs_n_f"),
            ("accuracy at n_f = 128", "test_n_f", 128, "accuracy_vs_n_f"),
            ("accuracy at n_f = 256", "test_n_f", 256, "accuracy_vs_n_f"),
            ("margin at ρ = 0.80", "test_rho", 0.80, "margin_vs_rho"),
            ("margin at ρ = 0.90", "test_rho", 0.90, "margin_vs_rho"),
            ("margin at ρ = 0.95", "test_rho", 0.95, "margin_vs_rho"))
    columns = (("BL, ours", "ours", "bayesian"), ("BL, paper core", "paper", "bayesian_paper"),
               ("Delta, ours", "ours", "delta"), ("Delta, paper core", "paper", "delta_paper"))
    records = {"ours": check_record(ours, "ours"), "paper": check_record(paper, "paper")}
    lines = [markdown_row(["", *(label for label, _, _ in columns)]), separator(len(columns) + 1)]
    for label, axis, x, curve in rows:
        cells = []
        for _, which, kind in columns:
            model = records[which]["models"].get(kind)
            if model is None:
                cells.append("not run")
                continue
            i = _index(records[which], axis, x)
            cells.append(mean_std(model["summary"][curve]["mean"][i], model["summary"][curve]["std"][i], 3))
        lines.append(markdown_row([label, *cells]))
    return "\n".join(lines)


def recall_lowrank_table(record: dict, rank4: dict) -> str:
    """Recall of the low-rank cores beside dense BL, Delta and LA (``record``, with ``bayesian_lowrank1``) and
    the rank-4 core's one-seed run (``rank4``): state floats per head, accuracy over ``n_f``, margin over ρ and
    the last validation accuracy."""
    check_record(record)
    check_record(rank4, "rank4")
    lines = [markdown_row(["core", "state floats / head", "acc `n_f = 8`", "64", "256", "margin ρ = 0.80", "0.95",
                           "val acc at the end"]), separator(8)]

    def cells(rec: dict, key: str, one_seed: bool) -> list[str]:
        s = rec["models"][key]["summary"]
        return [str(core_state_floats(rec["config"], key)),
                *(point(rec, key, "accuracy_vs_n_f", "test_n_f", x, std=not one_seed) for x in (8, 64, 256)),
                *(point(rec, key, "margin_vs_rho", "test_rho", x, std=not one_seed) for x in (0.8, 0.95)),
                f"{s['learning_curve']['val_accuracy']['mean'][-1]:.3f}"]

    lines.append(markdown_row(["dense BL (= r = 16)", *cells(record, "bayesian", False)]))
    lines.append(markdown_row(["BL r = 4 (1 seed, [`lowrank4/recall.json`](../results/recall/lowrank4/recall.json))",
                               *cells(rank4, "bayesian_lowrank4", True)]))
    for key, label in (("bayesian_lowrank1", "BL r = 1"), ("delta", "Delta"), ("linear_attention", "LA")):
        lines.append(markdown_row([label, *cells(record, key, False)]))
    return "\n".join(lines)


def crowding_lowrank_table(record: dict) -> str:
    """Crowding of the rank-1 core beside dense BL and Delta: state floats per head, query cross-entropy and
    accuracy at loads ``n/D = 1, 4, 16``, mean ± std over seeds."""
    check_record(record)
    lines = [markdown_row(["core", "state floats / head", "CE `n/D = 1`", "4", "16", "acc `n/D = 1`", "4", "16"]),
             separator(8)]
    for key, label in (("bayesian", "dense BL (= r = 16)"), ("bayesian_lowrank1", "BL r = 1"), ("delta", "Delta")):
        cells = [str(core_state_floats(record["config"], key))]
        for curve in ("cross_entropy_vs_load", "accuracy_vs_load"):
            cells += [point(record, key, curve, "test_load", x) for x in (1, 4, 16)]
        lines.append(markdown_row([label, *cells]))
    return "\n".join(lines)


def recall_claims_table(record: dict, long: dict) -> str:
    """The paper's recall claims (docs/theory.md §8.2) against the default preset's ``record``, with the
    ``long`` preset's answer where the default budget disagrees."""
    check_record(record)
    check_record(long, "long")

    def acc(r, key, n_f, **kw):
        return point(r, key, "accuracy_vs_n_f", "test_n_f", n_f, **kw)

    def margin(r, key, rho, **kw):
        return point(r, key, "margin_vs_rho", "test_rho", rho, **kw)

    d = record["config"]["address_dim"]
    bl_acc_095 = point(record, "bayesian", "accuracy_vs_rho", "test_rho", 0.95, 2, std=False)
    lines = [markdown_row(["claim", "paper", "ours (default preset)", "agrees?"]), separator(4),
             markdown_row(["BL accuracy at `n_f = 256`", "≈ 1", acc(record, "bayesian", 256), "yes"]),
             markdown_row(["Delta accuracy at `n_f = 256`", "≈ 0.75", acc(record, "delta", 256),
                           f"**no**: Delta degrades much more in our runs "
                           f"({acc(record, 'delta', 64, digits=2, std=False)} at `n_f = 64`, "
                           f"{acc(record, 'delta', 128, digits=2, std=False)} at 128); "
                           f"{acc(long, 'delta', 256)} at 3× the steps"]),
             markdown_row(["LA, GLA at `n_f = 256`", "collapse",
                           f"{acc(record, 'linear_attention', 256)}, {acc(record, 'gla', 256)} "
                           f"(chance 1/{d} = {1 / d:g})", "yes"]),
             markdown_row(["BL margin at ρ = 0.95", "positive", margin(record, "bayesian", 0.95),
                           f"**no** at this budget (accuracy {bl_acc_095}); **yes** at 3× the steps: "
                           f"{margin(long, 'bayesian', 0.95)} (`long`, below)"]),
             markdown_row(["Delta margin at ρ = 0.95", "negative", margin(record, "delta", 0.95), "yes"])]
    return "\n".join(lines)


def recall_long_table(record: dict, long: dict) -> str:
    """BL and Delta at the default preset (``record``) and the ``long`` one (3× the steps), accuracy over ``n_f``
    and margin over ρ, with the paper's claims."""
    check_record(record)
    check_record(long, "long")
    lines = [markdown_row(["", "default: BL", "long: BL", "default: Delta", "long: Delta", "paper"]), separator(6)]
    points = [("accuracy_vs_n_f", "test_n_f", n, f"accuracy at `n_f = {n}`") for n in (64, 128, 256)]
    points += [("margin_vs_rho", "test_rho", rho, f"margin at ρ = {rho:.2f}") for rho in (0.8, 0.9, 0.95)]
    paper = {"accuracy at `n_f = 256`": "BL ≈ 1, Delta ≈ 0.75", "margin at ρ = 0.95": "BL positive, Delta negative"}
    for curve, axis, x, label in points:
        cells = [point(r, key, curve, axis, x) for key in ("bayesian", "delta") for r in (record, long)]
        lines.append(markdown_row([label, *cells, paper.get(label, "—")]))
    return "\n".join(lines)


def recall_long_curves_table(long: dict) -> str:
    """The ``long`` preset's learning curves (mean over seeds) at its monitoring points: BL's margin at
    ρ = 0.95 and Delta's accuracy at ``n_f = 256`` and 64."""
    models = check_record(long, "long")["models"]
    steps = models["bayesian"]["summary"]["learning_curve"]["step"]
    lines = [markdown_row(["step", *(f"{s:,}" for s in steps)]), separator(len(steps) + 1)]
    for key, curve, label in (("bayesian", "margin_rho_0.95", "BL margin at ρ = 0.95"),
                              ("delta", "accuracy_n_f_256", "Delta accuracy at `n_f = 256`"),
                              ("delta", "accuracy_n_f_64", "Delta accuracy at `n_f = 64`")):
        lc = models[key]["summary"]["learning_curve"]
        if lc["step"] != steps:
            raise ValueError(f"long: {key}'s learning curve has other steps than BL's")
        lines.append(markdown_row([label, *(minus(f"{v:.2f}") for v in lc[curve]["mean"])]))
    return "\n".join(lines)


__all__ = ["CORE_COLUMNS", "core_comparison_table", "core_state_floats", "crowding_lowrank_table", "point",
           "recall_claims_table", "recall_long_curves_table", "recall_long_table", "recall_lowrank_table",
           "sweep_table"]
