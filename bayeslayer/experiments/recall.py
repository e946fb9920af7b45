"""``bayeslayer recall``: learned controlled collision recall (docs/theory.md §8.2).

Each sequence holds 8 target/distractor address pairs with overlap ρ; targets are
written ``n_b = 4`` times, then their distractors ``n_f`` times, then the targets
are queried (:func:`bayeslayer.data.collision_tasks.collision_recall_batch`).
Models are recurrent-core only (:mod:`bayeslayer.experiments.common.recall_models`): BL and
the Delta-, LA- and GLA-style cores (``--models gated_deltanet`` adds the GDN-style one), addresses fed
directly as key and query.  The presets, the
training sampler and the model builder are :mod:`bayeslayer.experiments.common.recall_task`'s.

Training: ``n_f ∈ {1, 2, 4, 8}`` (one per batch), ``ρ ~ U[0.60, 0.80]`` per sequence.
Tests (fixed evaluation sets, identical for every model and seed):

* accuracy (and CE) vs ``n_f ∈ {1, …, 256}`` at ρ = 0.80;
* target-vs-distractor margin vs ρ ∈ {0.60, …, 0.95} at ``n_f = 64``: with logits ``z``
  at a query, ``margin = 2σ(z_target − z_distractor) − 1`` (docs/theory.md §8.1's ``2p^{AB} − 1``),
  averaged over queries; positive means the target's value still beats its distractor's.

Learning curves: ``curve_points`` times during training (every ``steps // curve_points`` steps and at
the end) each model is scored on fixed monitoring sets of ``curve_sequences`` sequences — validation
accuracy and CE on the training distribution, accuracy at ``n_f ∈ curve_n_f`` (ρ = 0.80) and margin
at ``ρ ∈ curve_rho`` (``n_f = 64``), the numbers the paper's claims are about — so a reader can see
whether a budget has converged.  ``long`` is ``default`` with 3× the steps and nothing else changed.

Python: ``run(RecallConfig(preset=PRESETS["tiny"], models=("delta",), out=None)) -> record``.

Writes ``<out>/recall.json`` (config, per-seed metrics and learning curves, mean ± std over seeds)
and ``<out>/recall.png`` drawn from that JSON (``--plot-only`` redraws it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..data.collision_tasks import collision_recall_batch
from .common import recall_tables
from .common.harness import masked_cross_entropy, query_accuracy
from .common.plotting import save_figure
from .common.recall_sweep import CoreRunConfig, add_command, print_summary_table, run_sweep
from .common.recall_task import PRESETS, RecallPreset, build_model, sampler

DESCRIPTION = (
    "Learned controlled collision recall: each sequence writes 8 target addresses 4 times, then a distractor "
    "overlapping each target (overlap rho) n_f times, then queries the targets. Trains BL and the Delta-, LA- and "
    "GLA-style recurrent cores on n_f in {1, 2, 4, 8} and reports accuracy against n_f up to 256 and the "
    "target-versus-distractor margin against rho, mean and std over seeds. Writes OUT/recall.json and "
    "OUT/recall.png drawn from it (--plot-only redraws the figure). See docs/experiments.md."
)

#: the paper's training budget for this task (steps, batch, seeds); the state budget is a size in floats
PAPER_TRAINING_BUDGET = "2,500 steps, batch 256, 3 seeds"


def evaluate_point(model: nn.Module, preset: RecallPreset, n_f: int, rho, point_seed: int,
                   sequences: int | None = None) -> dict:
    """Accuracy, CE and margin of ``model`` on ``sequences`` (default ``eval_sequences``) fixed sequences at
    ``(n_f, ρ)``; ``rho`` a number, or a ``(lo, hi)`` range drawn per sequence like training's."""
    g = torch.Generator().manual_seed(preset.eval_seed * 7919 + point_seed)
    correct = margin = ce = 0.0
    count = 0
    left = preset.eval_sequences if sequences is None else sequences
    while left > 0:
        b = min(left, preset.eval_batch)
        left -= b
        r = rho if not isinstance(rho, tuple) else rho[0] + (rho[1] - rho[0]) * torch.rand(b, generator=g)
        batch = collision_recall_batch(b, n_f=n_f, rho=r, generator=g, n_b=preset.n_b,
                                       num_pairs=preset.num_pairs, address_dim=preset.address_dim)
        logits = model(batch.inputs)
        mask = batch.labels != -100
        z = logits[mask]
        zt = z.gather(-1, batch.labels[mask][:, None]).squeeze(-1)
        zd = z.gather(-1, batch.distractor_labels[mask][:, None]).squeeze(-1)
        nq = int(mask.sum())
        correct += query_accuracy(logits, batch.labels) * nq
        margin += float((2 * torch.sigmoid(zt - zd) - 1).sum())
        ce += float(masked_cross_entropy(logits, batch.labels)) * nq
        count += nq
    return {"accuracy": correct / count, "margin": margin / count, "cross_entropy": ce / count}


