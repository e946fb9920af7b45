"""``bayeslayer recall --preset long`` and the learning curves every recall run records."""

from __future__ import annotations

import json
from dataclasses import fields, replace

import pytest
import torch

from bayeslayer.cli import build_parser
from bayeslayer.cli import main as cli_main
from bayeslayer.experiments import recall
from bayeslayer.experiments.common.recall_sweep import learning_curve

TINY = replace(recall.PRESETS["tiny"], num_pairs=2, address_dim=4, n_b=2, train_n_f=(1, 2), test_n_f=(1, 4),
               test_rho=(0.6, 0.9), test_n_f_for_rho=2, eval_sequences=4, steps=4, batch_size=4,
               curve_points=2, curve_sequences=2, curve_n_f=(4, 8), curve_rho=(0.8, 0.95))


def test_long_is_the_default_with_more_steps_and_nothing_else():
    default, long = recall.PRESETS["default"], recall.PRESETS["long"]
    assert long.steps >= 3 * default.steps
    differing = {f.name for f in fields(recall.RecallPreset) if getattr(long, f.name) != getattr(default, f.name)}
    assert differing == {"name", "steps"}
    # the training configs differ only where the step count enters: steps, warmup (a fraction) and the
    # evaluation period (a fixed number of curve points per run)
    a, b = default.train_config(), long.train_config()
    assert (b.warmup_steps, b.eval_every) == (3 * a.warmup_steps, 3 * a.eval_every)
    assert replace(b, steps=a.steps, warmup_steps=a.warmup_steps, eval_every=a.eval_every) == a
    assert a.steps // a.eval_every == b.steps // b.eval_every == default.curve_points


def test_run_records_learning_curves_in_the_json(tmp_path):
    recall.run(recall.RecallConfig(preset=TINY, models=["delta", "bayesian"], out=str(tmp_path), progress=False))
    data = json.loads((tmp_path / "recall.json").read_text())
    keys = {"val_accuracy", "val_loss", "accuracy_n_f_4", "accuracy_n_f_8", "margin_rho_0.8", "margin_rho_0.95"}
    assert data["config"]["train"]["eval_every"] == 2 and "_no_weight_decay" in data["config"]["optimizer_groups"]
    for res in data["models"].values():
        (seed,) = res["seeds"]
        assert [e["step"] for e in seed["evals"]] == [2, 4]  # every steps // curve_points, and the end
        assert all(keys <= set(e) for e in seed["evals"])
        assert all(0 <= e["val_accuracy"] <= 1 and e["val_loss"] > 0 and -1 <= e["margin_rho_0.95"] <= 1
                   for e in seed["evals"])
        lc = res["summary"]["learning_curve"]
        assert lc["step"] == [2, 4] and keys <= set(lc)
        assert lc["val_loss"]["mean"] == [e["val_loss"] for e in seed["evals"]]
    assert (tmp_path / "recall.png").stat().st_size > 1000


def test_monitoring_sets_are_fixed_across_steps():
    """The same model scored twice gives the same numbers: the curve moves only when the model does."""
    model = recall.build_model("delta", TINY)
    evaluate = recall.curve_evaluation(TINY)
    with torch.no_grad():  # as the harness calls it
        assert evaluate(model.eval()) == evaluate(model)


def test_learning_curve_summary_and_its_errors():
    evals = [[{"step": 1, "a": 0.0}, {"step": 2, "a": 1.0}], [{"step": 1, "a": 1.0}, {"step": 2, "a": 1.0}]]
    lc = learning_curve(evals)
    assert lc["step"] == [1, 2] and lc["a"]["mean"] == [0.5, 1.0]
    with pytest.raises(ValueError, match="same"):
        learning_curve([[{"step": 1, "a": 0.0}], [{"step": 2, "a": 0.0}]])
    with pytest.raises(ValueError, match="same"):
        learning_curve([[]])


def test_cli_takes_the_long_preset_and_prints_the_curves(tmp_path, capsys):
    args = build_parser().parse_args(["recall", "--preset", "long", "--models", "bayesian", "delta"])
    assert args.preset == "long" and args.models == ["bayesian", "delta"]
    assert cli_main(["recall", "--preset", "longer"]) == 2  # one line on stderr, exit 2 (bayeslayer.errors)
    assert "invalid choice: 'longer'" in capsys.readouterr().err
    recall.run(recall.RecallConfig(preset=TINY, models=["delta"], out=str(tmp_path), progress=False))
    assert cli_main(["recall", "--plot-only", "--out", str(tmp_path)]) == 0
    assert "learning curve: val_accuracy" in capsys.readouterr().out
