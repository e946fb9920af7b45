"""Each experiment lays out its own records as the docs' Markdown tables (``table(record)`` beside ``plot``).

Every such function is run here on the committed record(s) under ``results/`` and must give the table the docs
hold between its ``results-table`` markers, byte for byte, without the docs' table builder
(``tools/build_tables.py``, tested by tests/test_results_tables.py) in between.  A number changed in a record
changes the table; a wrong argument is refused naming it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from bayeslayer.experiments import collision, crowding, distill, heldout, lm, mqar, recall, variance
from bayeslayer.experiments.common import recall_tables

ROOT = Path(__file__).resolve().parents[2]
UPDATES = {"xs": (0, 4, 8, 12, 16), "x_labels": ("u = 0", "4", "8", "12", "16")}
PAIRS = {"xs": (2, 8, 10, 12, 14, 16), "x_labels": ("2 pairs", "8", "10", "12", "14", "16")}


def load(rel: str) -> dict:
    return json.loads((ROOT / rel).read_text(encoding="utf-8"))


def docs_table(name: str, document: str = "docs/experiments.md") -> str:
    """The table between ``name``'s markers in ``document``, as committed."""
    lines = (ROOT / document).read_text(encoding="utf-8").split("\n")
    begin = next(i for i, line in enumerate(lines) if line.startswith(f"<!-- results-table {name}: "))
    return "\n".join(lines[begin + 1:lines.index(f"<!-- /results-table {name} -->", begin)])


RECALL, RECALL_LONG = "results/recall/recall.json", "results/recall/long/recall.json"
CROWDING, COLLISION = "results/crowding/crowding.json", "results/collision/collision.json"
LOWRANK = "results/collision/collision_lowrank.json"
MQAR_LAYOUTS = "results/mqar/layouts/mqar_{}.json"


def _mqar_claims() -> str:
    records = {(task, layout): load(MQAR_LAYOUTS.format(task + suffix)) for task in ("update", "block")
               for layout, suffix in (("stacked", ""), ("hybrid", "_hybrid"))}
    budget = {"stacked": load("results/mqar/mamba2_budget/mqar_update.json"),
              "hybrid": load("results/mqar/mamba2_budget/mqar_update_hybrid.json")}
    return mqar.claims_table(records, budget)


# docs table -> the experiment's function on the committed record(s)
TABLES = {
    "collision-steps": lambda: collision.steps_table(load(COLLISION)),
    "collision-fixed-prior": lambda: collision.fixed_prior_table(load(COLLISION)),
    "collision-overlap": lambda: collision.overlap_table(load(COLLISION)),
    "collision-closed-form": lambda: collision.closed_form_table(load(COLLISION)),
    "collision-lowrank": lambda: collision.lowrank_table(load(LOWRANK)),
    "collision-pairs": lambda: collision.pairs_table(load(LOWRANK)),
    "recall-accuracy-nf": lambda: recall.table(load(RECALL)),
    "recall-margin-rho": lambda: recall.table(load(RECALL), "margin_vs_rho"),
    "recall-paper-core": lambda: recall.core_comparison_table(load(RECALL),
                                                              load("results/recall/paper-core/recall.json")),
    "recall-lowrank": lambda: recall.lowrank_table(load(RECALL), load("results/recall/lowrank4/recall.json")),
    "recall-claims": lambda: recall.claims_table(load(RECALL), load(RECALL_LONG)),
    "recall-long": lambda: recall.long_table(load(RECALL), load(RECALL_LONG)),
    "recall-long-curves": lambda: recall.long_curves_table(load(RECALL_LONG)),
    "crowding-ce": lambda: crowding.table(load(CROWDING), "cross_entropy_vs_load"),
    "crowding-accuracy": lambda: crowding.table(load(CROWDING)),
    "crowding-lowrank": lambda: crowding.lowrank_table(load(CROWDING)),
    "mqar-update-hybrid": lambda: mqar.table(load(MQAR_LAYOUTS.format("update_hybrid")), "hybrid", **UPDATES),
    "mqar-block-hybrid4": lambda: mqar.table([load("results/mqar/hybrid4/mqar_block_hybrid.json"),
                                              load("results/mqar/hybrid4_bl_noconv/mqar_block_hybrid.json")],
                                             "hybrid, 4 layers", **PAIRS),
    "mqar-update-gate-off": lambda: mqar.table(load(MQAR_LAYOUTS.format("update_gate-off")), "stacked, gate off",
                                               train_seconds=False, gate=False, **UPDATES),
    "mqar-lowrank": lambda: mqar.lowrank_table(load(MQAR_LAYOUTS.format("update_hybrid")),
                                               load("results/mqar/lowrank/mqar_update_hybrid.json")),
    "mqar-claims": _mqar_claims,
    "lm-cpu-state": lambda: lm.table([load("results/lm/cpu_test.json"), load("results/lm/cpu_state_test.json")],
                                     ours="ours, `cpu`, ", paper=("BL", "GDN")),
    "lm-cpu60": lambda: lm.table(load("results/lm/cpu60_test.json"), paper=("BL", "GDN", "Mamba-2")),
    "distill-stages": lambda: distill.table(load("results/distill/cpu/distill.json")),
    "distill-heldout": lambda: heldout.table(load("results/distill/cpu/eval/heldout/heldout.json")),
    "variance-presets": lambda: variance.presets_table(load("results/variance/presets.json")),
    "variance-auroc": lambda: variance.table(load("results/variance/variance.json")),
}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_the_experiment_lays_out_the_committed_record_as_the_docs_show_it(name):
    assert TABLES[name]() == docs_table(name)


