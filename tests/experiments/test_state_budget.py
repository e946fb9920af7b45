"""State-budget solver: configurations fit, fill the budget, are the best the rule admits; refusals."""

from __future__ import annotations

import argparse
import doctest
import json

import numpy as np
import pytest

from bayeslayer.design import get_design
from bayeslayer.experiments import state_budget
from bayeslayer.models import state_budget as solver
from bayeslayer.models.state_budget import (
    BUDGET_MIXERS,
    HeadConfig,
    match_state_budget,
    mixer_design,
    solve_state_budget,
)

MIXERS = BUDGET_MIXERS
# How each mixer's state is counted, written out here independently of the design models that the
# solver counts with (mixer_design(...).state_size): the brute force below checks one against the other.
STATE_FORMS = {
    "bayesian": "bayes", "diagonal_covariance": "diagonal", "deltanet": "mean", "gated_deltanet": "mean",
    "gated_deltanet_noconv": "mean", "kda": "mean", "linear_attention": "mean", "retnet": "mean", "gla": "mean",
    "mamba2": "ssd",
}


def test_every_mixer_is_counted_by_its_design_model():
    assert set(STATE_FORMS) == set(MIXERS)
    for mixer in MIXERS:
        cfg = solve_state_budget(8192, 64, mixer)
        assert cfg.form == STATE_FORMS[mixer]
        design = mixer_design(mixer)
        assert cfg.state_size == cfg.num_heads * design.state_size(cfg.key_dim, cfg.value_dim, cfg.groups)
    assert mixer_design("gated_deltanet_noconv").name == "gated_deltanet"  # the registry layer's design
    assert mixer_design("kda").name == "kda"  # not a registry layer: the design of that name
    assert mixer_design("bayesian_lowrank", 4).rank == 4

BUDGETS = [256, 1000, 2048, 4096, 8192, 12000, 16384]
WIDTHS = [16, 24, 32, 48, 64, 96, 100, 128, 256]


def brute_force_best(mixer: str, budget: int, width: int, groups: int = 1, expand: int = 2) -> int:
    """The largest state ≤ budget over every (H, D, m) the rule admits, by enumerating m; 0 if none fits."""
    form = STATE_FORMS[mixer]
    best = 0
    if form == "ssd":
        inner = expand * width
        for head_dim in range(1, inner + 1):
            if inner % head_dim:
                continue
            H = inner // head_dim
            d_state = np.arange(1, budget + 1)
            state = H * d_state * head_dim
            fits = state[state <= budget]
            best = max(best, int(fits.max()) if fits.size else 0)
        return best
    for H in range(1, width + 1):
        if width % H:
            continue
        D = width // H
        G = groups if form in ("bayes", "diagonal") else 1
        m = np.arange(G, budget + 1, G)
        cov = {"bayes": G * D * D, "diagonal": G * D, "mean": 0}[form]
        state = H * (D * m + cov)
        fits = state[state <= budget]
        best = max(best, int(fits.max()) if fits.size else 0)
    return best


def check_structure(cfg: HeadConfig, width: int, budget: int) -> None:
    assert cfg.state_size <= budget
    assert cfg.value_dim >= 1 and cfg.key_dim >= 1 and cfg.num_heads >= 1
    assert cfg.value_dim % cfg.groups == 0
    if cfg.form == "ssd":
        assert cfg.num_heads * cfg.value_dim == 2 * width  # d_inner = expand·width, split into heads
    else:
        assert cfg.num_heads * cfg.key_dim == width  # the model width split over the heads


def test_module_docstring_example_is_literal():
    tests = doctest.DocTestFinder().find(solver)
    runner = doctest.DocTestRunner()
    attempted = 0
    for t in tests:
        result = runner.run(t)
        assert result.failed == 0
        attempted += result.attempted
    assert attempted >= 2


@pytest.mark.parametrize("mixer", MIXERS)
def test_solver_fits_fills_and_is_optimal_over_a_range(mixer):
    solved = 0
    for budget in BUDGETS:
        for width in WIDTHS:
            best = brute_force_best(mixer, budget, width)
            try:
                cfg = solve_state_budget(budget, width, mixer)
            except ValueError as err:
                # refused only when nothing the rule admits fits, or the fullest uses < 90%
                assert best < 0.9 * budget, f"{mixer} {budget}/{width}: refused but {best} fits ({err})"
                assert str(budget) in str(err) and mixer in str(err)
                continue
            solved += 1
            check_structure(cfg, width, budget)
            assert cfg.usage >= 0.9
            assert cfg.state_size == best, f"{mixer} {budget}/{width}: {cfg.summary()}, best {best}"
    assert solved >= len(BUDGETS) * len(WIDTHS) // 2


