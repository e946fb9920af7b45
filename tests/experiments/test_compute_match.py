"""``--compute-match steps|flops|time`` on recall, crowding, mqar and lm train: every model gets the reference BL
run's FLOPs (within one step's worth) or its CPU time of the training steps, the schedule stretched to the new
length, the budget, steps, FLOPs and seconds in the JSON, and a resumed run keeps its plan."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bayeslayer.cli import main as cli_main
from bayeslayer.experiments.common import harness
from bayeslayer.experiments.common.harness import batch_generator, train
from bayeslayer.experiments.common.recall_task import PRESETS as RECALL
from bayeslayer.experiments.common.recall_task import build_model, sampler
from bayeslayer.experiments.recall import RecallConfig, run
from bayeslayer.training import compute_match
from bayeslayer.training.compute_match import Budget, steps_for_budget, stretch
from bayeslayer.training.loop import TrainConfig

# the tiny preset with smaller batches and evaluations: matching compute depends on neither, nor on the run's length
SMALL = replace(RECALL["tiny"], steps=10, batch_size=4, eval_sequences=4, test_n_f=(1, 8), test_rho=(0.95,),
                curve_sequences=2)


# -- the arithmetic ------------------------------------------------------------------------------------------
def test_steps_for_budget_is_nearest_and_within_half_a_step():
    costs = [3, 5, 4, 6, 2, 7]
    for budget in (1, 3, 7.9, 8, 10, 12, 15.1, 20, 26.9):
        n, spent = steps_for_budget(lambda s: costs[s % len(costs)], budget)
        assert spent == sum(costs[i % len(costs)] for i in range(n)) and n >= 1
        assert abs(spent - budget) <= max(costs) / 2
        for other in range(1, n + 3):  # no other step count comes nearer
            assert abs(sum(costs[i % len(costs)] for i in range(other)) - budget) >= abs(spent - budget)
    with pytest.raises(ValueError, match="budget"):
        steps_for_budget(lambda s: 1, 0)


def test_stretch_keeps_the_warmup_fraction_and_the_number_of_evaluations():
    base = TrainConfig(steps=600, warmup_steps=30, eval_every=60, checkpoint_every=100)
    for steps in (613, 1400, 250):
        cfg = stretch(base, steps)
        assert cfg.steps == steps and cfg.checkpoint_every == 100
        assert cfg.warmup_steps == round(30 * steps / 600)
        assert len(range(cfg.eval_every, steps, cfg.eval_every)) == len(range(60, 600, 60))
    assert stretch(base, 600) is base


# -- recall and crowding ------------------------------------------------------------------------------------
def _seeds(record, kind):
    return [s["compute"] for s in record["models"][kind]["seeds"]]


def test_recall_flops_match_within_one_step(tmp_path):
    """The Delta and GDN cores take the BL core's FLOPs, each seed's (test_recall_command_with_gdn runs the GDN
    core through the command line with -m slow, on the time budget)."""
    preset = replace(SMALL, seeds=2)
    record = run(RecallConfig(preset=preset, models=("delta", "bayesian", "gated_deltanet"), out=str(tmp_path),
                              progress=False, compute_match="flops"))
    assert record["compute_match"]["mode"] == "flops" and record["compute_match"]["reference"] == "bayesian"
    assert record["models"]["gated_deltanet"]["label"] == "GDN-style"
    for seed, budget in record["compute_match"]["budget_by_seed"].items():
        for kind in ("delta", "bayesian", "gated_deltanet"):
            c = _seeds(record, kind)[int(seed)]
            assert c["budget"]["flops"] == budget["flops"]
            assert abs(c["flops"] - budget["flops"]) <= c["max_step_flops"]  # within one step's FLOPs
            assert c["cpu_seconds"] > 0 and c["wall_seconds"] > 0
        assert _seeds(record, "bayesian")[int(seed)]["flops"] == budget["flops"]  # the reference spends it exactly
        assert _seeds(record, "bayesian")[int(seed)]["steps"] == preset.steps
        for kind in ("delta", "gated_deltanet"):  # cheaper models train longer (GDN: 1.11x cheaper than BL per step)
            assert _seeds(record, kind)[int(seed)]["steps"] > preset.steps
    gdn, delta = build_model("gated_deltanet", RECALL["tiny"]), build_model("delta", RECALL["tiny"])
    assert gdn.flops(4, 64).total > delta.flops(4, 64).total  # the decay's gate and its gradients cost FLOPs
    # the counts are what the models' flops() give for the batches each seed trains on
    delta = build_model("delta", preset)
    c = _seeds(record, "delta")[0]
    batches = [sampler(preset)(s, preset.batch_size, batch_generator(0, s)) for s in range(c["steps"])]
    assert c["flops"] == sum(delta.flops(*b.inputs.shape[:2]).total for b in batches)
    saved = json.loads((tmp_path / "recall.json").read_text())
    assert saved["compute_match"]["mode"] == "flops"
    assert saved["models"]["delta"]["summary"]["compute"]["steps"]["mean"] > preset.steps
    # seeds of different lengths are evaluated at the same fractions of their runs
    curve = saved["models"]["delta"]["summary"]["learning_curve"]
    assert len(curve["step"]) == preset.curve_points


def test_recall_time_match_and_a_resumed_plan(tmp_path, monkeypatch):
    preset = SMALL
    config = RecallConfig(preset=preset, models=("delta", "bayesian"), out=str(tmp_path), progress=False,
                          compute_match="time")
    record = run(config)
    assert list(record["models"]) == ["bayesian", "delta"]  # the reference trains first
    ref, other = _seeds(record, "bayesian")[0], _seeds(record, "delta")[0]
    budget = record["compute_match"]["budget_by_seed"]["0"]["cpu_seconds"]
    assert ref["budget"]["cpu_seconds"] == ref["cpu_seconds"] == budget and ref["steps"] == preset.steps
    assert other["budget"]["cpu_seconds"] == budget and other["calibration"]["steps"] == compute_match.CALIBRATION_STEPS
    # the steps whose predicted CPU time comes nearest the budget: within one predicted step
    assert abs(other["predicted_cpu_seconds"] - budget) <= other["predicted_max_step_cpu_seconds"]
    assert other["cpu_seconds"] > 0 and other["wall_seconds"] > 0
    assert record["compute_match"]["clock"].startswith("CPU time")
    plan = json.loads((tmp_path / "runs" / "recall_tiny_delta_seed0.plan.json").read_text())
    assert plan["steps"] == other["steps"]
    # a rerun whose seed result is gone (an interrupted run) reads the plan back instead of calibrating again
    (tmp_path / "runs" / "recall_tiny_delta_seed0.json").unlink()
    monkeypatch.setattr(harness, "_calibrate", lambda *a, **k: pytest.fail("calibrated again"))
    again = run(config)
    assert _seeds(again, "delta")[0]["steps"] == other["steps"]
    assert _seeds(again, "delta")[0]["calibration"] == other["calibration"]


def test_time_needs_the_reference_among_the_models():
    with pytest.raises(ValueError, match="include it in models"):
        RecallConfig(preset=RECALL["tiny"], models=("delta",), compute_match="time")
    with pytest.raises(ValueError, match="compute_match must be one of"):
        RecallConfig(preset=RECALL["tiny"], models=("delta",), compute_match="wall")


def test_the_loop_keeps_step_seconds_across_a_resume(tmp_path):
    """A run stopped and resumed counts the CPU and wall seconds of all its steps (the time budget of a resumed
    reference run is its whole run's)."""
    preset = RECALL["tiny"]
    cfg = TrainConfig(steps=6, batch_size=8, checkpoint_every=2)
    first = train(build_model("delta", preset), sampler(preset), cfg, checkpoint_path=tmp_path / "ck", stop_after=3,
                  progress=False)
    assert first.step == 3 and first.step_cpu_seconds > 0
    rest = train(build_model("delta", preset), sampler(preset), cfg, checkpoint_path=tmp_path / "ck", progress=False)
    assert rest.finished and rest.step_cpu_seconds > first.step_cpu_seconds
    assert rest.step_seconds > first.step_seconds


@pytest.mark.parametrize("mode", ["flops", pytest.param("time", marks=pytest.mark.slow)])
def test_crowding_command(tmp_path, mode):
    out = tmp_path / mode
    assert cli_main(["crowding", "--preset", "tiny", "--steps", "10", "--batch-size", "4", "--models", "bayesian",
                     "delta", "--compute-match", mode, "--out", str(out), "--no-progress"]) == 0
    record = json.loads((out / "crowding.json").read_text())
    assert record["compute_match"]["mode"] == mode
    for kind in ("bayesian", "delta"):
        c = _seeds(record, kind)[0]
        if mode == "flops":
            assert abs(c["flops"] - c["budget"]["flops"]) <= c["max_step_flops"]
        else:
            assert abs(c["predicted_cpu_seconds"] - c["budget"]["cpu_seconds"]) <= c["predicted_max_step_cpu_seconds"] \
                if kind == "delta" else c["budget"]["cpu_seconds"] == c["cpu_seconds"]


# the FLOPs budget of the GDN core: test_recall_flops_match_within_one_step (the same command line as the crowding
# command's, tested by test_crowding_command)
@pytest.mark.parametrize("mode", [pytest.param("time", marks=pytest.mark.slow)])
def test_recall_command_with_gdn(tmp_path, mode):
    """The GDN core in a compute-matched recall comparison: it takes BL's budget like the Delta core
    (test_recall_flops_match_within_one_step, test_recall_time_match_and_a_resumed_plan)."""
    out = tmp_path / mode
    assert cli_main(["recall", "--preset", "tiny", "--steps", "10", "--batch-size", "4", "--models", "bayesian",
                     "gated_deltanet", "--compute-match", mode, "--out", str(out), "--no-progress"]) == 0
    record = json.loads((out / "recall.json").read_text())
    assert record["compute_match"]["mode"] == mode and record["models"]["gated_deltanet"]["label"] == "GDN-style"
    ref = _seeds(record, "bayesian")[0]
    c = _seeds(record, "gated_deltanet")[0]
    assert c["budget"] == ref["budget"]
    assert abs(c["predicted_cpu_seconds"] - c["budget"]["cpu_seconds"]) <= c["predicted_max_step_cpu_seconds"]


def test_recall_command_refuses_time_without_the_reference(tmp_path, capsys):
    assert cli_main(["recall", "--preset", "tiny", "--models", "delta", "--compute-match", "time",
                     "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "include it in models" in err[0]


# -- MQAR ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["flops", pytest.param("time", marks=pytest.mark.slow)])
def test_mqar_update_hybrid_command(tmp_path, mode):
    out = tmp_path / mode
    assert cli_main(["mqar", "update", "--preset", "tiny", "--layout", "hybrid", "--mixers", "gated_deltanet",
                     "bayesian", "gated_deltanet_noconv", "--compute-match", mode, "--out", str(out),
                     "--no-progress"]) == 0
    record = json.loads((out / "mqar_update_hybrid.json").read_text())
    assert record["config"]["compute_match"] == mode and record["compute_match"]["mode"] == mode
    budgets = record["compute_match"]["budget_by_seed"]["w16_lr0.003"]["0"]
    for mixer, res in record["models"].items():
        c = res["runs"][0]["seeds"][0]["compute"]
        assert c["budget"]["flops"] == budgets["flops"] and res["runs"][0]["compute"]["steps"]["mean"] == c["steps"]
        if mode == "flops":
            assert abs(c["flops"] - budgets["flops"]) <= c["max_step_flops"]
        elif mixer != "bayesian":
            assert abs(c["predicted_cpu_seconds"] - budgets["cpu_seconds"]) <= c["predicted_max_step_cpu_seconds"]
        else:
            assert c["cpu_seconds"] == budgets["cpu_seconds"]


# -- the language model ---------------------------------------------------------------------------------------
def _lm_args(tmp_path, out, *extra):
    from .corpus import write_word_corpus

    source = write_word_corpus(tmp_path / "text", {"train": 20, "validation": 4, "test": 4}, sentences=10)
    return ["lm", "train", "--preset", "tiny", "--source", str(source), "--vocab-size", "280", "--hidden-size", "16",
            "--num-layers", "1", "--num-heads", "2", "--head-dim", "8", "--seq-len", "16", "--steps", "6",
            "--batch-size", "2", "--micro-batch-size", "2", "--warmup-steps", "1", "--eval-windows", "2",
            "--checkpoint-every", "2", "--cache-dir", str(tmp_path / "cache"), "--device", "cpu", "--no-progress",
            "--out", str(tmp_path / out), *extra]


def test_lm_flops_and_time(tmp_path, monkeypatch):
    assert cli_main(_lm_args(tmp_path, "gdn-flops", "--mixer", "gated_deltanet", "--match", "state",
                             "--compute-match", "flops")) == 0
    summary = json.loads((tmp_path / "gdn-flops" / "train_summary.json").read_text())
    c = summary["compute"]
    assert summary["compute_match"] == "flops" and summary["steps"] == c["steps"]
    assert abs(c["flops"] - c["budget"]["flops"]) <= c["max_step_flops"] and c["reference_steps"] == 6
    assert json.loads((tmp_path / "gdn-flops" / "config.json").read_text())["compute_match"] == "flops"
    # the reference BL run (steps) sets the time budget of the others
    assert cli_main(_lm_args(tmp_path, "bl")) == 0
    budget = json.loads((tmp_path / "bl" / "train_summary.json").read_text())["train_cpu_seconds"]
    assert budget > 0
    time_args = _lm_args(tmp_path, "gdn-time", "--mixer", "gated_deltanet", "--compute-match", "time",
                         "--reference-run", str(tmp_path / "bl"))
    assert cli_main(time_args + ["--stop-after", "2"]) == 0
    plan = json.loads((tmp_path / "gdn-time" / "compute_plan.json").read_text())["compute"]
    assert plan["budget"]["cpu_seconds"] == budget
    assert abs(plan["predicted_cpu_seconds"] - budget) <= plan["predicted_max_step_cpu_seconds"]
    # the resumed run keeps its plan: no second calibration, the same steps
    from bayeslayer.experiments import lm

    monkeypatch.setattr(lm, "calibration", lambda *a, **k: pytest.fail("calibrated again"))
    assert cli_main(time_args) == 0
    summary = json.loads((tmp_path / "gdn-time" / "train_summary.json").read_text())
    assert summary["steps"] == plan["steps"] and summary["compute"]["calibration"] == plan["calibration"]
    assert summary["compute"]["cpu_seconds"] > 0


def test_lm_time_needs_a_finished_reference(tmp_path, capsys):
    assert cli_main(_lm_args(tmp_path, "x", "--mixer", "gated_deltanet", "--compute-match", "time")) == 2
    assert "--reference-run" in capsys.readouterr().err
    assert cli_main(_lm_args(tmp_path, "x", "--compute-match", "flops", "--reference-run", str(tmp_path))) == 2
    assert cli_main(_lm_args(tmp_path, "y", "--mixer", "gated_deltanet", "--compute-match", "time",
                             "--reference-run", str(tmp_path / "text"))) == 2
    assert "train_summary.json" in capsys.readouterr().err


def test_budget_refuses_time_without_reference_seconds():
    with pytest.raises(ValueError, match="measured seconds"):
        Budget("time", "bayesian", is_reference=False, model_flops=len, reference_flops=len)
