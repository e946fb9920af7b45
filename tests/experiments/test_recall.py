"""Learned collision recall: the core models, a tiny training run, the margin metric, the JSON and plot."""

import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from bayeslayer.cli import main as cli_main
from bayeslayer.experiments import recall
from bayeslayer.experiments.common.harness import TrainConfig, train
from bayeslayer.experiments.common.recall_models import (
    CORE_KINDS,
    CORE_LABELS,
    EXTRA_CORE_KINDS,
    GDN_INIT_STEP,
    CoreModelConfig,
    build_core_model,
)
from bayeslayer.training.optim import decay_split

TINY = replace(recall.PRESETS["tiny"], num_pairs=2, address_dim=4, n_b=2, train_n_f=(1, 2), test_n_f=(1, 4),
               test_rho=(0.6, 0.9), test_n_f_for_rho=2, eval_sequences=4, steps=3, batch_size=4)


@pytest.mark.parametrize("kind", CORE_KINDS + EXTRA_CORE_KINDS)
def test_core_model_shapes_and_gradients(kind):
    model = build_core_model(kind, input_dim=9, num_classes=4, address_start=1, address_dim=4, head_dim=4,
                             num_layers=1, width=8, num_heads=2)
    batch = recall.collision_recall_batch(2, n_f=3, rho=0.7, generator=torch.Generator().manual_seed(0),
                                          n_b=2, num_pairs=2, address_dim=4)
    logits = model(batch.inputs)
    assert logits.shape == (2, batch.inputs.shape[1], 4) and bool(torch.isfinite(logits).all())
    logits.sum().backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())


@pytest.mark.parametrize("kind", ["delta", "gated_deltanet", "linear_attention", "gla"])
def test_readout_uses_the_address_as_key_and_query(kind):
    """What a token writes at address e_1 is invisible to a readout at the orthogonal address e_2.

    (Not asserted for BL: its isotropic process noise ℓ_t² I couples all directions of P.)
    """
    model = build_core_model(kind, input_dim=9, num_classes=4, address_start=1, address_dim=4,
                             head_dim=4, num_layers=1, width=8, num_heads=2)
    mixer = model.blocks[0].mixer
    h = torch.randn(1, 3, 8)
    addr = torch.tensor([[[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0]]])
    captured = {}
    mixer.out.register_forward_hook(lambda mod, inp, out: captured.update(o=inp[0]))
    mixer(h, addr)
    assert captured["o"][0, 0].abs().sum() > 0
    h2 = h.clone()
    h2[0, 0] += 10.0  # change what token 0 writes: token 1 (address e_2 ⟂ e_1) must not notice
    captured2 = {}
    mixer.out._forward_hooks.clear()
    mixer.out.register_forward_hook(lambda mod, inp, out: captured2.update(o=inp[0]))
    mixer(h2, addr)
    assert torch.allclose(captured["o"][0, 1], captured2["o"][0, 1], atol=1e-6)
    assert not torch.allclose(captured["o"][0, 0], captured2["o"][0, 0])


def _small_core(kind, seed=0):
    torch.manual_seed(seed)
    return build_core_model(kind, input_dim=9, num_classes=4, address_start=1, address_dim=4, head_dim=4,
                            num_layers=1, width=8, num_heads=2).blocks[0].mixer


def _gdn_alpha(mixer, h):
    return torch.exp(-torch.exp(mixer.A_log) * torch.nn.functional.softplus(mixer.a_proj(h) + mixer.dt_bias))


def test_gdn_core_is_the_delta_core_with_a_learned_scalar_decay():
    """With its decay switched off (A = 0: α = 1) the GDN core computes what the Delta core with the same value,
    gain and output maps does; with a decay, a write fades from the readout by the product of the α's after it."""
    gdn, delta = _small_core("gated_deltanet"), _small_core("delta", seed=1)
    assert CORE_LABELS["gated_deltanet"] == "GDN-style"
    assert set(dict(gdn.named_parameters())) == set(dict(delta.named_parameters())) | {"a_proj.weight", "A_log",
                                                                                          "dt_bias"}
    split = decay_split(gdn)  # the gate's own parameters are not weight-decayed, as in the GDN layer
    assert split["A_log"] is not None and split["dt_bias"] is not None and split["a_proj.weight"] is None
    h = torch.randn(2, 37, 8)
    addr = torch.nn.functional.normalize(torch.randn(2, 37, 4), dim=-1)
    alpha = _gdn_alpha(gdn, h)
    # the initial decay: α within GDN_INIT_STEP·e^3 of 1 for this width's gate pre-activations, never 1 exactly
    assert bool((alpha < 1).all()) and bool((1 - alpha < GDN_INIT_STEP * math.e**3).all())
    delta.load_state_dict({k: v for k, v in gdn.state_dict().items() if k in delta.state_dict()})
    with torch.no_grad():
        gdn.A_log.fill_(-200.0)  # exp(-200) underflows: α = 1 exactly
    assert bool((_gdn_alpha(gdn, h) == 1).all())
    torch.testing.assert_close(gdn(h, addr), delta(h, addr), rtol=1e-5, atol=1e-6)
    # a write at e_1, four at the orthogonal e_2, a write at e_1: the first write reaches the last readout at
    # e_1 decayed by α_2 ⋯ α_6, and the reset write corrects that prediction towards v_6
    with torch.no_grad():
        gdn.A_log.fill_(0.0)
        gdn.dt_bias.fill_(0.0)  # Δ ≈ softplus(a_t): α of a few tenths
    e1, e2 = torch.eye(4)[0], torch.eye(4)[1]
    h = torch.randn(1, 6, 8)
    captured = []
    gdn.out.register_forward_hook(lambda mod, inp, out: captured.append(inp[0]))
    gdn(h, torch.stack([e1, e2, e2, e2, e2, e1])[None])
    readout = captured[0].view(6, 2, 4)  # M_tᵀ q_t per token and head
    alpha, beta, v = _gdn_alpha(gdn, h)[0], torch.sigmoid(gdn.coef(h))[0], gdn.value(h).view(6, 2, 4)
    first = beta[0, :, None] * v[0]
    torch.testing.assert_close(readout[0], first, rtol=1e-5, atol=1e-6)
    decayed = alpha[1:].prod(0)[:, None] * first
    assert bool((alpha[1:].prod(0) < 0.9).all())  # the decay is not negligible here
    torch.testing.assert_close(readout[5], decayed + beta[5, :, None] * (v[5] - decayed), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kind="transformer"), "kind"),
        (dict(address_dim=8), "head_dim"),
        (dict(address_start=30), "address slice"),
        (dict(width=0), "width"),
        (dict(p0=0.0), "p0"),
    ],
)
def test_core_model_config_errors(kwargs, match):
    base = dict(kind="bayesian", input_dim=33, num_classes=16, address_start=1)
    with pytest.raises(ValueError, match=match):
        CoreModelConfig(**{**base, **kwargs})