@pytest.mark.parametrize("mixer", ["bayesian", "diagonal_covariance"])
@pytest.mark.parametrize("groups", [2, 3])
def test_grouped_covariance_fits_and_is_optimal(mixer, groups):
    # with G > 1 the value dim is rounded to a multiple of G, so the state depends on H: a real search
    for budget in BUDGETS:
        for width in WIDTHS:
            best = brute_force_best(mixer, budget, width, groups=groups)
            try:
                cfg = solve_state_budget(budget, width, mixer, groups=groups)
            except ValueError:
                assert best < 0.9 * budget
                continue
            check_structure(cfg, width, budget)
            assert cfg.groups == groups and cfg.usage >= 0.9 and cfg.state_size == best


@pytest.mark.parametrize("mixer", MIXERS)
def test_state_matches_the_closed_form(mixer):
    # ⌊⌊b/H⌋/(D·G)⌋ = ⌊b/(H·D·G)⌋: the state is width·G·⌊b/(width·G)⌋ (Mamba-2: d_inner·⌊b/d_inner⌋)
    groups = 2 if STATE_FORMS[mixer] in ("bayes", "diagonal") else 1
    for budget in BUDGETS:
        for width in WIDTHS:
            try:
                cfg = solve_state_budget(budget, width, mixer, groups=groups, min_usage=1e-9)
            except ValueError:
                continue
            unit = 2 * width if cfg.form == "ssd" else width * groups
            assert cfg.state_size == unit * (budget // unit)


def test_ties_go_to_the_head_dim_nearest_the_target():
    # at width 64 every head count fills 8,192 exactly; the target head dim decides
    assert solve_state_budget(8192, 64, "bayesian").key_dim == 64
    assert solve_state_budget(8192, 64, "bayesian", target_head_dim=16).key_dim == 16
    assert solve_state_budget(8192, 64, "gla", target_head_dim=8).num_heads == 8
    assert solve_state_budget(8192, 64, "mamba2", target_head_dim=32).value_dim == 32  # head_dim


@pytest.mark.parametrize(
    "mixer, width, expected",
    [
        ("bayesian", 64, (1, 64, 64)),
        ("bayesian", 128, (4, 32, 32)),  # D = 64 would leave m = 0 beside a 64² covariance per head
        ("bayesian", 256, (16, 16, 16)),
        ("gated_deltanet", 128, (2, 64, 64)),
        ("gated_deltanet_noconv", 64, (1, 64, 128)),
        ("mamba2", 128, (4, 32, 64)),  # d_inner 256 = 4 heads × 64, d_state 32
    ],
)
def test_paper_budget_configurations(mixer, width, expected):
    cfg = solve_state_budget(8192, width, mixer)
    assert (cfg.num_heads, cfg.key_dim, cfg.value_dim) == expected


@pytest.mark.parametrize("mixer", MIXERS)
@pytest.mark.parametrize("width", [32, 64, 128, 256, 512])
def test_paper_budget_is_filled_exactly_at_power_of_two_widths(mixer, width):
    cfg = solve_state_budget(8192, width, mixer)
    check_structure(cfg, width, 8192)
    assert cfg.state_size == 8192


@pytest.mark.parametrize("mixer", MIXERS)
def test_state_count_agrees_with_the_design_models(mixer):
    design = get_design("gated_deltanet" if mixer == "gated_deltanet_noconv" else mixer)
    for width in (48, 64, 128):
        cfg = solve_state_budget(8192, width, mixer)
        assert cfg.state_size == cfg.num_heads * design.state_size(cfg.key_dim, cfg.value_dim, cfg.groups)


def test_gated_deltanet_widens_its_value_dim_against_the_bayesian_layer():
    bl = solve_state_budget(8192, 128, "bayesian")
    gdn = solve_state_budget(8192, 128, "gated_deltanet", num_heads=bl.num_heads)
    assert (gdn.num_heads, gdn.key_dim) == (bl.num_heads, bl.key_dim)
    assert gdn.value_dim > bl.value_dim and gdn.state_size == bl.state_size == 8192
    assert bl.summary().endswith("(100.0%)") and "H=4" in bl.summary()


def test_groups_and_fixed_heads():
    cfg = solve_state_budget(8192, 128, "bayesian", groups=4)
    check_structure(cfg, 128, 8192)
    assert cfg.groups == 4 and cfg.value_dim % 4 == 0
    assert cfg.state_size == brute_force_best("bayesian", 8192, 128, groups=4)
    fixed = solve_state_budget(8192, 128, "bayesian", num_heads=8)
    assert (fixed.num_heads, fixed.key_dim, fixed.value_dim) == (8, 16, 48)  # 8·(16·48 + 16²) = 8192
    m2 = solve_state_budget(8192, 64, "mamba2", num_heads=8)
    assert (m2.num_heads, m2.value_dim, m2.key_dim) == (8, 16, 64)  # head_dim 16, d_state 64


def test_refuses_budgets_no_configuration_meets():
    with pytest.raises(ValueError, match=r"budget 100 floats cannot hold a bayesian layer.*needs 128"):
        solve_state_budget(100, 64, "bayesian")  # 64 heads of D = 1, m = 1: 64·(1 + 1)
    with pytest.raises(ValueError, match=r"budget 63 floats cannot hold a gated_deltanet layer.*needs 64"):
        solve_state_budget(63, 64, "gated_deltanet")
    with pytest.raises(ValueError, match=r"budget 127 floats cannot hold a mamba2 layer.*needs 128"):
        solve_state_budget(127, 64, "mamba2")
    with pytest.raises(ValueError, match=r"budget 8192 floats: the fullest configuration of a gla.*61\.0%"):
        solve_state_budget(8192, 5000, "gla")  # D·H = 5000 with m = 1: 61% of the budget
    with pytest.raises(ValueError, match=r"budget 4096 floats cannot hold a bayesian.*num_heads=1"):
        solve_state_budget(4096, 64, "bayesian", num_heads=1)  # D² = 4096 leaves nothing for the mean
    assert solve_state_budget(8192, 5000, "gla", min_usage=0.5).state_size == 5000


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(mixer="attention"), ValueError, "unknown mixer 'attention'"),
        (dict(budget=0), ValueError, "budget must be an integer >= 1"),
        (dict(budget=8192.0), TypeError, "budget must be an integer"),
        (dict(width=True), TypeError, "width must be an integer"),
        (dict(num_heads=3), ValueError, "num_heads=3 does not divide the width 64"),
        (dict(mixer="mamba2", num_heads=3), ValueError, r"expand·width = 2·64"),
        (dict(mixer="gla", groups=2), ValueError, "groups=2 applies only to mixers with a covariance"),
        (dict(min_usage=0.0), ValueError, "min_usage"),
        (dict(min_usage=1.5), ValueError, "min_usage"),
        (dict(min_usage=float("nan")), ValueError, "min_usage"),
        (dict(target_head_dim=0), ValueError, "target_head_dim"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    args = dict(budget=8192, width=64, mixer="bayesian") | kwargs
    with pytest.raises(exc, match=match):
        solve_state_budget(args.pop("budget"), args.pop("width"), args.pop("mixer"), **args)


def test_match_prints_sizes_and_serialises(capsys):
    configs = match_state_budget(8192, 128, groups=2)
    out = capsys.readouterr().out
    assert "state budget 8192 floats per layer, width 128" in out
    for mixer in MIXERS:
        assert mixer in out
    assert configs["bayesian"].groups == 2 and configs["gated_deltanet"].groups == 1
    row = json.loads(json.dumps(configs["bayesian"].to_dict()))
    assert row["state_size"] <= 8192 and row["usage"] == configs["bayesian"].usage


def test_command_line_writes_json(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    state_budget.add_parser(parser.add_subparsers())
    path = tmp_path / "budget.json"
    args = parser.parse_args(["state-budget", "--width", "64", "128", "--mixers", "bayesian", "mamba2",
                              "--json", str(path)])
    assert args.func(args) == 0
    rows = json.loads(path.read_text())
    assert [(r["mixer"], r["width"]) for r in rows] == [
        ("bayesian", 64), ("mamba2", 64), ("bayesian", 128), ("mamba2", 128)
    ]
    assert all(r["state_size"] == 8192 for r in rows)
    assert "d_state=" in capsys.readouterr().out
