"""``LMConfig`` composes a model, a data and a training part, and still reads and writes the flat form
every run directory's ``config.json`` and ``final/lm_config.json`` holds."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bayeslayer.experiments.lm import PRESETS
from bayeslayer.training.lm_config import LM_TRAIN, LMConfig, LMDataConfig, LMModelConfig, check_resume_config
from bayeslayer.training.loop import TrainConfig

# `bayeslayer lm train --preset tiny`'s config.json as runs wrote it before LMConfig was composed (flat)
OLD_TINY_JSON = json.loads(
    '{"batch_size": 4, "betas": [0.9, 0.95], "checkpoint_every": 10, "eps": 1e-08, "eval_batch_size": 4, '
    '"eval_every": 10, "eval_windows": 4, "grad_clip": 1.0, "head_dim": 16, "hidden_size": 64, "label": "", '
    '"log_every": 5, "lr": 0.003, "micro_batch_size": 2, "min_lr_ratio": 0.1, "mixer": "bayesian", '
    '"mixer_kwargs": {}, "mlp_dropout": 0.0, "num_heads": 2, "num_layers": 2, "precision": "auto", '
    '"preset": "tiny", "seed": 0, "seq_len": 128, "source": "python-docs", "steps": 20, "tokenizer": null, '
    '"vocab_size": 8192, "warmup_steps": 2, "weight_decay": 0.1}')


def test_a_config_is_its_parts_and_reads_flat():
    config = LMConfig(model=LMModelConfig(mixer="mamba2", hidden_size=32), data=LMDataConfig(seq_len=64),
                      train=replace(LM_TRAIN, lr=1e-3, steps=10, warmup_steps=1), micro_batch_size=4)
    assert isinstance(config.train, TrainConfig) and config.train_config() is config.train
    assert (config.mixer, config.hidden_size, config.seq_len, config.lr, config.steps) == ("mamba2", 32, 64, 1e-3, 10)
    assert config.tokens_per_step == config.train.batch_size * 64
    flat = LMConfig(mixer="mamba2", hidden_size=32, seq_len=64, lr=1e-3, steps=10, warmup_steps=1, micro_batch_size=4)
    assert flat == config
    moved = replace(config, lr=3e-4, num_layers=2)  # a flat field replaces inside its part
    assert (moved.train.lr, moved.model.num_layers, moved.model.mixer, moved.train.steps) == (3e-4, 2, "mamba2", 10)


def test_the_flat_json_of_older_runs_reads_back_and_resumes(tmp_path: Path):
    old_tiny = replace(PRESETS["tiny"], source="python-docs")  # the tiny preset's corpus before python-docstrings
    config = LMConfig.from_json(OLD_TINY_JSON)
    assert config == old_tiny and config.train.betas == (0.9, 0.95)
    assert config.to_json() == OLD_TINY_JSON  # the same keys and values: config.json is unchanged
    check_resume_config(OLD_TINY_JSON, old_tiny, tmp_path)  # an old run directory resumes
    with pytest.raises(ValueError, match="lr: 0.003 → 0.001"):
        check_resume_config(OLD_TINY_JSON, replace(old_tiny, lr=1e-3), tmp_path)


def test_bad_parts_and_fields_are_named():
    with pytest.raises(TypeError, match=r"unknown fields \['nope'\]"):
        LMConfig(nope=1)
    with pytest.raises(ValueError, match=r"unknown LMConfig fields \['nope'\]"):
        LMConfig.from_json({**OLD_TINY_JSON, "nope": 1})
    with pytest.raises(TypeError, match="train must be a TrainConfig"):
        LMConfig(train={"lr": 1e-3})
    with pytest.raises(ValueError, match="mixer must be one of"):
        LMConfig(mixer="rnn")
    with pytest.raises(ValueError, match="seq_len must be an integer >= 2"):
        LMConfig(seq_len=1)
    with pytest.raises(ValueError, match=r"batch_size \(6\) must be a multiple of micro_batch_size \(4\)"):
        LMConfig(batch_size=6, micro_batch_size=4)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        PRESETS["tiny"].nope  # noqa: B018
