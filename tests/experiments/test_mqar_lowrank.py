"""``bayeslayer mqar`` with the low-rank-plus-diagonal BL (``bayesian_lowrank<r>``) at the state budget."""

from __future__ import annotations

import pytest

from bayeslayer.experiments.mqar import PRESETS, MQARConfig, build_model, model_config, run
from bayeslayer.layers import BayesianLayer

TINY = PRESETS["tiny"]


@pytest.mark.parametrize("rank", [0, 2, 8])
def test_lowrank_model_carries_exactly_the_solved_state(rank):
    cfg, head = model_config(f"bayesian_lowrank{rank}", TINY, 16)
    assert cfg.mixer == "bayesian" and cfg.mixer_kwargs["covariance"] == "lowrank"
    assert cfg.mixer_kwargs["rank"] == rank == head.rank
    model = build_model(f"bayesian_lowrank{rank}", TINY, 16)
    assert isinstance(model.mixers[0], BayesianLayer)
    assert model.state_size_per_layer() == head.state_size <= TINY.budget


def test_tiny_update_run(tmp_path):
    record = run(MQARConfig(task="update", preset=TINY, mixers=["bayesian_lowrank2"], out=str(tmp_path),
                            progress=False),
                      log=lambda *a: None)
    res = record["models"]["bayesian_lowrank2"]
    assert res["label"] == "BL low-rank r=2"
    assert res["runs"][0]["head_config"]["rank"] == 2
    assert all(0 <= a <= 1 for a in res["summary"]["accuracy"]["mean"])


def test_bad_names():
    with pytest.raises(ValueError, match="bayesian_lowrank<r>"):
        run(MQARConfig(task="update", preset=TINY, mixers=["bayesian_lowrankx"], progress=False), log=lambda *a: None)
    with pytest.raises(ValueError, match="cannot hold a bayesian_lowrank layer"):
        model_config("bayesian_lowrank17", TINY, 16)
