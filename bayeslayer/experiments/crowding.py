"""``bayeslayer crowding``: random-key crowding (docs/theory.md §8.3).

Unit addresses are a 64-dim standard Gaussian projected by one frozen, seeded,
row-orthogonal 16×64 matrix (the same for every model and run) and renormalised;
a sequence writes ``n`` (address, value) associations with 64 value labels, then
queries 8 of them (:func:`bayeslayer.data.collision_tasks.crowding_batch`).
Training draws ``n ∈ {16, 32, 48, 64}`` (``n/D ≤ 4``, one ``n`` per batch); tests run
past capacity at ``n/D ∈ {6, 8, 12, 16}`` (and, for reference, at the training loads
``n/D ∈ {1, 2, 3, 4}``).  Metrics: query cross-entropy (nats) and accuracy vs ``n/D``.

Models: BL and the Delta-, LA- and GLA-style recurrent cores (``--models gated_deltanet`` adds the
GDN-style one) with the address as key and query (:mod:`bayeslayer.experiments.common.recall_models`).  Writes
``<out>/crowding.json`` and ``<out>/crowding.png`` drawn from it.

Python: ``run(CrowdingConfig(preset=PRESETS["tiny"], models=("delta",), out=None)) -> record``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..data.collision_tasks import crowding_batch, crowding_projection
from .common import recall_tables
from .common.harness import masked_cross_entropy, query_accuracy
from .common.plotting import save_figure
from .common.recall_models import build_core_model
from .common.recall_sweep import CorePreset, CoreRunConfig, add_command, print_summary_table, run_sweep

DESCRIPTION = (
    "Random-key crowding: each sequence writes n associations of random unit addresses (16-dimensional) and 64 "
    "value labels, then queries 8 of them. Trains BL and the Delta-, LA- and GLA-style recurrent cores at loads "
    "n/D up to 4 and reports query cross-entropy and accuracy past capacity (n/D up to 16), mean and std over "
    "seeds. Writes OUT/crowding.json and OUT/crowding.png drawn from it (--plot-only redraws the figure). See "
    "docs/experiments.md."
)

#: the paper's training budget for this task (steps, batch, seeds); the state budget is a size in floats
PAPER_TRAINING_BUDGET = "2,500 steps, batch 256, 3 seeds"


@dataclass(frozen=True)
class CrowdingPreset(CorePreset):
    """Everything a crowding run depends on; ``paper`` is the paper's setting (docs/theory.md §8.3) with
    §8.2's optimiser budget.

    The first fields (name, steps, batch size, seeds, ``eval_sequences``, the optimiser's) and the
    training config are :class:`~bayeslayer.experiments.common.recall_sweep.CorePreset`'s (no learning curves).
    """

    address_dim: int = 16
    source_dim: int = 64
    projection_seed: int = 0
    num_values: int = 64
    num_queries: int = 8
    train_n: tuple[int, ...] = (16, 32, 48, 64)
    test_load: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16)  # n/D; 6..16 are the paper's test loads
    eval_batch: int = 64
    eval_seed: int = 4321


PRESETS = {
    "paper": CrowdingPreset("paper", steps=2500, batch_size=256, seeds=3, eval_sequences=512),
    # Sized from step times measured on the idle 2-core CPU (shorter sequences than recall): all four
    # models, two seeds, training and evaluation in roughly 10-15 minutes when the machine is idle.
    "default": CrowdingPreset("default", steps=800, batch_size=64, seeds=2, eval_sequences=128),
    "tiny": CrowdingPreset("tiny", steps=20, batch_size=16, seeds=1, eval_sequences=16, test_load=(1, 6)),
}


def sampler(preset: CrowdingPreset, projection: torch.Tensor):
    """Training batches: one ``n`` from ``train_n`` per batch."""

    def sample_batch(step: int, batch_size: int, generator: torch.Generator):
        idx = int(torch.randint(len(preset.train_n), (1,), generator=generator))
        return crowding_batch(batch_size, n=preset.train_n[idx], projection=projection, generator=generator,
                              num_queries=preset.num_queries, num_values=preset.num_values)

    return sample_batch


def final_evaluation(preset: CrowdingPreset, projection: torch.Tensor):
    """Query CE and accuracy at every test load, on fixed sequences shared by all models and seeds."""

    def evaluate(model: nn.Module) -> dict:
        ce_curve, acc_curve = [], []
        for i, load in enumerate(preset.test_load):
            g = torch.Generator().manual_seed(preset.eval_seed * 7919 + i)
            ce = acc = 0.0
            count = 0
            left = preset.eval_sequences
            while left > 0:
                b = min(left, preset.eval_batch)
                left -= b
                batch = crowding_batch(b, n=load * preset.address_dim, projection=projection, generator=g,
                                       num_queries=preset.num_queries, num_values=preset.num_values)
                logits = model(batch.inputs)
                nq = int((batch.labels != -100).sum())
                ce += float(masked_cross_entropy(logits, batch.labels)) * nq
                acc += query_accuracy(logits, batch.labels) * nq
                count += nq
            ce_curve.append(ce / count)
            acc_curve.append(acc / count)
        return {"cross_entropy_vs_load": ce_curve, "accuracy_vs_load": acc_curve}

    return evaluate


def build_model(kind: str, preset: CrowdingPreset) -> nn.Module:
    return build_core_model(kind, input_dim=1 + preset.address_dim + preset.num_values,
                            num_classes=preset.num_values, address_start=1, address_dim=preset.address_dim,
                            head_dim=preset.address_dim)


CURVES = ("cross_entropy_vs_load", "accuracy_vs_load")


@dataclass(frozen=True)
class CrowdingConfig(CoreRunConfig):
    """One crowding run: a :class:`CoreRunConfig` whose ``preset`` is a :class:`CrowdingPreset`."""

    preset: CrowdingPreset = PRESETS["default"]


def run(config: CrowdingConfig) -> dict:
    """Train and test every model of ``config`` over its seeds; returns (with ``out``, writes) ``crowding.json``."""
    preset = CrowdingConfig.checked(config).preset
    projection = crowding_projection(preset.address_dim, preset.source_dim, preset.projection_seed)
    return run_sweep("crowding", config, build_model=lambda kind: build_model(kind, preset),
                     sampler=sampler(preset, projection), evaluation=final_evaluation(preset, projection),
                     curves=CURVES, plot=plot_crowding, paper_budget=PAPER_TRAINING_BUDGET)


def plot_crowding(record: dict, path: str) -> None:
    """Query CE and accuracy vs load ``n/D`` (mean ± std over seeds), drawn from the JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = record["config"]
    x = cfg["test_load"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for res in record["models"].values():
        s = res["summary"]
        for ax, key in ((ax1, "cross_entropy_vs_load"), (ax2, "accuracy_vs_load")):
            ax.errorbar(x, s[key]["mean"], yerr=s[key]["std"], marker="o", ms=3, capsize=2,
                        label=res["label"])
    top = max(cfg["train_n"]) / cfg["address_dim"]
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("load n / D")
        ax.axvspan(min(x), top, color="0.9", zorder=0)
    ax1.set_ylabel("query cross-entropy (nats)")
    ax2.set_ylabel("query accuracy")
    ax2.axhline(1 / cfg["num_values"], color="k", lw=0.8, ls=":", label="chance")
    ax2.legend(fontsize=8)
    nseeds = cfg["seeds"]
    fig.suptitle(f"Random-key crowding — preset '{record['preset']}' ({cfg['steps']} steps, batch "
                 f"{cfg['batch_size']}, {nseeds} seed{'s' * (nseeds > 1)}; shaded: training loads)")
    save_figure(fig, path)  # atomic, never through a link
    plt.close(fig)


def print_table(record: dict) -> None:
    cfg = record["config"]
    for key, title in (("cross_entropy_vs_load", "query cross-entropy"), ("accuracy_vs_load", "query accuracy")):
        print_summary_table(record, key, cfg["test_load"], "n/D", "d",
                            f"{title} vs n/D (mean ± std over {cfg['seeds']} seeds)")


#: the curves :func:`table` lays out
TABLE_CURVES = ("cross_entropy_vs_load", "accuracy_vs_load")


def table(record: dict, curve: str = "accuracy_vs_load") -> str:
    """``crowding.json``'s ``curve`` (:data:`TABLE_CURVES`) as the docs' Markdown table: a row per test load
    ``n/D (n)``, a column per core model, mean ± std over seeds.  The rank-1 core's table: :func:`lowrank_table`."""
    if curve not in TABLE_CURVES:
        raise ValueError(f"curve must be one of {list(TABLE_CURVES)}, got {curve!r}")
    return recall_tables.sweep_table(record, curve, head="n/D (n)", axis="test_load",
                                     x_format=lambda config, load: f"{load:g} ({int(load * config['address_dim'])})")


lowrank_table = recall_tables.crowding_lowrank_table  # the rank-1 core's table, beside recall's in recall_tables


def add_parser(sub) -> None:
    add_command(sub, name="crowding",
                help="random-key crowding past capacity (docs/theory.md §8.3)", doc=DESCRIPTION, presets=PRESETS,
                paper_budget=PAPER_TRAINING_BUDGET, config_type=CrowdingConfig, run=run, plot=plot_crowding,
                print_table=print_table)