def final_evaluation(preset: RecallPreset):
    def evaluate(model: nn.Module) -> dict:
        by_nf = [evaluate_point(model, preset, n_f, preset.test_rho_for_n_f, i)
                 for i, n_f in enumerate(preset.test_n_f)]
        by_rho = [evaluate_point(model, preset, preset.test_n_f_for_rho, rho, 1000 + i)
                  for i, rho in enumerate(preset.test_rho)]
        return {
            "accuracy_vs_n_f": [p["accuracy"] for p in by_nf],
            "cross_entropy_vs_n_f": [p["cross_entropy"] for p in by_nf],
            "margin_vs_n_f": [p["margin"] for p in by_nf],
            "margin_vs_rho": [p["margin"] for p in by_rho],
            "accuracy_vs_rho": [p["accuracy"] for p in by_rho],
        }

    return evaluate


def curve_evaluation(preset: RecallPreset):
    """``evaluate(model)`` for the learning curves: validation accuracy/CE on the training distribution
    (``curve_sequences`` per training ``n_f``), accuracy at each ``curve_n_f`` (ρ = ``test_rho_for_n_f``) and
    margin at each ``curve_rho`` (``n_f = test_n_f_for_rho``), on sets fixed across steps, models and seeds."""
    n = preset.curve_sequences

    def evaluate(model: nn.Module) -> dict[str, float]:
        val = [evaluate_point(model, preset, n_f, preset.train_rho, 5000 + i, n)
               for i, n_f in enumerate(preset.train_n_f)]
        out = {"val_accuracy": sum(p["accuracy"] for p in val) / len(val),
               "val_loss": sum(p["cross_entropy"] for p in val) / len(val)}
        for i, n_f in enumerate(preset.curve_n_f):
            out[f"accuracy_n_f_{n_f}"] = evaluate_point(model, preset, n_f, preset.test_rho_for_n_f, 6000 + i,
                                                        n)["accuracy"]
        for i, rho in enumerate(preset.curve_rho):
            out[f"margin_rho_{rho:g}"] = evaluate_point(model, preset, preset.test_n_f_for_rho, rho, 7000 + i,
                                                        n)["margin"]
        return out

    return evaluate


CURVES = ("accuracy_vs_n_f", "cross_entropy_vs_n_f", "margin_vs_n_f", "margin_vs_rho", "accuracy_vs_rho")


@dataclass(frozen=True)
class RecallConfig(CoreRunConfig):
    """One recall run: a :class:`CoreRunConfig` whose ``preset`` is a :class:`RecallPreset`."""

    preset: RecallPreset = PRESETS["default"]


def run(config: RecallConfig) -> dict:
    """Train and test every model of ``config`` over its seeds; returns (with ``out``, writes) ``recall.json``."""
    preset = RecallConfig.checked(config).preset
    return run_sweep("recall", config, build_model=lambda kind: build_model(kind, preset), sampler=sampler(preset),
                     evaluation=final_evaluation(preset), curves=CURVES, plot=plot_recall,
                     paper_budget=PAPER_TRAINING_BUDGET,
                     evaluate=curve_evaluation(preset) if preset.curve_points else None)


