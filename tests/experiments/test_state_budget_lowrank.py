"""State-budget solver: the low-rank-plus-diagonal BL (state H·(D·m + G·D·(r + 1)))."""

from __future__ import annotations

import pytest

from bayeslayer.layers import BayesianLayer
from bayeslayer.models.state_budget import BUDGET_MIXERS as MIXERS
from bayeslayer.models.state_budget import match_state_budget, solve_state_budget


@pytest.mark.parametrize("rank,groups", [(0, 1), (4, 1), (16, 2)])
def test_state_counts_the_factor_and_matches_the_layer(rank, groups):
    cfg = solve_state_budget(4096, 64, "bayesian_lowrank", rank=rank, groups=groups)
    H, D, m, G = cfg.num_heads, cfg.key_dim, cfg.value_dim, cfg.groups
    assert cfg.rank == rank and G == groups and rank <= D
    assert cfg.state_size == H * (D * m + G * D * (rank + 1)) <= 4096
    assert cfg.to_dict()["rank"] == rank
    layer = BayesianLayer(64, num_heads=H, head_dim=D, expand_v=m / D, groups=G, covariance="lowrank", rank=rank)
    assert layer.state_size_per_head() * H == cfg.state_size
    assert f"({rank}+1)" in cfg.summary()


def test_rank_limits_the_head_dim_and_other_mixers_have_none():
    # at width 64, rank 48 only fits heads of D = 64
    assert solve_state_budget(8192, 64, "bayesian_lowrank", rank=48).key_dim == 64
    assert "rank" not in solve_state_budget(4096, 64, "bayesian").to_dict()
    assert "bayesian_lowrank" not in MIXERS  # the default list needs no rank
    both = match_state_budget(4096, 64, ["bayesian", "bayesian_lowrank"], rank=2, print_fn=None)
    assert both["bayesian"].rank is None and both["bayesian_lowrank"].rank == 2


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(mixer="bayesian_lowrank"), ValueError, "needs rank"),
    (dict(mixer="bayesian_lowrank", rank=-1), ValueError, "rank must be >= 0"),
    (dict(mixer="bayesian_lowrank", rank=2.0), TypeError, "rank must be an integer"),
    (dict(mixer="bayesian_lowrank", rank=True), TypeError, "rank must be an integer"),
    (dict(mixer="bayesian", rank=2), ValueError, "rank applies only to mixer 'bayesian_lowrank'"),
    (dict(mixer="bayesian_lowrank", rank=65), ValueError, "cannot hold a bayesian_lowrank layer"),
])
def test_bad_rank(kwargs, err, match):
    with pytest.raises(err, match=match):
        solve_state_budget(4096, 64, **kwargs)
