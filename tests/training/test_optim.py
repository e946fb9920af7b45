"""Parameter groups: the harness and LM optimisers decay weights and never the recurrence's own parameters."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from bayeslayer.experiments.common import harness, lm_run
from bayeslayer.experiments.mqar import PRESETS as MQAR_PRESETS
from bayeslayer.experiments.mqar import build_model as build_mqar
from bayeslayer.layers import build_mixer
from bayeslayer.training import lm_config
from bayeslayer.training import loop as training_loop
from bayeslayer.training.optim import decay_split, param_groups

from ..experiments.corpus import write_word_corpus

# Parameters that must never be decayed, by their local name, in the mixers used by the experiments.
EXEMPT_LOCAL = {"A_log", "dt_bias", "r2_bias", "ell2_bias", "theta_bias", "D", "bias"}


class _Recording(torch.optim.AdamW):
    """AdamW that remembers the last instance built (the optimiser a training function makes internally)."""

    last: torch.optim.Optimizer | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        type(self).last = self


def _decay_of(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, float]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            out[by_id[id(p)]] = group["weight_decay"]
    return out


def _check_decays(decays: dict[str, float], model: nn.Module, weight_decay: float) -> None:
    """Every trainable parameter is in the optimiser once, with 0 for exempt ones and ``weight_decay`` else."""
    owners = {}
    for mname, module in model.named_modules():
        for local, p in module.named_parameters(recurse=False):
            owners[f"{mname}.{local}" if mname else local] = (module, local, p)
    assert set(decays) == {n for n, p in model.named_parameters() if p.requires_grad}
    for name, wd in decays.items():
        module, local, p = owners[name]
        exempt = (local in EXEMPT_LOCAL or local.endswith("_bias") or getattr(p, "_no_weight_decay", False)
                  or isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__ == "GatedRMSNorm")
        assert wd == (0.0 if exempt else weight_decay), (name, wd)


def test_groups_exempt_flagged_norm_and_bias_parameters():
    model = nn.ModuleDict({
        "bl": build_mixer("bayesian", 16, num_heads=2, head_dim=8, dynamics="rotation"),
        "gdn": build_mixer("gated_deltanet", 16, num_heads=2, head_dim=8),
        "m2": build_mixer("mamba2", 16, num_heads=2, head_dim=8, state_size=4),
        "ln": nn.LayerNorm(16), "lin": nn.Linear(16, 4), "emb": nn.Embedding(5, 16),
    })
    split = decay_split(model)
    for name in ("bl.A_log", "bl.dt_bias", "bl.r2_bias", "bl.ell2_bias", "bl.theta_bias", "gdn.A_log",
                 "gdn.dt_bias", "m2.A_log", "m2.dt_bias", "m2.D"):
        assert split[name] == "flagged", name
    assert split["ln.weight"] == "norm"
    assert split["bl.o_norm.weight"] == split["m2.norm.weight"] == "flagged"  # the package's norm flags its gain
    assert split["lin.bias"] == "bias" and split["m2.conv1d.bias"] == "bias"
    for name in ("lin.weight", "emb.weight", "bl.q_proj.weight", "bl.r2_proj.weight", "gdn.a_proj.weight",
                 "m2.in_proj.weight", "m2.conv1d.weight", "bl.q_conv1d.weight"):
        assert split[name] is None, name
    groups = param_groups(model, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    _check_decays(_decay_of(torch.optim.AdamW(groups), model), model, 0.1)


def test_caller_groups_keep_their_options_and_an_explicit_decay():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    fixed = {"params": list(model[2].parameters()), "weight_decay": 0.5, "lr": 1.0}
    groups = param_groups(model, 0.1, [{"params": list(model[0].parameters()) + list(model[1].parameters()),
                                        "lr": 2.0}, fixed])
    assert [(len(g["params"]), g["weight_decay"], g["lr"]) for g in groups] == [(1, 0.1, 2.0), (3, 0.0, 2.0),
                                                                              (2, 0.5, 1.0)]
    assert groups[0]["params"][0] is model[0].weight


def test_tied_and_frozen_parameters():
    emb, head = nn.Embedding(6, 4), nn.Linear(4, 6, bias=False)
    head.weight = emb.weight
    frozen = nn.Linear(4, 4)
    frozen.requires_grad_(False)
    model = nn.ModuleDict({"emb": emb, "head": head, "frozen": frozen})
    assert decay_split(model) == {"emb.weight": None}
    assert len(param_groups(model, 0.1)) == 1


@pytest.mark.parametrize("bad, err", [(-0.1, ValueError), (math.nan, ValueError), (True, ValueError),
                                      ("0.1", ValueError)])
def test_bad_weight_decay(bad, err):
    with pytest.raises(err, match="weight_decay"):
        param_groups(nn.Linear(2, 2), bad)


def test_bad_groups():
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    with pytest.raises(TypeError, match="model"):
        decay_split("model")
    with pytest.raises(TypeError, match="groups"):
        param_groups(model, 0.1, {"params": list(model.parameters())})
    with pytest.raises(ValueError, match="not a trainable parameter"):
        param_groups(model, 0.1, [{"params": list(other.parameters())}])
    with pytest.raises(ValueError, match="two groups"):
        param_groups(model, 0.1, [{"params": [model.weight]}, {"params": [model.weight]}])


@pytest.mark.parametrize("mixer", ["bayesian", "gated_deltanet", "mamba2"])
def test_harness_optimizer_exempts_the_recurrence_parameters(monkeypatch, mixer):
    """``harness.train`` (every synthetic experiment: MQAR, recall, crowding) builds its AdamW from the groups."""
    monkeypatch.setattr(torch.optim, "AdamW", _Recording)
    preset = MQAR_PRESETS["tiny"]
    model = build_mqar(mixer, preset, 16)
    batch = type("Batch", (), {"inputs": torch.randint(0, preset.vocab_size, (2, 8)),
                               "labels": torch.randint(0, preset.vocab_size, (2, 8))})
    cfg = harness.TrainConfig(steps=1, batch_size=2, lr=1e-3, weight_decay=0.1)
    harness.train(model, lambda step, size, gen: batch, cfg, progress=False)
    decays = _decay_of(_Recording.last, model)
    _check_decays(decays, model, 0.1)
    assert decays["mixers.0.A_log"] == decays["mixers.0.dt_bias"] == 0.0
    assert decays["mixers.0.out_proj.weight" if mixer == "mamba2" else "mixers.0.o_proj.weight"] == 0.1


def test_harness_decays_weights_and_leaves_exempt_parameters_alone():
    """Behaviour, not bookkeeping: with a zero gradient only decay moves a parameter (AdamW: p ← p·(1 − lr·λ))."""

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3, 3))
            self.A_log = nn.Parameter(torch.ones(3))
            self.A_log._no_weight_decay = True
            self.norm = nn.LayerNorm(3)
            self.head = nn.Linear(3, 4)

        def forward(self, x):  # the probes enter with weight 0: zero gradient, yet not None
            h = self.head(torch.zeros(x.shape + (3,)))
            return h + 0 * (self.weight.sum() + self.A_log.sum() + self.norm.weight.sum())

    model = Probe()
    with torch.no_grad():
        model.norm.weight.fill_(2.0)
    batch = type("Batch", (), {"inputs": torch.zeros(2, 5), "labels": torch.zeros(2, 5, dtype=torch.long)})
    cfg = harness.TrainConfig(steps=1, batch_size=2, lr=0.5, weight_decay=0.2)
    harness.train(model, lambda step, size, gen: batch, cfg, progress=False)
    torch.testing.assert_close(model.weight, torch.full((3, 3), 1 - 0.5 * 0.2))
    torch.testing.assert_close(model.A_log, torch.ones(3))
    torch.testing.assert_close(model.norm.weight, torch.full((3,), 2.0))


@pytest.mark.parametrize("mixer", ["bayesian", "mamba2"])
def test_lm_optimizer_exempts_the_recurrence_parameters(monkeypatch, tmp_path: Path, mixer):
    """``train_lm`` (from-scratch LM, and the retrofit's objectives) builds its AdamW from the groups too."""
    corpus = write_word_corpus(tmp_path / "text", {"train": 8, "validation": 2, "test": 2}, sentences=6)
    config = lm_config.LMConfig(preset="test", mixer=mixer, hidden_size=32, num_layers=1, num_heads=2, head_dim=8,
                         source=str(corpus), vocab_size=300, seq_len=16, steps=1, batch_size=2,
                         micro_batch_size=2, lr=1e-3, warmup_steps=0, eval_every=0, eval_windows=1,
                         eval_batch_size=2, checkpoint_every=0, log_every=1, seed=0, weight_decay=0.1)
    seen = {}
    real = training_loop.param_groups  # the one loop builds every optimiser's groups

    def spy(trainee, weight_decay, groups=None):
        seen["trainee"] = trainee
        return real(trainee, weight_decay, groups)

    monkeypatch.setattr(training_loop, "param_groups", spy)
    monkeypatch.setattr(torch.optim, "AdamW", _Recording)
    assert lm_run.train_lm(config, tmp_path / "run", cache_dir=str(tmp_path / "cache"), progress=False).finished
    trainee = seen["trainee"]
    decays = _decay_of(_Recording.last, trainee)
    _check_decays(decays, trainee, 0.1)
    exempt = {n.rsplit(".", 1)[-1] for n, wd in decays.items() if wd == 0.0}
    assert {"A_log", "dt_bias", "weight"} <= exempt  # "weight": the RMSNorms'
    assert ({"r2_bias", "ell2_bias"} if mixer == "bayesian" else {"D", "bias"}) <= exempt
    assert any(n.endswith("embeddings.weight") and wd == 0.1 for n, wd in decays.items())
