"""``bayeslayer variance``: reading the variance out of the trained models, a tiny run's JSON and figure and its
smoke-test note, and ``--help``'s preset sizes and times against the committed record (the AUROC, the logistic
fit and the per-token reduction: tests/evaluation/test_variance.py)."""

import json
from dataclasses import replace

import pytest
import torch

from bayeslayer.cli import main as cli_main
from bayeslayer.experiments import variance
from bayeslayer.experiments.variance import VarianceConfig, VarianceProbe, collect_queries


@pytest.mark.parametrize("setup", ["_recall_setup", "_mqar_setup"])
def test_probe_reads_each_bayesian_layers_variance_and_leaves_outputs_alone(setup):
    build, _, _, batches, _ = getattr(variance, setup)(variance.PRESETS["tiny"])
    torch.manual_seed(0)
    model = build(0).eval()
    inputs, labels, _ = next(batches())
    with torch.no_grad():
        plain = model(inputs)
        with VarianceProbe(model) as probe:
            probed = model(inputs)
        assert torch.equal(plain, probed)
        assert all(v.dim() == 4 and v.shape[:2] == inputs.shape[:2] and (v >= 1).all() for v in probe.variances)
        if setup == "_mqar_setup":  # the registry layer's own variance for the same input
            (layer,) = probe.layers
            seen = {}
            handle = layer.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
            model(inputs)
            handle.remove()
            torch.testing.assert_close(probe.variances[0], layer(seen["x"], output_variance=True).variance)
        else:
            assert len(probe.variances) == 2  # both core layers are BL
        rows = collect_queries(model, [(inputs, labels, 7)])
    n = int((labels != -100).sum())
    assert {k: v.shape for k, v in rows.items()} == {k: (n,) for k in rows}
    assert (rows["condition"] == 7).all() and (rows["entropy"] >= 0).all()
    assert probe.handles == []  # the hooks are gone


