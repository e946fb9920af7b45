"""Every synthetic experiment as ``run(config) -> record``: a tiny run of each, called directly, and the
config checks (a bad field raises an error that names it)."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partial

import pytest

from bayeslayer.experiments import collision, crowding, demo, mqar, recall, state_budget
from bayeslayer.experiments.common.recall_sweep import CorePreset

RECALL_TINY = replace(recall.PRESETS["tiny"], num_pairs=2, address_dim=4, n_b=2, train_n_f=(1, 2),
                      test_n_f=(1, 4), test_rho=(0.6, 0.9), test_n_f_for_rho=2, eval_sequences=4, steps=4,
                      batch_size=4, curve_points=2, curve_sequences=2, curve_n_f=(4,), curve_rho=(0.9,))
CROWDING_TINY = replace(crowding.PRESETS["tiny"], num_values=8, train_n=(8, 12), test_load=(1, 2),
                        eval_sequences=4, steps=3, batch_size=4, num_queries=4)
MQAR_TINY = replace(mqar.PRESETS["tiny"], max_steps=3)


# -- tiny runs --------------------------------------------------------------------------------------
def test_collision_run(tmp_path, monkeypatch):
    # the multi-pair sweep at n = 1, 2 instead of the command's 1, 2, 4, 8: its values at other n are checked by
    # tests/experiments/test_collision_lowrank.py (n = 1, 3); here the run's plumbing is
    monkeypatch.setattr(collision.command, "run_multi_pair", partial(collision.lowrank.run_multi_pair, pairs=(1, 2)))
    config = collision.CollisionConfig(fixed_priors=(0.05, 1.0), overlap_rhos=(0.5, 0.92), lowrank_ranks=(0, 2),
                                       rotation_seeds=(0,), b_repeats=(40,), out=str(tmp_path))
    record = collision.run(config)
    assert set(record) == {"collision", "chunk_agreement", "extra", "lowrank", "figures"}
    res = record["collision"]
    assert res["config"]["steps"] == 112 and res["overlap"]["rho"] == [0.5, 0.92]
    assert all(len(res["models"][m]["p_ab"]) == 112 for m in collision.MODELS)
    assert sorted(res["fixed_prior"]) == ["0.05", "1.00"]
    cf = res["closed_form"]
    assert cf["g_inf_simulated"] == pytest.approx(cf["g_inf"], abs=1e-12)
    # the fixed prior c = λ = 0.05 is the reset filter: the same final retrieval
    assert res["fixed_prior"]["0.05"]["final_p_ab"] == pytest.approx(res["models"]["reset"]["p_ab"][-1], abs=1e-12)
    assert max(record["chunk_agreement"].values()) < 1e-10
    assert record["extra"]["angle_vs_reinforcement"]["b_repeats"] == [40]
    assert record["extra"]["rotated_keys"]["seeds"] == [0]
    assert record["lowrank"]["ranks"] == [0, 2] and record["lowrank"]["multi_pair"]["pairs"] == [1, 2]
    for name, expected in (("collision.json", res), ("collision_lowrank.json", record["lowrank"])):
        saved = json.loads((tmp_path / name).read_text())  # the record, plus how and where it was made
        assert set(saved.pop("provenance")) >= {"git_commit", "command", "versions", "device"}
        assert saved == expected
    assert all((tmp_path / name).stat().st_size > 0 for name in collision.FIGURES + collision.LOWRANK_FIGURES)
    # the same numbers as the function the command called before the config existed
    assert res == collision.run_collision(fixed_priors=(0.05, 1.0), overlap_rhos=(0.5, 0.92))


@pytest.mark.slow  # a second collision run; test_collision_run above covers the run itself
def test_collision_run_without_out_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = collision.CollisionConfig(fixed_priors=(1.0,), overlap_rhos=(0.9,), lowrank_ranks=(1,),
                                       rotation_seeds=(3,), b_repeats=(2,))
    record = collision.run(config)
    assert "figures" not in record and list(tmp_path.iterdir()) == []
    assert record["collision"]["overlap"]["rho"] == [0.9]


def test_recall_run(tmp_path):
    record = recall.run(recall.RecallConfig(preset=RECALL_TINY, models=("delta",), out=str(tmp_path),
                                            progress=False))
    assert record["experiment"] == "recall" and list(record["models"]) == ["delta"]
    res = record["models"]["delta"]
    assert res["label"] == "Delta-style"
    s = res["summary"]
    assert len(s["accuracy_vs_n_f"]["mean"]) == 2 and len(s["margin_vs_rho"]["mean"]) == 2
    assert all(0 <= a <= 1 for a in s["accuracy_vs_n_f"]["mean"])
    assert all(-1 <= m <= 1 for m in s["margin_vs_rho"]["mean"])
    assert s["learning_curve"]["step"] == [2, 4]
    assert record["config"]["train"]["steps"] == 4 and record["config"]["train"]["eval_every"] == 2
    assert json.loads((tmp_path / "recall.json").read_text())["models"]["delta"]["summary"] == s
    assert (tmp_path / "recall.png").stat().st_size > 0


def test_crowding_run():
    record = crowding.run(crowding.CrowdingConfig(preset=CROWDING_TINY, models=["linear_attention"],
                                                  progress=False))
    assert record["experiment"] == "crowding" and record["config"]["train"]["eval_every"] == 0
    s = record["models"]["linear_attention"]["summary"]
    assert len(s["cross_entropy_vs_load"]["mean"]) == len(CROWDING_TINY.test_load)
    assert all(c > 0 for c in s["cross_entropy_vs_load"]["mean"])
    assert all(0 <= a <= 1 for a in s["accuracy_vs_load"]["mean"])
    assert "learning_curve" not in s


def test_mqar_run():
    record = mqar.run(mqar.MQARConfig(task="update", preset=MQAR_TINY, mixers=("linear_attention",),
                                      progress=False), log=lambda *_: None)
    assert record["experiment"] == "mqar" and record["config"]["task"] == "update"
    assert record["config"]["train"]["steps"] == 3 and record["device"] == "cpu"
    res = record["models"]["linear_attention"]
    assert res["summary"]["x"] == list(MQAR_TINY.update_test_updates)
    assert all(0 <= a <= 1 for a in res["summary"]["accuracy"]["mean"])
    (run,) = res["runs"]
    assert run["head_config"]["state_size"] <= MQAR_TINY.budget and run["best_lr"] == MQAR_TINY.lrs[0]


def test_state_budget_run(tmp_path):
    path = tmp_path / "sizes" / "budget.json"
    lines = []
    config = state_budget.StateBudgetConfig(budget=8192, widths=(64,), mixers=("bayesian", "gated_deltanet"),
                                            json=str(path))
    record = state_budget.run(config, print_fn=lines.append)
    assert [(r["mixer"], r["state_size"]) for r in record] == [("bayesian", 8192), ("gated_deltanet", 8192)]
    assert record[1]["value_dim"] == 128 and lines[0].startswith("state budget 8192")
    assert json.loads(path.read_text()) == record


def test_demo_run():
    record = demo.run(demo.DemoConfig(T=40, D=4, m=3, H=1))
    assert (record["T"], record["D"], record["m"], record["H"]) == (40, 4, 3, 1)
    assert record["max_abs_diff_output"] < 1e-10 and record["max_abs_diff_state"] < 1e-10
    assert 1.0 <= record["variance_min"] <= record["variance_max"]


# -- config checks ------------------------------------------------------------------------------------
BAD_CONFIGS = [
    (lambda: collision.CollisionConfig(rho=1.0), "rho"),
    (lambda: collision.CollisionConfig(r2=0.0), "r2"),
    (lambda: collision.CollisionConfig(ell2="x"), "ell2"),
    (lambda: collision.CollisionConfig(fixed_priors=()), "fixed_priors"),
    (lambda: collision.CollisionConfig(fixed_priors=(0.1, 0.1)), "fixed_priors"),
    (lambda: collision.CollisionConfig(overlap_rhos=(0.5, 1.5)), "overlap_rhos"),
    (lambda: collision.CollisionConfig(lowrank_ranks=(-1,)), "lowrank_ranks"),
    (lambda: collision.CollisionConfig(rotation_seeds=(0.5,)), "rotation_seeds"),
    (lambda: collision.CollisionConfig(b_repeats=(0,)), "b_repeats"),
    (lambda: collision.CollisionConfig(out=3), "out"),
    (lambda: recall.RecallConfig(preset=CROWDING_TINY), "preset"),
    (lambda: recall.RecallConfig(preset=replace(RECALL_TINY, steps=0)), "preset.steps"),
    (lambda: recall.RecallConfig(preset=replace(RECALL_TINY, seeds=1.5)), "preset.seeds"),
    (lambda: recall.RecallConfig(models=()), "models"),
    (lambda: recall.RecallConfig(models=("mamba",)), "models"),
    (lambda: recall.RecallConfig(models="delta"), "models"),
    (lambda: recall.RecallConfig(out=1), "out"),
    (lambda: recall.RecallConfig(progress="yes"), "progress"),
    (lambda: crowding.CrowdingConfig(preset=RECALL_TINY), "preset"),
    (lambda: crowding.CrowdingConfig(models=("delta", "nope")), "models"),
    (lambda: mqar.MQARConfig(task="lookup"), "task"),
    (lambda: mqar.MQARConfig(task="base", preset={"vocab_size": 8}), "preset"),
    (lambda: mqar.MQARConfig(task="base", preset=MQAR_TINY, mixers=("bayesian", "bayesian")), "mixers"),
    (lambda: mqar.MQARConfig(task="base", preset=MQAR_TINY, mixers=("attention",)), "mixers"),
    (lambda: mqar.MQARConfig(task="base", preset=MQAR_TINY, mixers="bayesian"), "mixers"),
    (lambda: mqar.MQARConfig(task="base", preset=MQAR_TINY, device="tpu:x"), "device"),
    (lambda: mqar.MQARConfig(task="base", preset=MQAR_TINY, device=0), "device"),
    (lambda: mqar.MQARConfig(task="base", preset=MQAR_TINY, out=2), "out"),
    (lambda: mqar.MQARConfig(task="base", preset=MQAR_TINY, progress=None), "progress"),
    (lambda: state_budget.StateBudgetConfig(budget=0), "budget"),
    (lambda: state_budget.StateBudgetConfig(widths=()), "widths"),
    (lambda: state_budget.StateBudgetConfig(widths=(64, -1)), "widths"),
    (lambda: state_budget.StateBudgetConfig(mixers=("attention",)), "mixers"),
    (lambda: state_budget.StateBudgetConfig(rank=-1), "rank"),
    (lambda: state_budget.StateBudgetConfig(num_heads=0), "num_heads"),
    (lambda: state_budget.StateBudgetConfig(groups=0), "groups"),
    (lambda: state_budget.StateBudgetConfig(min_usage=1.5), "min_usage"),
    (lambda: state_budget.StateBudgetConfig(target_head_dim=True), "target_head_dim"),
    (lambda: state_budget.StateBudgetConfig(json=5), "json"),
    (lambda: demo.DemoConfig(T=0), "T"),
    (lambda: demo.DemoConfig(H=2.0), "H"),
    (lambda: demo.DemoConfig(seed=-1), "seed"),
]


@pytest.mark.parametrize(("make", "field"), BAD_CONFIGS, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD_CONFIGS)])
def test_a_bad_field_is_named(make, field):
    with pytest.raises((TypeError, ValueError), match=field):
        make()


@pytest.mark.parametrize("run", [collision.run, recall.run, crowding.run, mqar.run, state_budget.run, demo.run])
def test_run_takes_its_own_config_only(run):
    with pytest.raises(TypeError, match="config must be"):
        run({"preset": "tiny"})
    with pytest.raises(TypeError, match="config must be"):
        run(demo.DemoConfig() if run is not demo.run else state_budget.StateBudgetConfig())


def test_configs_default_to_the_commands_defaults():
    c = collision.CollisionConfig()
    assert (c.rho, c.p0, c.r2, c.ell2) == tuple(collision.PAPER_CONFIG[k] for k in ("rho", "p0", "r2", "ell2"))
    assert recall.RecallConfig().preset == recall.PRESETS["default"]
    assert crowding.CrowdingConfig().models == ("bayesian", "delta", "linear_attention", "gla")
    assert mqar.MQARConfig(task="update", preset=MQAR_TINY).mixers == mqar.DEFAULT_MIXERS
    assert state_budget.StateBudgetConfig().budget == state_budget.PAPER_STATE_BUDGET


def test_one_train_config_for_both_core_presets():
    # recall and crowding presets share CorePreset's train_config; recall adds only the evaluation period
    assert "train_config" not in vars(recall.RecallPreset) and "train_config" not in vars(crowding.CrowdingPreset)
    assert issubclass(recall.RecallPreset, CorePreset) and issubclass(crowding.CrowdingPreset, CorePreset)
    r, c = recall.PRESETS["default"].train_config(), crowding.PRESETS["default"].train_config()
    assert (r.steps, r.warmup_steps, r.eval_every) == (600, 30, 60)
    assert (c.steps, c.warmup_steps, c.eval_every) == (800, 40, 0)
    assert replace(recall.PRESETS["tiny"], curve_points=0).train_config().eval_every == 0
