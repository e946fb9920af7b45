"""Shared pieces: short convolution with its cache, gated RMSNorm, the decay parametrisation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from bayeslayer.layers import GatedRMSNorm, ShortConvolution
from bayeslayer.layers.common import decay_log, init_decay_, inverse_softplus, l2norm, value_head_dim


@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_short_conv_is_a_causal_depthwise_conv(W, bias):
    torch.manual_seed(0)
    conv = ShortConvolution(6, W, bias=bias).double()
    x = torch.randn(2, 11, 6, dtype=torch.float64)
    y, _ = conv(x)
    # direct sum: y_t[c] = silu(Σ_j w[c, j] x_{t-W+1+j}[c] + b[c]) with zeros before t = 0
    xp = torch.cat((torch.zeros(2, W - 1, 6, dtype=torch.float64), x), 1)
    want = sum(conv.weight[:, 0, j] * xp[:, j: j + 11] for j in range(W))
    if bias:
        want = want + conv.bias
    torch.testing.assert_close(y, F.silu(want), rtol=1e-12, atol=1e-12)
    assert conv.weight.shape == (6, 1, W)


@pytest.mark.parametrize("pieces", [(11,), (3, 8), (1,) * 11, (2, 1, 5, 3)])
def test_short_conv_cache(pieces):
    torch.manual_seed(0)
    conv = ShortConvolution(5, 4).double()
    x = torch.randn(3, 11, 5, dtype=torch.float64)
    full, _ = conv(x)
    outs, cache, pos = [], None, 0
    for n in pieces:
        y, cache = conv(x[:, pos: pos + n], cache=cache, output_final_state=True)
        outs.append(y)
        pos += n
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=0, atol=1e-14)
    torch.testing.assert_close(cache, x[:, -3:].transpose(1, 2))
    with pytest.raises(ValueError, match=r"conv cache must be \[B, C, W-1\] = \(3, 5, 3\), got \(3, 5, 2\)"):
        conv(x, cache=cache[..., :2])


def test_short_conv_bad_config():
    with pytest.raises(ValueError, match="activation must be"):
        ShortConvolution(4, 4, activation="gelu")
    with pytest.raises(ValueError, match="conv_size must be an integer >= 1"):
        ShortConvolution(4, 0)


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gated_rmsnorm(norm_before_gate):
    torch.manual_seed(0)
    norm = GatedRMSNorm(8, eps=1e-5, norm_before_gate=norm_before_gate, group_size=4).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, g = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 3, 8, dtype=torch.float64)
    y = norm(x, g)
    h = x if norm_before_gate else x * F.silu(g)
    hg = h.reshape(2, 3, 2, 4)
    want = (hg / torch.sqrt(hg.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(2, 3, 8) * norm.weight
    if norm_before_gate:
        want = want * F.silu(g)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    plain = GatedRMSNorm(8).double()
    torch.testing.assert_close(plain(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    # bf16 input: computed in fp32, returned in bf16
    assert plain.to(torch.bfloat16)(x.to(torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="group_size=3 must divide hidden_size=8"):
        GatedRMSNorm(8, group_size=3)
    with pytest.raises(ValueError, match="norm_eps must be finite and > 0"):
        GatedRMSNorm(8, eps=0.0)


def test_decay_parametrisation():
    a = torch.randn(2, 5, 6, dtype=torch.float64)
    A_log = torch.log(torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64))
    dt_bias = torch.randn(6, dtype=torch.float64)
    g = decay_log(a, A_log, dt_bias)
    assert g.shape == (2, 5, 3, 2)
    want = -torch.exp(A_log)[:, None] * F.softplus(a + dt_bias).reshape(2, 5, 3, 2)
    torch.testing.assert_close(g, want)
    assert (decay_log(torch.full((1, 1, 3), 1e6), A_log.float(), torch.zeros(3)) >= -60).all()
    A_log, dt_bias = torch.empty(1000), torch.empty(1000)
    init_decay_(A_log, dt_bias)
    dt = F.softplus(dt_bias)
    assert 1e-3 * 0.999 <= dt.min() and dt.max() <= 0.1 * 1.001
    assert torch.exp(A_log).max() <= 16


def test_small_helpers():
    y = torch.tensor([1e-4, 0.5, 3.0], dtype=torch.float64)
    torch.testing.assert_close(F.softplus(inverse_softplus(y)), y)
    x = torch.randn(4, 7, dtype=torch.float64)
    torch.testing.assert_close(l2norm(x).norm(dim=-1), torch.ones(4, dtype=torch.float64), rtol=1e-5, atol=0)
    assert l2norm(torch.zeros(3)).abs().max() == 0  # a zeroed (padded) key stays zero, not NaN
    assert value_head_dim(8, 1.5) == 12 and value_head_dim(6, 0.5) == 3
    with pytest.raises(ValueError, match="non-integer value head dim"):
        value_head_dim(8, 0.3)
    with pytest.raises(TypeError, match="expand_v must be a number"):
        value_head_dim(8, "2")
    assert math.isfinite(float(inverse_softplus(torch.tensor(1e-6))))
