"""``bayeslayer mqar``: the model, budget-matched mixers, learning a tiny MQAR, CLI/JSON shape, plots, bad input."""

import json
import os
from dataclasses import replace

import pytest
import torch

from bayeslayer.cli import main as cli_main
from bayeslayer.data.mqar import MQARTask, make_pool
from bayeslayer.evaluation.mqar import query_counts
from bayeslayer.experiments import mqar
from bayeslayer.experiments.common.harness import TrainConfig, train
from bayeslayer.experiments.common.plotting import load_json
from bayeslayer.experiments.mqar import (
    DEFAULT_MIXERS,
    PRESETS,
    MQARModel,
    MQARModelConfig,
    build_model,
    epoch_sampler,
    format_table,
    model_config,
    plot_mqar,
    sweep_points,
    train_tasks,
)

TINY = PRESETS["tiny"]


@pytest.mark.parametrize("mixer", DEFAULT_MIXERS)
@pytest.mark.parametrize("width", [16, 32])
def test_models_carry_exactly_the_solved_state(mixer, width):
    model = build_model(mixer, TINY, width)
    cfg, head = model_config(mixer, TINY, width)
    assert model.state_size_per_layer() == head.state_size <= TINY.budget
    assert head.usage >= 0.9
    logits = model(torch.randint(0, TINY.vocab_size, (2, 11)))
    assert logits.shape == (2, 11, TINY.vocab_size) and torch.isfinite(logits).all()


def test_bayesian_layer_pays_for_its_covariance_and_gdn_widens_its_values():
    preset = replace(TINY, budget=8192)
    _, bl = model_config("bayesian", preset, 64)
    _, gdn = model_config("gated_deltanet", preset, 64)
    assert (bl.num_heads, bl.key_dim, bl.value_dim) == (1, 64, 64)  # 64·64 mean + 64² covariance
    assert (gdn.num_heads, gdn.key_dim, gdn.value_dim) == (1, 64, 128)  # value dim widened to 128
    assert bl.state_size == gdn.state_size == 8192


def test_model_with_mlp_and_parameter_formula():
    cfg = MQARModelConfig("gated_deltanet_noconv", vocab_size=20, width=16, num_layers=2, mlp_mult=2,
                          mixer_kwargs={"num_heads": 2, "head_dim": 8, "expand_v": 1.0})
    model = MQARModel(cfg)
    V, d = 20, 16
    expected = (2 * V * d + V + 2 * 2 * d + 2 * d  # embedding, head, 2 mixer norms, final norm
                + sum(m.num_parameters_formula() for m in model.mixers)
                + 2 * (2 * 2 * d * d + 3 * d + 2 * d))  # 2 MLPs (weights, biases) and their norms
    assert sum(p.numel() for p in model.parameters()) == expected


def test_tasks_and_sweep_points_follow_the_spec():
    paper = PRESETS["paper"]
    upd = train_tasks("update", paper)
    assert {(t.seq_len, t.num_pairs) for t in upd} == {(64, 4), (128, 16)}
    assert len({t.num_updates for t in upd}) > 1  # mixed update counts
    points = sweep_points("update", paper)
    assert points[-1][0] == 16 and all(t.seq_len == 128 and t.num_pairs == 16 for _, t in points)
    blk = train_tasks("block", paper)
    assert [t.num_pairs for t in blk] == [2, 4, 6, 8] and {t.seq_len for t in blk} == {128}
    assert {t.block_size for t in blk} == {2}
    assert [x for x, _ in sweep_points("block", paper)][-1] == 16
    assert train_tasks("base", paper) == [MQARTask("base", 512, 64)]
    assert paper.vocab_size == 8192 and (paper.pool_base, paper.pool_update, paper.pool_block) == (
        100_000, 160_000, 120_000)
    assert (paper.epochs, paper.batch_size, paper.num_layers, paper.warmup_steps, paper.budget) == (
        40, 256, 2, 1024, 8192)
    assert len(paper.lrs) > 1
    assert paper.random_non_queries  # Zoology's random fillers; the CPU preset drops them (documented)
    cpu = PRESETS["default"]
    assert MQARTask("base", cpu.base_seq_len, cpu.base_num_pairs) in train_tasks("base", cpu)  # test task trained
    assert [x for x, _ in sweep_points("update", cpu)][-1] == 16 and cpu.update_test_pairs == 16
    assert [x for x, _ in sweep_points("block", cpu)][-1] == 16 and cpu.block_size == 2


