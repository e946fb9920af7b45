"""BayesianLayer: its formula written out against the oracle, variance, initial values, errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from bayeslayer.layers import BayesianLayer, build_mixer
from bayeslayer.ops import bl_recurrent

D_MODEL = 16


def perturbed(seed: int = 0, **kwargs) -> BayesianLayer:
    torch.manual_seed(seed)
    layer = BayesianLayer(D_MODEL, **{**dict(num_heads=2, head_dim=8), **kwargs})
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer.double()


def by_hand(layer: BayesianLayer, x: torch.Tensor, return_variance: bool = False):
    """The class docstring's equations with F.* ops and the recurrent oracle ``bl_recurrent``."""
    B, T, _ = x.shape
    H, D, m, G = layer.num_heads, layer.head_dim, layer.head_v_dim, layer.groups

    def conv(name, y):
        if not layer.use_short_conv:
            return F.silu(y)
        c = getattr(layer, f"{name}_conv1d")
        W = c.weight.shape[-1]
        return F.silu(F.conv1d(F.pad(y.transpose(1, 2), (W - 1, 0)), c.weight, c.bias, groups=y.shape[-1])
                      .transpose(1, 2))

    q = conv("q", layer.q_proj(x)).reshape(B, T, H, D)
    k = conv("k", layer.k_proj(x)).reshape(B, T, H, D)
    v = conv("v", layer.v_proj(x)).reshape(B, T, H, m)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    r2 = (layer.r2_floor + F.softplus(layer.r2_proj(x) + layer.r2_bias)).reshape(B, T, H, G)
    ell2 = layer.ell2_floor + F.softplus(layer.ell2_proj(x) + layer.ell2_bias)
    alpha = theta = None
    if layer.dynamics != "identity":
        dt = F.softplus(layer.a_proj(x) + layer.dt_bias).reshape(B, T, H, -1)
        alpha = torch.exp(-torch.exp(layer.A_log)[:, None] * dt)
        alpha = alpha[..., 0] if layer.dynamics in ("scalar", "rotation") else alpha
    if layer.dynamics == "rotation":
        theta = (layer.theta_proj(x) + layer.theta_bias).reshape(B, T, H, D // 2)
    o, var, _ = bl_recurrent(q, k, v, r2 if G > 1 else r2[..., 0], ell2, alpha=alpha, theta=theta,
                             p0=layer.p0.double(), return_variance=True)
    o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + layer.o_norm.eps) * layer.o_norm.weight
    o = o * F.silu(layer.g_proj(x).reshape(B, T, H, m))
    y = layer.o_proj(o.reshape(B, T, H * m))
    return (y, var) if return_variance else y


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(dynamics="diagonal", groups=2),
    dict(dynamics="rotation", expand_v=1.0),
    dict(dynamics="identity", use_short_conv=False, p0=2.5),
])
def test_layer_is_its_equations(kwargs):
    layer = perturbed(**kwargs)
    x = torch.randn(2, 19, D_MODEL, dtype=torch.float64)
    want, want_var = by_hand(layer, x, return_variance=True)
    out = layer(x, output_variance=True)
    torch.testing.assert_close(out.o, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.variance, want_var, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("groups", [1, 4])
def test_variance_shape_and_decoding(groups):
    layer = perturbed(groups=groups)
    x = torch.randn(2, 7, D_MODEL, dtype=torch.float64)
    full = layer(x, output_variance=True)
    assert full.variance.shape == (2, 7, 2, groups)
    assert (full.variance >= 1).all()
    state, steps = None, []
    for t in range(7):
        out = layer(x[:, t: t + 1], state=state, use_cache=True, output_variance=True)
        state = out.state
        steps.append(out.variance)
    torch.testing.assert_close(torch.cat(steps, 1), full.variance, rtol=1e-10, atol=1e-10)
    M, P = state["recurrent"]
    assert M.shape == (2, 2, 8, 16)
    assert P.shape == ((2, 2, 8, 8) if groups == 1 else (2, 2, groups, 8, 8))
    assert layer(x).variance is None


@pytest.mark.parametrize("name", ["gated_deltanet", "mamba2", "attention", "gla"])
def test_variance_is_none_for_mixers_without_a_covariance(name):
    mixer = build_mixer(name, D_MODEL, num_heads=2, head_dim=8)
    assert mixer(torch.randn(1, 3, D_MODEL), output_variance=True).variance is None


def test_initial_values():
    layer = BayesianLayer(D_MODEL, num_heads=2, head_dim=8, dynamics="rotation", p0=1.0)
    with torch.no_grad():
        layer.r2_proj.weight.zero_()
        layer.ell2_proj.weight.zero_()
    x = torch.randn(1, 3, D_MODEL)
    args = layer.write_arguments(x)
    torch.testing.assert_close(args["r2"], torch.full_like(args["r2"], 1.0))
    torch.testing.assert_close(args["ell2"], torch.full_like(args["ell2"], 0.1))
    # first write of a unit key: gain p0 / (p0 + r2) = 0.5, GDN's sigmoid(0)
    assert layer.p0.tolist() == [1.0, 1.0]
    # rotations start as RoPE frequencies 10000^(-2c/D), independent of the input
    freqs = [10000 ** (-2 * c / 8) for c in range(4)]
    torch.testing.assert_close(args["theta"][0, 0, 0], torch.tensor(freqs))
    assert (args["alpha"] > 0).all() and (args["alpha"] <= 1).all()
    assert args["theta"].shape == (1, 3, 2, 4) and args["alpha"].shape == (1, 3, 2)


def test_initial_state_uses_p0_per_head():
    layer = perturbed(p0=3.0, groups=2)
    M, P = layer.initial_state(2, torch.float64, None)
    assert M.abs().max() == 0
    torch.testing.assert_close(P, 3.0 * torch.eye(8, dtype=torch.float64).expand(2, 2, 2, 8, 8))


def test_decays_never_underflow_to_zero():
    """A huge decay rate must give a tiny positive α, not 0 (which the ops reject)."""
    layer = perturbed(dynamics="diagonal").float()
    with torch.no_grad():
        layer.A_log.fill_(math.log(16.0))
        layer.dt_bias.fill_(1e4)
    out = layer(torch.randn(1, 5, D_MODEL))
    assert torch.isfinite(out.o).all()


def test_state_size_docstring_formula():
    layer = BayesianLayer(512, num_heads=4, head_dim=128, groups=2)
    D, m = 128, 256
    assert layer.state_size_per_head() == D * m + 2 * D * D
    diag = BayesianLayer(512, num_heads=4, head_dim=128, groups=2, covariance="diagonal")
    assert diag.state_size_per_head() == D * m + 2 * D


@pytest.mark.parametrize("bad, match", [
    (dict(dynamics="rotation", head_dim=7), "even head_dim, got 7"),
    (dict(dynamics="spiral"), "dynamics must be one of"),
    (dict(covariance="lowrnk"), "covariance must be one of"),
    (dict(covariance="lowrank"), "covariance=.lowrank. needs rank"),
    (dict(covariance="lowrank", rank=9), "rank must be <= the key dim D = 8"),
    (dict(groups=3), r"groups=3 must divide the value head dim m = head_dim·expand_v = 16"),
    (dict(groups=0), "groups must be an integer >= 1"),
    (dict(expand_v=1.3), "non-integer value head dim"),
    (dict(p0=0.0), "p0 must be finite and > 0"),
    (dict(p0=float("nan")), "p0 must be finite and > 0"),
    (dict(r2_init=1e-4), "r2_init=0.0001 must exceed its floor 0.001"),
    (dict(ell2_floor=-1.0), "ell2_floor must be finite and > 0"),
    (dict(conv_size=0), "conv_size must be an integer >= 1"),
])
def test_bad_config(bad, match):
    with pytest.raises(ValueError, match=match):
        BayesianLayer(D_MODEL, **{**dict(num_heads=2, head_dim=8), **bad})


def test_bad_p0_type():
    with pytest.raises(TypeError, match="p0 must be a number"):
        BayesianLayer(D_MODEL, num_heads=2, head_dim=8, p0="1")
