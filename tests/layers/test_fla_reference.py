"""Our GDN and Mamba-2 mixers against flash-linear-attention (test-only dependency, CPU).

fla's Triton kernels do not run on a CPU, so the references are written here from fla's own
pure-PyTorch pieces: ``naive_recurrent_gated_delta_rule`` plus the fla layer's projections,
convolutions and norm applied by hand with ``torch.nn.functional``; for Mamba-2, fla's
``Mamba2.torch_forward`` (its naive SSD) with its two Triton helpers swapped for fla's reference
``rms_norm_ref`` and ``F.silu``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("fla")

from fla.layers import GatedDeltaNet as FlaGatedDeltaNet  # noqa: E402
from fla.layers.mamba2 import Mamba2 as FlaMamba2  # noqa: E402
from fla.modules.layernorm_gated import rms_norm_ref  # noqa: E402
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule  # noqa: E402

from bayeslayer.layers import BayesianLayer, GatedDeltaNet, Mamba2  # noqa: E402


def fla_gdn(seed: int, **kwargs) -> FlaGatedDeltaNet:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = FlaGatedDeltaNet(**kwargs)
    with torch.no_grad():  # fla initialises the norm weight to ones (conv bias to 0): move them
        layer.o_norm.weight.add_(0.2 * torch.randn_like(layer.o_norm.weight))
        for name in ("q", "k", "v"):
            conv = getattr(layer, f"{name}_conv1d", None)
            if conv is not None and conv.bias is not None:
                conv.bias.add_(0.2 * torch.randn_like(conv.bias))
    return layer


def gdn_reference(layer: FlaGatedDeltaNet, x: torch.Tensor) -> torch.Tensor:
    """fla's GDN forward written out by hand: fla weights, F.* ops, fla's naive recurrence."""
    B, T, _ = x.shape
    H, D, m = layer.num_heads, layer.head_k_dim, layer.head_v_dim

    def short_conv(name: str, y: torch.Tensor) -> torch.Tensor:
        if not layer.use_short_conv:
            return F.silu(y)
        conv = getattr(layer, f"{name}_conv1d")
        W = conv.weight.shape[-1]
        y = F.conv1d(y.transpose(1, 2), conv.weight, conv.bias, padding=W - 1, groups=y.shape[-1])
        return F.silu(y[..., :T].transpose(1, 2))

    q = short_conv("q", layer.q_proj(x)).reshape(B, T, H, D)
    k = short_conv("k", layer.k_proj(x)).reshape(B, T, H, D)
    v = short_conv("v", layer.v_proj(x)).reshape(B, T, H, m)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)  # fla's l2norm, eps = 1e-6
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    beta = torch.sigmoid(layer.b_proj(x)) * (2.0 if layer.allow_neg_eigval else 1.0)
    g = -torch.exp(layer.A_log) * F.softplus(layer.a_proj(x) + layer.dt_bias)
    o, _ = naive_recurrent_gated_delta_rule(q, k, v, beta, g)  # scale defaults to D^-1/2
    o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + layer.o_norm.eps) * layer.o_norm.weight
    if layer.use_gate:
        o = o * F.silu(layer.g_proj(x).reshape(B, T, H, m))
    return layer.o_proj(o.reshape(B, T, H * m))


@pytest.mark.parametrize("use_short_conv, use_gate, allow_neg_eigval, conv_bias", [
    (True, True, False, False), (False, True, False, False), (True, False, False, False),
    (False, False, False, False), (True, True, True, True),
])
def test_gdn_matches_fla(use_short_conv, use_gate, allow_neg_eigval, conv_bias):
    options = dict(use_gate=use_gate, allow_neg_eigval=allow_neg_eigval)
    if use_short_conv:
        options["conv_bias"] = conv_bias
    theirs = fla_gdn(0, hidden_size=32, num_heads=2, head_dim=16, expand_v=2, use_short_conv=use_short_conv,
                     **options)
    ours = GatedDeltaNet(32, num_heads=2, head_dim=16, expand_v=2, use_short_conv=use_short_conv, **options)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    theirs.load_state_dict(ours.state_dict(), strict=True)  # and back: the same names and shapes
    x = torch.randn(2, 37, 32)
    with torch.no_grad():
        want = gdn_reference(theirs, x)
        got = ours(x).o
        got64 = ours.double()(x.double()).o
    assert want.abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got64.float(), want, rtol=1e-4, atol=1e-5)


def test_gdn_defaults_match_fla():
    theirs = fla_gdn(0, hidden_size=64, num_heads=4, head_dim=16)
    ours = GatedDeltaNet(64, num_heads=4, head_dim=16)
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    assert ours.o_norm.eps == theirs.o_norm.eps and ours.conv_size == theirs.conv_size
    assert ours.head_v_dim == theirs.head_v_dim  # expand_v = 2
    # the initial decays follow fla's ranges: A in (0, 16], Δ = softplus(dt_bias) in [1e-4, 0.1]
    dt = F.softplus(ours.dt_bias)
    assert (torch.exp(ours.A_log) <= 16).all() and (dt >= 1e-4 - 1e-9).all() and (dt <= 0.1 + 1e-6).all()


def test_gdn_weights_initialise_a_bayesian_layer():
    """The shared parts of a GDN layer (all but b_proj) load into a scalar-decay Bayesian Layer."""
    theirs = fla_gdn(0, hidden_size=32, num_heads=2, head_dim=16)
    bl = BayesianLayer(32, num_heads=2, head_dim=16, dynamics="scalar")
    result = bl.load_state_dict(theirs.state_dict(), strict=False)
    assert result.unexpected_keys == ["b_proj.weight"]
    assert sorted(result.missing_keys) == ["ell2_bias", "ell2_proj.weight", "p0", "r2_bias", "r2_proj.weight"]
    for name, value in theirs.state_dict().items():
        if name != "b_proj.weight":
            torch.testing.assert_close(bl.state_dict()[name], value, rtol=0, atol=0)


def fla_mamba2(seed: int, **kwargs) -> FlaMamba2:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = FlaMamba2(**kwargs)
    layer.act = F.silu  # fla's ACT2FN["silu"] is a Triton kernel
    norm = layer.norm
    norm.forward = lambda x, z=None: rms_norm_ref(x, norm.weight, None, z=z, eps=norm.eps,
                                                  group_size=norm.group_size,
                                                  norm_before_gate=norm.norm_before_gate)
    with torch.no_grad():
        norm.weight.add_(0.2 * torch.randn_like(norm.weight))
        layer.D.add_(0.2 * torch.randn_like(layer.D))
    return layer


def test_mamba2_matches_fla_torch_forward():
    theirs = fla_mamba2(0, num_heads=4, head_dim=8, hidden_size=16, state_size=4, expand=2, n_groups=1,
                        chunk_size=8)
    ours = Mamba2(16, num_heads=4, head_dim=8, state_size=4, n_groups=1)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 21, 16)
    with torch.no_grad():
        want, _, want_ssm = theirs.torch_forward(x, use_cache=True)
        got = ours(x, use_cache=True)
    torch.testing.assert_close(got.o, want, rtol=1e-4, atol=1e-5)
    # fla's SSM state is [B, H, P, N]; ours is M = [B, H, N, P] (keys B_t, values x_t)
    torch.testing.assert_close(got.state["recurrent"][0].transpose(-1, -2), want_ssm, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n_groups", [1, 2])
def test_mamba2_matches_fla_decoding(n_groups):
    """fla's single-token decode path from an empty cache, token by token, against our full forward.

    (With ``n_groups > 1`` fla's naive *prefill* tiles B/C over heads while its decode path and
    mamba_ssm give head ``h`` the group ``h // (H / n_groups)``; we follow the latter.)
    """
    H, P, N, d = 4, 8, 4, 16
    theirs = fla_mamba2(1, num_heads=H, head_dim=P, hidden_size=d, state_size=N, expand=2, n_groups=n_groups)
    ours = Mamba2(d, num_heads=H, head_dim=P, state_size=N, n_groups=n_groups)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    B, T = 2, 9
    x = torch.randn(B, T, d)
    state = {"conv_state": torch.zeros(B, theirs.conv_dim, theirs.conv_kernel_size),
             "recurrent_state": torch.zeros(B, H, P, N)}
    outs = []
    with torch.no_grad():
        for t in range(T):
            o, conv_state, ssm = theirs.torch_forward(x[:, t: t + 1], last_state=state)
            state = {"conv_state": conv_state, "recurrent_state": ssm}
            outs.append(o)
        got = ours(x).o
    torch.testing.assert_close(got, torch.cat(outs, 1), rtol=1e-4, atol=1e-5)