def _bump(record: dict, path: tuple, delta: float) -> dict:
    changed = copy.deepcopy(record)
    target = changed
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] += delta
    return changed


# (function of a record, record, where in it a number changes, by how much, the cell the change must show)
CHANGES = {
    "collision.steps_table": (collision.steps_table, COLLISION, ("models", "bayesian", "gain", -1), 0.1, None),
    "collision.lowrank_table": (collision.lowrank_table, LOWRANK, ("models", "bayesian", "final_p_ab"), 0.1, None),
    "recall.table": (recall.table, RECALL,
                     ("models", "delta", "summary", "accuracy_vs_n_f", "mean", 0), 0.5, None),
    "crowding.lowrank_table": (crowding.lowrank_table, CROWDING,
                               ("models", "bayesian_lowrank1", "summary", "accuracy_vs_load", "std", 0), 0.5, None),
    "mqar.lowrank_table": (lambda r: mqar.lowrank_table(r, load("results/mqar/lowrank/mqar_update_hybrid.json")),
                           MQAR_LAYOUTS.format("update_hybrid"),
                           ("models", "gated_deltanet", "summary", "train_seconds", "mean"), 100.0, None),
    "distill.table": (distill.table, "results/distill/cpu/distill.json",
                      ("stages", "phase_b", "final_train_loss"), 0.5, None),
    "heldout.table": (heldout.table, "results/distill/cpu/eval/heldout/heldout.json",
                      ("models", "BL", "cells", "python-docs", "512", "ppl"), 1.0, None),
    "lm.table": (lambda r: lm.table(r, ours="ours, `cpu`, "), "results/lm/cpu_test.json",
                 ("models", "BL", "summary", "all", "mean"), -0.01, "219.47 ± 10.04"),
}


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_a_changed_number_changes_the_table(name):
    render, rel, path, delta, shows = CHANGES[name]
    record = load(rel)
    before, after = render(record), render(_bump(record, path, delta))
    assert after != before
    changed = [(a, b) for a, b in zip(before.split("\n"), after.split("\n"), strict=True) if a != b]
    assert len(changed) == 1, changed  # one row shows the changed number
    if shows:
        assert shows in changed[0][1]


def test_the_lm_table_names_the_number_it_changed():
    record = load("results/lm/cpu_test.json")
    assert "| BL (ours, `cpu`, 2 seeds) | 219.48 ± 10.04 |" in lm.table(record, ours="ours, `cpu`, ")


def test_a_wrong_argument_is_named():
    rec = load(RECALL)
    with pytest.raises(TypeError, match="record must be a results record"):
        recall.table(RECALL)  # a path, not the record read from it
    with pytest.raises(ValueError, match="curve must be one of"):
        recall.table(rec, "accuracy")
    with pytest.raises(ValueError, match="curve must be one of"):
        crowding.table(load(CROWDING), "margin_vs_rho")
    with pytest.raises(ValueError, match="x: test_n_f of the record has no point 3"):
        recall_tables.point(rec, "bayesian", "accuracy_vs_n_f", "test_n_f", 3)
    update = load(MQAR_LAYOUTS.format("update"))
    with pytest.raises(ValueError, match="xs: the record's sweep has no point"):
        mqar.table(update, "stacked", xs=(0, 99), x_labels=("u = 0", "99"))
    with pytest.raises(ValueError, match="x_labels: one label per point"):
        mqar.table(update, "stacked", xs=(0, 4), x_labels=("u = 0",))
    with pytest.raises(TypeError, match=r"records must be a results record or a non-empty sequence"):
        mqar.table([], "stacked", **UPDATES)
    with pytest.raises(TypeError, match=r"rows\[0\] must be a \(record, mixer\) pair"):
        mqar.mixer_rows_table([update], **UPDATES)
    with pytest.raises(ValueError, match=r"rows\[0\]: the record has no mixer 'nope'"):
        mqar.mixer_rows_table([(update, "nope")], **UPDATES)
    with pytest.raises(ValueError, match="records needs"):
        mqar.claims_table({}, {})
    with pytest.raises(ValueError, match="paper: the record's paper_table2 has no"):
        lm.table(load("results/lm/cpu_test.json"), paper=("RWKV",))
    with pytest.raises(TypeError, match="long must be a results record"):
        recall.long_table(rec, None)
    with pytest.raises(ValueError, match="record must be the JSON written by evaluate_heldout"):
        heldout.table(rec)
