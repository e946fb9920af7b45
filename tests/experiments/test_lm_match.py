"""``lm train --match state|params``: the state-budget solver sizes the value dim so every mixer carries the
default BL layer's recurrent state; the default (params) keeps the preset's head shape and config.json."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bayeslayer.cli import main as cli_main
from bayeslayer.experiments.common.lm_run import train_lm
from bayeslayer.experiments.lm import PRESETS, evaluate_run
from bayeslayer.models.state_budget import mixer_design
from bayeslayer.training.lm import build_model
from bayeslayer.training.lm_config import LMConfig, state_budget_per_layer, state_matched_kwargs
from tests.training.faults import tiny_lm

MATCHED = ("bayesian", "gated_deltanet", "gated_deltanet_noconv", "deltanet", "linear_attention")


def _layer_state(config: LMConfig) -> list[int]:
    """Each mixer layer's recurrent state, from the built layer's head shape and its DesignModel.state_size."""
    model = build_model(config, vocab_size=32)
    mixers = [m for m in model.modules() if hasattr(m, "head_v_dim") and hasattr(m, "head_dim")]
    assert len(mixers) == config.num_layers
    design = mixer_design(config.mixer)
    return [m.num_heads * design.state_size(m.head_dim, m.head_v_dim, getattr(m, "groups", 1)) for m in mixers]


@pytest.mark.parametrize("preset", ["tiny", "cpu"])
def test_matched_state_equals_bls_state_for_every_mixer(preset):
    base = PRESETS[preset]
    budget = state_budget_per_layer(base.num_heads, base.head_dim)
    bl = _layer_state(replace(base, mixer="bayesian", num_layers=1))
    assert bl == [budget]
    for mixer in MATCHED:
        matched = _layer_state(replace(base, mixer=mixer, num_layers=1, match="state"))
        # the solver rounds the value dim down; at these shapes nothing is lost (usage floor 90% otherwise)
        assert matched == [budget], (mixer, matched, budget)
    # parameter-matched (the default): GDN carries 2/3 of BL's state at the same head shape
    gdn = _layer_state(replace(base, mixer="gated_deltanet", num_layers=1))
    assert 3 * gdn[0] == 2 * bl[0]


def test_cpu_preset_budget_and_widths():
    cpu = PRESETS["cpu"]  # 4 heads of D = 64: BL 64·128 + 64² = 12,288 per head, GDN 64·128 = 8,192
    assert state_budget_per_layer(cpu.num_heads, cpu.head_dim) == 4 * 12288
    assert state_matched_kwargs("gated_deltanet", cpu.num_heads, cpu.head_dim) == {"expand_v": 3.0}
    # BL's matched-state shape is its parameter-matched one: the budget is its own state
    assert state_matched_kwargs("bayesian", cpu.num_heads, cpu.head_dim) == {"expand_v": 2.0}


def test_params_is_the_default_and_leaves_config_json_unchanged():
    assert PRESETS["cpu"].model.match == "params" and "match" not in PRESETS["cpu"].to_json()
    state = replace(PRESETS["cpu"], mixer="gated_deltanet", match="state")
    flat = state.to_json()
    assert flat["match"] == "state" and flat["mixer_kwargs"] == {"expand_v": 3.0}
    assert LMConfig.from_json(flat) == state
    assert state.model_label == "GDN (state-matched)"


def test_bad_match_values_and_clashes():
    with pytest.raises(ValueError, match="match must be one of"):
        replace(PRESETS["tiny"], match="flops")
    with pytest.raises(ValueError, match="--match state.*mamba2"):
        replace(PRESETS["tiny"], mixer="mamba2", match="state")
    with pytest.raises(ValueError, match="--match state sets .*expand_v"):
        replace(PRESETS["tiny"], mixer="gated_deltanet", mixer_kwargs={"expand_v": 2.0}, match="state")


def test_bad_match_on_the_command_line_is_one_line_naming_the_option(capsys):
    assert cli_main(["lm", "train", "--preset", "tiny", "--match", "flops"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--match" in err[0] and "params, state" in err[0]


def test_a_state_matched_run_records_the_match(tmp_path):
    config, cache = tiny_lm(tmp_path, mixer="gated_deltanet", match="state", steps=2)
    result = train_lm(config, tmp_path / "run", device="cpu", cache_dir=cache, progress=False)
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["match"] == "state" and summary["mixer_kwargs"] == {"expand_v": 3.0}
    assert json.loads((tmp_path / "run" / "config.json").read_text())["match"] == "state"
    record = evaluate_run(result.run_dir, split="validation", device="cpu", cache_dir=cache)
    assert record["match"] == "state" and record["label"] == "GDN (state-matched)"