def plot_recall(record: dict, path: str) -> None:
    """Accuracy vs ``n_f`` (ρ = 0.80) and margin vs ρ (``n_f = 64``), mean ± std over seeds, from the JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = record["config"]
    curves = all("learning_curve" in res["summary"] for res in record["models"].values())
    fig, axes = plt.subplots(1, 3 if curves else 2, figsize=(15 if curves else 10, 4))
    ax1, ax2 = axes[0], axes[1]
    panels = ((ax1, cfg["test_n_f"], "accuracy_vs_n_f"), (ax2, cfg["test_rho"], "margin_vs_rho"))
    for res in record["models"].values():
        s = res["summary"]
        lines = []
        for ax, x, key in panels:
            lines.append(ax.errorbar(x, s[key]["mean"], yerr=s[key]["std"], marker="o", ms=3, capsize=2,
                                     label=res["label"]))
        if curves:
            lc = s["learning_curve"]
            color = lines[0][0].get_color()
            far = f"accuracy_n_f_{max(cfg['curve_n_f'])}"
            axes[2].plot(lc["step"], lc["val_accuracy"]["mean"], "-o", ms=3, color=color, label=res["label"])
            if far in lc:
                axes[2].plot(lc["step"], lc[far]["mean"], "--", color=color)
    if curves:
        axes[2].set_xlabel("training step")
        axes[2].set_ylabel(f"accuracy: validation (—), n_f = {max(cfg['curve_n_f'])} (--)")
        axes[2].set_ylim(-0.02, 1.02)
        axes[2].set_title("learning curves (monitoring sets)", fontsize=9)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("distractor writes per pair $n_f$")
    ax1.set_ylabel(f"query accuracy (ρ = {cfg['test_rho_for_n_f']:.2f})")
    ax1.set_ylim(-0.02, 1.02)
    ax1.axvspan(min(cfg["train_n_f"]), max(cfg["train_n_f"]), color="0.9", zorder=0, label="train range")
    ax2.axhline(0, color="k", lw=0.8)
    ax2.set_xlabel("overlap ρ")
    ax2.set_ylabel(f"target-vs-distractor margin ($n_f$ = {cfg['test_n_f_for_rho']})")
    nseeds = cfg["seeds"]
    fig.suptitle(f"Learned collision recall — preset '{record['preset']}' ({cfg['steps']} steps, "
                 f"batch {cfg['batch_size']}, {nseeds} seed{'s' * (nseeds > 1)}; mean ± std)")
    ax1.legend(fontsize=8)
    save_figure(fig, path)  # atomic, never through a link
    plt.close(fig)


def print_table(record: dict) -> None:
    cfg = record["config"]
    print_summary_table(record, "accuracy_vs_n_f", cfg["test_n_f"], "n_f", "d",
                        f"accuracy vs n_f at ρ = {cfg['test_rho_for_n_f']:.2f} (mean ± std over {cfg['seeds']} seeds)")
    print_summary_table(record, "margin_vs_rho", cfg["test_rho"], "ρ", ".2f",
                        f"margin vs ρ at n_f = {cfg['test_n_f_for_rho']}")
    models = record["models"].values()
    if models and all("learning_curve" in m["summary"] for m in models):
        names = list(record["models"])
        lcs = [record["models"][k]["summary"]["learning_curve"] for k in names]
        for key in ["val_accuracy"] + [f"accuracy_n_f_{n}" for n in cfg["curve_n_f"]]:
            print(f"\nlearning curve: {key} by step (mean over seeds)")
            print(f"{'step':<7}" + "".join(f"{record['models'][k]['label']:>16}" for k in names))
            for i, step in enumerate(lcs[0]["step"]):
                print(f"{step:<7d}" + "".join(f"{lc[key]['mean'][i]:>16.3f}" for lc in lcs))


#: the curves :func:`table` lays out: curve -> (first column's header, the config's axis, the point's format)
TABLE_CURVES = {"accuracy_vs_n_f": ("n_f", "test_n_f", "g"), "margin_vs_rho": ("ρ", "test_rho", ".2f")}


def table(record: dict, curve: str = "accuracy_vs_n_f") -> str:
    """``recall.json``'s ``curve`` (:data:`TABLE_CURVES`) as the docs' Markdown table: a row per test point, a
    column per core model, mean ± std over seeds.  The record's other tables: :func:`claims_table`,
    :func:`long_table`, :func:`long_curves_table`, :func:`lowrank_table`, :func:`core_comparison_table`."""
    if curve not in TABLE_CURVES:
        raise ValueError(f"curve must be one of {sorted(TABLE_CURVES)}, got {curve!r}")
    head, axis, fmt = TABLE_CURVES[curve]
    return recall_tables.sweep_table(record, curve, head=head, axis=axis, x_format=lambda config, x: format(x, fmt))


# the record's other tables in the docs, laid out with crowding's in common/recall_tables.py (one record layout)
claims_table = recall_tables.recall_claims_table
long_table = recall_tables.recall_long_table
long_curves_table = recall_tables.recall_long_curves_table
lowrank_table = recall_tables.recall_lowrank_table
core_comparison_table = recall_tables.core_comparison_table


def add_parser(sub) -> None:
    add_command(sub, name="recall",
                help="learned controlled collision recall (docs/theory.md §8.2)", doc=DESCRIPTION, presets=PRESETS,
                paper_budget=PAPER_TRAINING_BUDGET, config_type=RecallConfig, run=run, plot=plot_recall,
                print_table=print_table)