def test_probe_refuses_a_model_without_a_bayesian_layer():
    with pytest.raises(ValueError, match="no Bayesian layer"):
        VarianceProbe(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_tiny_run_writes_json_and_figure_and_redraws(tmp_path, capsys):
    record = variance.run(VarianceConfig(preset=variance.PRESETS["tiny"], out=str(tmp_path)))
    data = json.loads((tmp_path / "variance.json").read_text())
    assert data["experiment"] == "variance" and set(data["models"]) == set(variance.TASKS)
    assert data["provenance"]["seeds"] == [0, 1] and data["provenance"]["backfilled"] is False
    for task in data["models"].values():
        assert len(task["seeds"]) == 2 and task["summary"]["accuracy"]["mean"] >= 0
        assert len(task["summary"]["accuracy_by_variance_last_decile"]["mean"]) == variance.QUANTILES
    assert record["models"]["recall"]["seeds"][0]["queries"] > 0
    assert data["smoke_test"] is True and "mean nothing" in data["note"]
    (tmp_path / "variance.png").unlink()
    assert cli_main(["variance", "--plot-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "variance.png").stat().st_size > 1000


def test_config_and_cli_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="tasks"):
        VarianceConfig(tasks=("niah",))
    with pytest.raises(ValueError, match="preset.seeds"):
        VarianceConfig(preset=replace(variance.PRESETS["tiny"], seeds=0))
    assert cli_main(["variance", "--seeds", "0", "--out", str(tmp_path)]) == 2
    assert "--seeds" in capsys.readouterr().err
    assert cli_main(["variance", "--plot-only", "--out", str(tmp_path)]) == 2
    assert "variance.json, which does not exist" in capsys.readouterr().err


def test_coverage_curve_is_the_running_mean_of_the_deciles():
    deciles = [1.0, 1.0, 0.8, 0.6, 0.6, 0.4, 0.2, 0.2, 0.0, None]
    task = {"seeds": [{"accuracy_by_variance_last_decile": deciles}] * 2}
    cov = variance.coverage_curve(task, "variance_last")
    assert cov["coverage"][0] == 0.1 and cov["coverage"][-1] == 1.0
    assert cov["mean"][:3] == pytest.approx([1.0, 1.0, 2.8 / 3]) and cov["std"] == [0.0] * 10
    assert cov["mean"][-1] == pytest.approx(4.8 / 9)  # an empty decile is left out


def test_tiny_says_it_is_a_smoke_test_in_the_output_the_record_and_the_figure(tmp_path, capsys):
    assert cli_main(["variance", "--preset", "tiny", "--tasks", "recall", "--seeds", "1", "--out",
                     str(tmp_path)]) == 0
    out = capsys.readouterr().out
    note = variance.smoke_note(variance.PRESETS["tiny"])
    assert "smoke test" in note and "mean nothing" in note
    assert out.count(f"note: {note}") == 2  # before the run and under the table
    data = json.loads((tmp_path / "variance.json").read_text())
    assert data["smoke_test"] is True and data["note"] == note and data["config"]["smoke_test"] is True
    assert variance.smoke_note(variance.PRESETS["default"]) is None
    assert not any(p.smoke_test for name, p in variance.PRESETS.items() if name != "tiny")


def test_help_shows_each_presets_size_and_the_times_of_the_committed_record():
    """The times come from results/variance/presets.json (benchmarks/variance_presets.py), the sizes from the
    presets, and both agree with what the record's runs did."""
    from pathlib import Path

    from bayeslayer.cli import build_parser

    record = json.loads((Path(__file__).resolve().parents[2] / variance.MEASURED_RECORD).read_text())
    rows = {row["preset"]: row for row in record["rows"]}
    assert set(variance.PRESETS) == set(variance.MEASURED) and record["threads"] == 1
    assert set(rows) == {name for name, took in variance.MEASURED.items() if took}
    for name, row in rows.items():
        took = variance.MEASURED[name]
        assert took["cpu_seconds"] == round(row["command_cpu_seconds"])
        assert took["wall_seconds"] == round(row["command_seconds"])
        low, high = sorted((row["load_start"], row["load_end"]))
        assert took["load"] == (f"{low:.0f}" if f"{low:.0f}" == f"{high:.0f}" else f"{low:.0f}–{high:.0f}")
        preset = variance.PRESETS[name]
        assert row["seeds"] == preset.seeds
        assert row["tasks"]["recall"]["queries_per_seed"] == variance.presets.recall_queries(preset)
        assert row["tasks"]["mqar_update"]["queries_per_seed"] == variance.presets.mqar_queries(preset)
        if preset.recall_steps is not None:
            assert row["tasks"]["recall"]["train_steps"] == preset.recall_steps
    parser = build_parser()
    sub = next(a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    text = " ".join(sub.choices["variance"].format_help().split())
    for name in variance.PRESETS:
        assert f"'{name}'" in text
    assert "'tiny' (a smoke test: its numbers mean nothing)" in text
    assert all("not timed yet" in text for took in variance.MEASURED.values() if not took)
    assert f"≈ {variance.presets.duration(variance.MEASURED['default']['cpu_seconds'])}" in text
    assert variance.MEASURED_RECORD in " ".join(text.split())


def _summary(mean: float, *, auroc: dict | None = None) -> dict:
    cell = {"mean": mean, "std": 0.01, "values": [mean]}
    coverage = {"coverage": [(k + 1) / 10 for k in range(10)], "mean": [k / 10 for k in range(10)],
                "std": [0.0] * 10}
    return {"accuracy": cell, "auroc_variance_last": cell, "auroc_variance_mean": cell, "auroc_entropy": auroc,
            "auroc_combined": cell, "coverage_variance_last": coverage,
            "coverage_entropy": {**coverage, "mean": [1 - k / 10 for k in range(10)]}}


def test_table_lays_out_the_record_beside_its_plot():
    """``table(record)`` and ``abstention_table(record)`` are the record's Markdown tables, the layout the docs'
    table builder (tools/build_tables.py) writes: mean ± std to three decimals, "n/a" for a score with no AUROC,
    and the abstention accuracies at 10/30/50/70/100% coverage."""
    record = {"models": {"recall": {"label": "recall", "summary": _summary(0.5, auroc=None)},
                         "mqar_update": {"label": "MQAR Update", "summary": _summary(0.25, auroc=None)}}}
    lines = variance.table(record).split("\n")
    assert lines[0].startswith("| task | accuracy | AUROC variance (last layer) |")
    assert lines[1] == "|---|---|---|---|---|---|"
    assert lines[2] == "| recall | 0.500 ± 0.010 | 0.500 ± 0.010 | 0.500 ± 0.010 | n/a | 0.500 ± 0.010 |"
    assert len(lines) == 4 and lines[3].startswith("| MQAR Update | 0.250 ± 0.010 |")
    assert variance.abstention_table(record).split("\n") == [
        "| MQAR Update, coverage | 10% | 30% | 50% | 70% | 100% |", "|---|---|---|---|---|---|",
        "| abstain on high variance | 0.000 | 0.200 | 0.400 | 0.600 | 0.900 |",
        "| abstain on high entropy | 1.000 | 0.800 | 0.600 | 0.400 | 0.100 |"]
    with pytest.raises(ValueError, match="record: has no MQAR Update"):
        variance.abstention_table({"models": {"recall": record["models"]["recall"]}})