def test_epoch_sampler_is_a_pure_function_of_the_step():
    train_ds, _ = make_pool([MQARTask("base", 16, 2), MQARTask("base", 24, 3)], num_examples=40,
                            vocab_size=16, seed=0)
    sample = epoch_sampler(train_ds, 4, data_seed=1)
    n = sample.steps_per_epoch
    assert n == train_ds.num_batches(4, drop_last=True)
    g = torch.Generator()
    epoch0 = [sample(s, 4, g).inputs for s in range(n)]
    seen = torch.cat([x.flatten() for x in epoch0])
    assert seen.numel() == sum(x.numel() for x in epoch0)
    assert {x.shape[1] for x in epoch0} == {16, 24}  # batches of one length each, both segments used
    later = sample(n + 2, 4, g).inputs  # another epoch, reshuffled
    again = epoch_sampler(train_ds, 4, data_seed=1)
    assert torch.equal(again(n + 2, 4, g).inputs, later)  # a resumed run sees the same batch
    assert torch.equal(again(3, 4, g).inputs, epoch0[3])


def test_harness_learns_a_tiny_mqar_instance():
    """The shared harness, the MQAR model and a registry mixer reach > 90% query accuracy in seconds.

    Vocabulary 16, length 16, 2 pairs, random fillers; about 20 s on an idle 2-core CPU.
    """
    torch.manual_seed(0)
    train_ds, val = make_pool([MQARTask("base", 16, 2)], num_examples=4000, vocab_size=16, seed=0)
    sample = epoch_sampler(train_ds, 32, data_seed=0)
    model = MQARModel(MQARModelConfig("gated_deltanet", vocab_size=16, width=32,
                                      mixer_kwargs={"num_heads": 2, "head_dim": 16, "chunk_size": 16}))
    cfg = TrainConfig(steps=300, batch_size=32, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, warmup_steps=15)
    with torch.no_grad():
        before = query_counts(model.eval(), val.segments[0], 300)["accuracy"]
    train(model, sample, cfg, progress=False)
    model.eval()
    with torch.no_grad():
        acc = query_counts(model, val.segments[0], 300)["accuracy"]
    assert before < 0.2 and acc > 0.9, (before, acc)


@pytest.fixture(scope="module")
def tiny_update(tmp_path_factory):
    """One tiny ``mqar update`` run through the CLI (two mixers), shared by the JSON and plot tests."""
    out = tmp_path_factory.mktemp("mqar")
    rc = cli_main(["mqar", "update", "--preset", "tiny", "--mixers", "bayesian", "gated_deltanet_noconv",
                   "--out", str(out), "--no-progress"])
    assert rc == 0
    return out


def test_cli_writes_json_of_the_documented_shape(tiny_update):
    record = load_json(tiny_update / "mqar_update.json")
    assert record["experiment"] == "mqar" and record["preset"] == "tiny"
    cfg = record["config"]
    assert cfg["task"] == "update" and cfg["sweep_axis"] == "number of updates"
    xs = [p["x"] for p in cfg["test_tasks"]]
    assert xs == list(TINY.update_test_updates)
    assert set(record["models"]) == {"bayesian", "gated_deltanet_noconv"}
    for res in record["models"].values():
        s = res["summary"]
        assert s["x"] == xs and len(s["accuracy"]["mean"]) == len(xs)
        assert all(0 <= a <= 1 for a in s["accuracy"]["mean"])
        (run,) = res["runs"]
        assert run["head_config"]["state_size"] <= TINY.budget and run["best_lr"] == TINY.lrs[0]
        assert run["lr_grid"][0]["score"] == run["seeds"][0]["val_accuracy"]
        seed = run["seeds"][0]
        assert {"val_accuracy", "val_by_segment", "test", "loss_curve", "train_seconds"} <= set(seed)
        point = seed["test"][-1]
        assert point["queries"] == TINY.test_examples * TINY.update_test_pairs
        slices = point["by_writes_of_queried_key"]
        assert sum(v["queries"] for v in slices.values()) == point["queries"]
        assert {v["num_updates"] for v in seed["val_by_segment"]} == {0, 2}
    assert record["paper_reported"]["x"] == 16
    assert (tiny_update / "mqar_update.png").stat().st_size > 0
    # finished runs are cached: a second call retrains nothing and gives the same numbers
    again = mqar.run(mqar.MQARConfig(task="update", preset=TINY, mixers=["gated_deltanet_noconv"],
                                     out=str(tiny_update), progress=False),
                     log=lambda *_: None)
    first = record["models"]["gated_deltanet_noconv"]["summary"]["accuracy"]["mean"]
    assert again["models"]["gated_deltanet_noconv"]["summary"]["accuracy"]["mean"] == first


