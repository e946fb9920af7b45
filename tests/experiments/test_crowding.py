"""Random-key crowding: a tiny training run, the shared projection, JSON and plot, bad arguments."""

import json
from dataclasses import replace

import pytest
import torch

from bayeslayer.cli import main as cli_main
from bayeslayer.data.collision_tasks import crowding_projection
from bayeslayer.experiments import crowding
from bayeslayer.experiments.common.harness import TrainConfig, train

TINY = replace(crowding.PRESETS["tiny"], num_values=8, train_n=(8, 12), test_load=(1, 2), eval_sequences=4,
               steps=3, batch_size=4, num_queries=4)


@pytest.mark.parametrize("kind", ["bayesian", "linear_attention"])
def test_tiny_crowding_training_lowers_the_loss(kind):
    preset = replace(TINY, num_values=4, train_n=(4,), num_queries=4)
    torch.manual_seed(0)
    model = crowding.build_model(kind, preset)
    W = crowding_projection(preset.address_dim, preset.source_dim, preset.projection_seed)
    cfg = TrainConfig(steps=40, batch_size=16, lr=1e-2, warmup_steps=4)
    res = train(model, crowding.sampler(preset, W), cfg, progress=False)
    first, last = sum(res.losses[:5]) / 5, sum(res.losses[-5:]) / 5
    assert last < first - 0.3, (first, last)


def test_every_model_sees_the_same_projection_and_eval_set(tmp_path):
    record = crowding.run(crowding.CrowdingConfig(preset=TINY, models=["delta", "gla"], out=str(tmp_path),
                                                  progress=False))
    data = json.loads((tmp_path / "crowding.json").read_text())
    assert (tmp_path / "crowding.png").stat().st_size > 1000
    assert data["config"]["projection_seed"] == TINY.projection_seed
    for kind in ("delta", "gla"):
        s = data["models"][kind]["summary"]
        assert len(s["cross_entropy_vs_load"]["mean"]) == len(TINY.test_load)
        assert all(0 <= a <= 1 for a in s["accuracy_vs_load"]["mean"])
        assert all(c > 0 for c in s["cross_entropy_vs_load"]["mean"])
    assert record["models"]["gla"]["label"] == "GLA-style"
    # evaluation sets are fixed: evaluating the same model twice gives the same numbers
    model = crowding.build_model("delta", TINY).eval()
    W = crowding_projection(TINY.address_dim, TINY.source_dim, TINY.projection_seed)
    with torch.no_grad():
        a = crowding.final_evaluation(TINY, W)(model)
        b = crowding.final_evaluation(TINY, W)(model)
    assert a == b


def test_default_preset_covers_the_paper_loads():
    p = crowding.PRESETS["default"]
    assert set((6, 8, 12, 16)) <= set(p.test_load)
    assert p.train_n == (16, 32, 48, 64) and p.num_values == 64 and p.address_dim == 16 and p.source_dim == 64
    paper = crowding.PRESETS["paper"]
    assert (paper.steps, paper.batch_size, paper.seeds, paper.lr) == (2500, 256, 3, 3e-4)


def test_cli_plot_only_and_bad_arguments(tmp_path, capsys):
    crowding.run(crowding.CrowdingConfig(preset=TINY, models=["delta"], out=str(tmp_path), progress=False))
    (tmp_path / "crowding.png").unlink()
    assert cli_main(["crowding", "--plot-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "crowding.png").exists() and "query accuracy" in capsys.readouterr().out
    assert cli_main(["crowding", "--seeds", "-1", "--out", str(tmp_path)]) == 2
    assert "--seeds" in capsys.readouterr().err
    with pytest.raises(ValueError, match="models"):
        crowding.run(crowding.CrowdingConfig(preset=TINY, models=[], progress=False))