def test_core_model_rejects_bad_input():
    model = build_core_model("delta", input_dim=33, num_classes=16, address_start=1)
    with pytest.raises(ValueError, match="input_dim=33"):
        model(torch.zeros(2, 5, 32))
    with pytest.raises(TypeError, match="floating"):
        model(torch.zeros(2, 5, 33, dtype=torch.long))


@pytest.mark.parametrize("kind", ["bayesian", "gated_deltanet", pytest.param("delta", marks=pytest.mark.slow)])
def test_tiny_recall_training_lowers_the_loss(kind):
    preset = replace(TINY, num_pairs=4, address_dim=8)
    torch.manual_seed(0)
    model = recall.build_model(kind, preset)
    cfg = TrainConfig(steps=40, batch_size=16, lr=1e-2, warmup_steps=4)
    res = train(model, recall.sampler(preset), cfg, progress=False)
    first, last = sum(res.losses[:5]) / 5, sum(res.losses[-5:]) / 5
    assert last < first - 0.3, (first, last)


class FixedLogits(nn.Module):
    """Returns logits that put ``gap`` on the target's label over the distractor's (read from the labels)."""

    def __init__(self, gap):
        super().__init__()
        self.gap = gap
        self.labels = None

    def forward(self, x):
        B, T, _ = x.shape
        z = torch.zeros(B, T, 4)
        z[..., 0] = self.gap  # label 0 gets +gap everywhere
        return z


def test_margin_is_two_p_minus_one_of_target_vs_distractor(monkeypatch):
    # one pair: labels are a permutation of {0, 1}; the target is label 0 in some sequences, 1 in others
    preset = replace(TINY, num_pairs=1, address_dim=2, eval_sequences=64, eval_batch=64)
    gap = 1.5
    res = recall.evaluate_point(FixedLogits(gap), preset, n_f=1, rho=0.5, point_seed=0)
    batch = recall.collision_recall_batch(64, n_f=1, rho=0.5,
                                          generator=torch.Generator().manual_seed(preset.eval_seed * 7919),
                                          n_b=preset.n_b, num_pairs=1, address_dim=2)
    frac0 = float((batch.labels[:, -1] == 0).float().mean())
    p = 1 / (1 + math.exp(-gap))
    expected = frac0 * (2 * p - 1) + (1 - frac0) * (2 * (1 - p) - 1)
    assert res["margin"] == pytest.approx(expected, abs=1e-6)
    assert res["accuracy"] == pytest.approx(frac0)


def test_run_recall_writes_json_and_plot(tmp_path):
    record = recall.run(recall.RecallConfig(preset=TINY, models=["delta", "linear_attention"], out=str(tmp_path),
                                            progress=False))
    data = json.loads((tmp_path / "recall.json").read_text())
    assert (tmp_path / "recall.png").stat().st_size > 1000
    assert data["experiment"] == "recall" and set(data["models"]) == {"delta", "linear_attention"}
    assert data["complete"] is True  # partial files (written after each model) say False
    s = data["models"]["delta"]["summary"]
    assert len(s["accuracy_vs_n_f"]["mean"]) == len(TINY.test_n_f)
    assert len(s["margin_vs_rho"]["std"]) == len(TINY.test_rho)
    assert all(0 <= a <= 1 for a in s["accuracy_vs_n_f"]["mean"])
    assert data["config"]["train"]["steps"] == TINY.steps
    assert record["models"]["delta"]["seeds"][0]["seed"] == 0


def test_cli_plot_only_and_bad_arguments(tmp_path, capsys):
    recall.run(recall.RecallConfig(preset=TINY, models=["delta"], out=str(tmp_path), progress=False))
    (tmp_path / "recall.png").unlink()
    assert cli_main(["recall", "--plot-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "recall.png").exists() and "margin vs ρ" in capsys.readouterr().out
    assert cli_main(["recall", "--steps", "0", "--out", str(tmp_path)]) == 2
    assert "--steps" in capsys.readouterr().err
    with pytest.raises(ValueError, match="models"):
        recall.run(recall.RecallConfig(preset=TINY, models=["mamba"], progress=False))
    assert cli_main(["recall", "--preset", "huge"]) == 2