def test_plot_only_redraws_from_the_json(tiny_update, capsys):
    png = tiny_update / "mqar_update.png"
    os.remove(png)
    assert cli_main(["mqar", "update", "--plot-only", "--out", str(tiny_update)]) == 0
    assert png.stat().st_size > 0
    out = capsys.readouterr().out
    assert "| BL |" in out and "paper (docs/theory.md §8.4)" in out
    # plot from an edited record: the figure is the JSON's, nothing is recomputed
    record = json.loads((tiny_update / "mqar_update.json").read_text())
    record["models"].pop("bayesian")
    path = plot_mqar(record, str(tiny_update / "edited.png"))
    assert os.path.getsize(path) > 0
    assert "BL" not in format_table(record).split("\n")[2]


@pytest.mark.parametrize("task", ["base", "block"])
def test_base_and_block_sweeps_run(task, tmp_path):
    record = mqar.run(mqar.MQARConfig(task=task, preset=TINY, mixers=["linear_attention"], out=str(tmp_path),
                                      progress=False),
                      log=lambda *_: None)
    s = record["models"]["linear_attention"]["summary"]
    expected = list(TINY.base_widths) if task == "base" else list(TINY.block_test_pairs)
    assert s["x"] == expected
    if task == "base":  # one model per width, each solved for the budget at its width
        runs = record["models"]["linear_attention"]["runs"]
        assert [r["width"] for r in runs] == expected
        assert all(r["head_config"]["width"] == r["width"] for r in runs)
    assert (tmp_path / f"mqar_{task}.png").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["mqar", "update", "--preset", "tiny", "--epochs", "0"],
        ["mqar", "update", "--preset", "tiny", "--lr", "-1"],
        ["mqar", "--preset", "tiny"],  # no task
    ],
)
def test_cli_bad_arguments(argv, tmp_path, capsys):
    assert cli_main(argv + ["--out", str(tmp_path), "--no-progress"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["mqar", "nosuchtask"], ["mqar", "base", "--preset", "nope"],
                                  ["mqar", "base", "--mixers", "nosuchmixer"]])
def test_cli_rejects_unknown_choices(argv):
    assert cli_main(argv) == 2


def test_plot_only_refuses_other_files(tmp_path, capsys):
    (tmp_path / "mqar_base.json").write_text(json.dumps({"experiment": "recall"}))
    assert cli_main(["mqar", "base", "--plot-only", "--out", str(tmp_path)]) == 2
    assert "not a mqar results file" in capsys.readouterr().err
    assert cli_main(["mqar", "update", "--plot-only", "--out", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bad_inputs():
    with pytest.raises(ValueError, match="task"):
        mqar.run(mqar.MQARConfig(task="lookup", preset=TINY, mixers=["bayesian"]))
    with pytest.raises(ValueError, match="mixers"):
        mqar.run(mqar.MQARConfig(task="base", preset=TINY, mixers=["bayesian", "bayesian"]))
    with pytest.raises(ValueError, match="mixers"):
        mqar.run(mqar.MQARConfig(task="base", preset=TINY, mixers=["attention"]))  # no recurrent state to budget
    with pytest.raises(TypeError, match="MQARPreset"):
        mqar.run(mqar.MQARConfig(task="base", preset={"vocab_size": 8}, mixers=["bayesian"]))
    with pytest.raises(ValueError, match="mixer"):
        MQARModelConfig("nosuch", vocab_size=8, width=8)
    with pytest.raises(ValueError, match="width"):
        MQARModelConfig("bayesian", vocab_size=8, width=0)
    with pytest.raises(ValueError, match="mlp_mult"):
        MQARModelConfig("bayesian", vocab_size=8, width=8, mlp_mult=-1)
    model = build_model("linear_attention", TINY, 16)
    with pytest.raises(TypeError, match="int64"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.full((1, 4), TINY.vocab_size))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        model(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="budget"):  # no BL head configuration fits 16 floats at width 16
        build_model("bayesian", replace(TINY, budget=16), 16)
    train_ds, _ = make_pool([MQARTask("base", 16, 2)], num_examples=10, vocab_size=16, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        epoch_sampler(train_ds, 64, data_seed=0)
