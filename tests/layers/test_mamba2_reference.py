"""Our Mamba-2 mixer against an SSD written here from the Mamba-2 paper (Dao & Gu 2024), in float64.

The reference takes the mixer's weights as plain tensors and runs the block as the paper states it:

    z, xBC, dt = in_proj(u)
    x, B, C    = SiLU(causal depthwise conv_W(xBC) + bias)   head h reads group h // (H / n_groups)
    Δ_t        = softplus(dt_t + dt_bias),  A = −exp(A_log)
    h_t        = exp(Δ_t A) h_{t−1} + Δ_t B_t x_tᵀ           [N × P] per head, h_0 = 0
    y_t        = h_tᵀ C_t + D x_t
    out        = out_proj(RMSNorm_group(y ⊙ SiLU(z)) · w)

in two forms: the recurrence above, token by token, and the quadratic ("attention") form
``y_t = Σ_{s ≤ t} (C_t · B_s) exp(A Σ_{r=s+1..t} Δ_r) Δ_s x_s + D x_t``.  The convolution is a loop
over its taps (no ``conv1d``), the norm a mean of squares.  Outputs, final states and the gradients of
every parameter and of the input must agree with ours to 1e-9 in float64.

fla's Mamba-2 naive path (``torch_forward``) computes its scan in float32 whatever the input dtype, so
the comparison with it (including gradients) is in float32 at float32 tolerances.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from bayeslayer.layers import Mamba2
from bayeslayer.layers.common import DT_FLOOR, DT_MAX, DT_MIN
from bayeslayer.training.optim import decay_split


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y_t[c] = Σ_j weight[c, 0, j] · x_{t−W+1+j}[c] + bias[c]``, zeros before the first token."""
    T, W = x.shape[1], weight.shape[-1]
    y = torch.zeros_like(x)
    for j in range(W):
        shift = W - 1 - j  # tap j reads the token `shift` steps back
        if shift >= T:
            continue
        shifted = torch.cat([x.new_zeros(x.shape[0], shift, x.shape[2]), x[:, : T - shift]], dim=1)
        y = y + weight[:, 0, j] * shifted
    return y if bias is None else y + bias


def ssd_reference(w: dict[str, torch.Tensor], u: torch.Tensor, *, num_heads: int, head_dim: int, state_size: int,
                  n_groups: int, eps: float, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's block on weights ``w`` (our parameter names) → ``(out [B, T, d], final h [B, H, N, P])``."""
    Bsz, T, _ = u.shape
    H, P, N, n = num_heads, head_dim, state_size, n_groups
    inner = H * P
    zxbcdt = u @ w["in_proj.weight"].T
    z, xBC, dt = zxbcdt[..., :inner], zxbcdt[..., inner: 2 * inner + 2 * n * N], zxbcdt[..., 2 * inner + 2 * n * N:]
    xBC = F.silu(causal_depthwise_conv(xBC, w["conv1d.weight"], w.get("conv1d.bias")))
    x = xBC[..., :inner].reshape(Bsz, T, H, P)
    group = torch.arange(H) // (H // n)  # the group each head reads its B and C from
    Bk = xBC[..., inner: inner + n * N].reshape(Bsz, T, n, N)[:, :, group]  # [B, T, H, N]
    Cq = xBC[..., inner + n * N:].reshape(Bsz, T, n, N)[:, :, group]
    delta = F.softplus(dt + w["dt_bias"])  # [B, T, H]
    A = -torch.exp(w["A_log"])  # [H]
    h = u.new_zeros(Bsz, H, N, P)
    if form == "recurrent":
        ys = []
        for t in range(T):
            decay = torch.exp(delta[:, t] * A)  # [B, H]
            h = decay[..., None, None] * h + delta[:, t, :, None, None] * Bk[:, t, :, :, None] * x[:, t, :, None, :]
            ys.append(torch.einsum("bhnp,bhn->bhp", h, Cq[:, t]))
        y = torch.stack(ys, dim=1)
    elif form == "quadratic":
        cum = torch.cumsum(delta * A, dim=1)  # [B, T, H]: A Σ_{r ≤ t} Δ_r
        seg = cum[:, :, None, :] - cum[:, None, :, :]  # [B, t, s, H]: A Σ_{s < r ≤ t} Δ_r
        causal = torch.ones(T, T, dtype=torch.bool).tril()[None, :, :, None]
        L = torch.where(causal, torch.exp(torch.where(causal, seg, torch.zeros_like(seg))), torch.zeros_like(seg))
        scores = torch.einsum("bthn,bshn->btsh", Cq, Bk) * L * delta[:, None, :, :]
        y = torch.einsum("btsh,bshp->bthp", scores, x)
        # the final state, from the same kernel: h_T = Σ_s exp(A Σ_{s < r ≤ T} Δ_r) Δ_s B_s x_sᵀ
        to_end = torch.exp(cum[:, -1:, :] - cum) * delta  # [B, T, H]
        h = torch.einsum("bsh,bshn,bshp->bhnp", to_end, Bk, x)
    else:
        raise ValueError(form)
    y = y + w["D"][:, None] * x
    g = (y.reshape(Bsz, T, inner) * F.silu(z)).reshape(Bsz, T, n, inner // n)
    g = g / torch.sqrt(g.square().mean(-1, keepdim=True) + eps)
    out = (g.reshape(Bsz, T, inner) * w["norm.weight"]) @ w["out_proj.weight"].T
    return out, h


def perturbed_mamba2(seed: int, dtype=torch.float64, **kwargs) -> Mamba2:
    """A Mamba-2 mixer whose D, norm weight and conv bias are moved off their initial values."""
    torch.manual_seed(seed)
    layer = Mamba2(**kwargs).to(dtype)
    with torch.no_grad():
        layer.D.add_(0.3 * torch.randn_like(layer.D))
        layer.norm.weight.add_(0.3 * torch.randn_like(layer.norm.weight))
        layer.conv1d.bias.add_(0.3 * torch.randn_like(layer.conv1d.bias))
        layer.dt_bias.add_(torch.randn_like(layer.dt_bias))  # larger steps: decays well below 1
    return layer


def ours_and_reference(layer: Mamba2, u: torch.Tensor, form: str):
    """(out, final state, grads) of our mixer and of the reference on a copy of its weights."""
    weights = {k: v.detach().clone().requires_grad_(True) for k, v in layer.named_parameters()}
    u_ref = u.detach().clone().requires_grad_(True)
    u_ours = u.detach().clone().requires_grad_(True)
    got = layer(u_ours, use_cache=True)
    want, want_h = ssd_reference(weights, u_ref, num_heads=layer.num_heads, head_dim=layer.head_dim,
                                 state_size=layer.state_size, n_groups=layer.n_groups, eps=layer.norm.eps, form=form)
    probe = torch.randn_like(want)
    names = [k for k, _ in layer.named_parameters()]
    g_ours = torch.autograd.grad((got.o * probe).sum(), [u_ours] + [dict(layer.named_parameters())[k] for k in names])
    g_ref = torch.autograd.grad((want * probe).sum(), [u_ref] + [weights[k] for k in names])
    return got, want, want_h, dict(zip(["input"] + names, g_ours, strict=True)), \
        dict(zip(["input"] + names, g_ref, strict=True))


@pytest.mark.parametrize("form", ["recurrent", "quadratic"])
@pytest.mark.parametrize("n_groups, chunk_size, T", [(1, 8, 37), (2, 16, 33), (1, 64, 5)])
def test_mamba2_matches_ssd_reference_float64(form, n_groups, chunk_size, T):
    layer = perturbed_mamba2(0, hidden_size=12, num_heads=4, head_dim=6, state_size=5, n_groups=n_groups,
                             chunk_size=chunk_size)
    u = torch.randn(2, T, 12, dtype=torch.float64)
    got, want, want_h, g_ours, g_ref = ours_and_reference(layer, u, form)
    assert want.abs().max() > 1e-2
    torch.testing.assert_close(got.o, want, rtol=0, atol=1e-9)
    torch.testing.assert_close(got.state["recurrent"][0], want_h, rtol=0, atol=1e-9)
    for name, g in g_ref.items():
        assert g.abs().max() > 0, name  # every parameter and the input receive a gradient
        torch.testing.assert_close(g_ours[name], g, rtol=0, atol=1e-9 * max(1.0, float(g.abs().max())),
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")


def test_reference_forms_agree_and_detect_a_wrong_norm_placement():
    """The two reference forms agree, and the comparison fails for a mixer with the norm before the gate."""
    layer = perturbed_mamba2(1, hidden_size=12, num_heads=4, head_dim=6, state_size=5, chunk_size=8)
    u = torch.randn(2, 19, 12, dtype=torch.float64)
    w = {k: v.detach() for k, v in layer.named_parameters()}
    kw = dict(num_heads=4, head_dim=6, state_size=5, n_groups=1, eps=layer.norm.eps)
    a, ha = ssd_reference(w, u, form="recurrent", **kw)
    b, hb = ssd_reference(w, u, form="quadratic", **kw)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    torch.testing.assert_close(ha, hb, rtol=0, atol=1e-12)
    layer.norm.norm_before_gate = True  # GDN's placement: RMSNorm(y)·SiLU(z)
    with torch.no_grad():
        assert (layer(u).o - a).abs().max() > 1e-3


def test_mamba2_initialisation_follows_mamba2():
    """A ~ U[1, 16], Δ = softplus(dt_bias) log-uniform in [1e-3, 0.1] (floor 1e-4), D = 1, norm weight 1,
    and A_log, dt_bias and D exempt from weight decay (mamba_ssm's ``Mamba2`` defaults)."""
    torch.manual_seed(0)
    layer = Mamba2(64, num_heads=256, head_dim=2, state_size=4)
    A = torch.exp(layer.A_log.detach())
    dt = F.softplus(layer.dt_bias.detach())
    assert A.min() >= 1 - 1e-6 and A.max() <= 16 + 1e-5
    assert dt.min() >= max(DT_MIN, DT_FLOOR) * (1 - 1e-5) and dt.max() <= DT_MAX * (1 + 1e-5)
    assert (DT_MIN, DT_MAX, DT_FLOOR) == (1e-3, 0.1, 1e-4)
    # log-uniform: the mean of log Δ is the midpoint of [log 1e-3, log 0.1] (256 draws: ± 0.3 is > 4 s.e.)
    assert abs(float(torch.log(dt).mean()) - 0.5 * (math.log(DT_MIN) + math.log(DT_MAX))) < 0.3
    assert abs(float(A.mean()) - 8.5) < 1.5  # uniform on [1, 16]: mean 8.5, s.e. 0.27
    assert torch.equal(layer.D.detach(), torch.ones(256)) and torch.equal(layer.norm.weight.detach(), torch.ones(512))
    assert layer.norm.norm_before_gate is False and layer.norm.group_size == 512
    assert layer.conv_size == 4 and layer.conv1d.bias is not None and layer.in_proj.bias is None
    reasons = decay_split(layer)
    assert reasons["A_log"] == reasons["dt_bias"] == reasons["D"] == "flagged"
    assert reasons["in_proj.weight"] is None and reasons["out_proj.weight"] is None
    # the package's own gated RMSNorm flags its gain, as the recurrence's parameters are flagged
    assert reasons["conv1d.weight"] is None and reasons["norm.weight"] == "flagged"


def test_mamba2_matches_fla_naive_path_with_gradients():
    """fla's ``torch_forward`` (its naive SSD, with fla's reference norm and F.silu for its Triton pieces)
    on the same weights: outputs and every gradient, in float32 (fla's scan is float32)."""
    pytest.importorskip("fla")
    from fla.layers.mamba2 import Mamba2 as FlaMamba2
    from fla.modules.layernorm_gated import rms_norm_ref

    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = FlaMamba2(num_heads=4, head_dim=8, hidden_size=16, state_size=4, expand=2, n_groups=1, chunk_size=8)
    theirs.act = F.silu
    norm = theirs.norm
    norm.forward = lambda x, z=None: rms_norm_ref(x, norm.weight, None, z=z, eps=norm.eps,
                                                  group_size=norm.group_size, norm_before_gate=norm.norm_before_gate)
    ours = perturbed_mamba2(3, dtype=torch.float32, hidden_size=16, num_heads=4, head_dim=8, state_size=4,
                            chunk_size=8)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    u = torch.randn(2, 29, 16)
    want, _, _ = theirs.torch_forward(u)
    got = ours(u).o
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    probe = torch.randn_like(want)
    g_theirs = dict(zip([k for k, _ in theirs.named_parameters()],
                        torch.autograd.grad((want * probe).sum(), list(theirs.parameters())), strict=True))
    g_ours = dict(zip([k for k, _ in ours.named_parameters()],
                      torch.autograd.grad((got * probe).sum(), list(ours.parameters())), strict=True))
    assert set(g_theirs) == set(g_ours)
    for name, g in g_theirs.items():
        torch.testing.assert_close(g_ours[name], g, rtol=1e-4, atol=1e-4 * max(1.0, float(g.abs().max())),
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")
