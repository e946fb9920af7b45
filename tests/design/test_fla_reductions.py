"""Reductions against code nobody here wrote: flash-linear-attention's pure-PyTorch references.

Our reset-family Gated DeltaNet, DeltaNet and KDA and our latent-input linear attention, GLA
and Mamba-2/SSD core (recurrent and chunked paths, outputs and final states, from an initial
state) equal fla's naive recurrences (CPU; its Triton kernels are not used).

Conventions to line up:
* fla scales queries by ``D^-1/2`` by default; ``delta_rule_recurrence`` and
  ``naive_recurrent_gla`` always do, so our queries are scaled by hand there, elsewhere
  fla gets ``scale=1.0``.
* fla's gates are log-decays ``g``; our ``alpha = exp(g)``.  fla's ``beta`` is our reset
  coefficient ``gain = η``; the additive family's write coefficient ``ω`` is 1 for linear
  attention and GLA and the step size ``Δ`` for Mamba-2 (fla's simple GLA with keys ``Δ·k``).
* fla computes in float32; we run float64 on the same float32 values, so the tolerance is
  float32's, not float64's (measured differences: at most 6e-6 on outputs, 1.2e-6 on states).
"""

from __future__ import annotations

import pytest
import torch

gdn_naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")
delta_naive = pytest.importorskip("fla.ops.delta_rule.naive")
la_naive = pytest.importorskip("fla.ops.linear_attn.naive")
gla_naive = pytest.importorskip("fla.ops.gla.naive")
kda_naive = pytest.importorskip("fla.ops.kda.naive")
sgla_naive = pytest.importorskip("fla.ops.simple_gla.naive")

from bayeslayer.design import (  # noqa: E402  (after the importorskips on purpose)
    DELTANET,
    GATED_DELTANET,
    GLA,
    KDA,
    LINEAR_ATTENTION,
    MAMBA2,
    RETNET,
)

B, T, H, D, m = 2, 100, 3, 16, 8  # T = 100 is not a multiple of the chunk sizes used
TOL = dict(atol=2e-5, rtol=2e-5)
PATHS = ["recurrent", "chunk"]


def _inputs():
    q = torch.randn(B, T, H, D)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D), dim=-1)  # as in GDN/DeltaNet/KDA
    v = torch.randn(B, T, H, m)
    h0 = 0.5 * torch.randn(B, H, D, m)
    return q, k, v, h0


def _ours(design, path, q, k, v, h0, **kw):
    """Run a design in float64 on the float32 inputs; returns (o, final M) in float32."""
    d = {name: x.double() if isinstance(x, torch.Tensor) else x for name, x in kw.items()}
    extra = dict(chunk_size=32) if path == "chunk" else {}
    out = getattr(design, path)(q.double(), k.double(), v.double(), initial_state=(h0.double(), None),
                                output_final_state=True, **d, **extra)
    return out.o.float(), out.state[0].float()


def _check(ours, ref):
    (o, M), (o_ref, M_ref) = ours, ref
    assert o.shape == o_ref.shape and M.shape == M_ref.shape
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(M, M_ref, **TOL)


@pytest.mark.parametrize("path", PATHS)
def test_gated_deltanet(path):
    q, k, v, h0 = _inputs()
    beta = torch.rand(B, T, H).sigmoid()
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H) + 3.0)  # log-decays, α in about (0.5, 1)
    ref = gdn_naive.naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale=1.0, initial_state=h0.clone(),
                                                     output_final_state=True)
    _check(_ours(GATED_DELTANET, path, q, k, v, h0, gain=beta, alpha=g.exp()), ref)


@pytest.mark.parametrize("path", PATHS)
def test_deltanet(path):
    q, k, v, h0 = _inputs()
    beta = torch.rand(B, T, H).sigmoid()

    def head_first(x):
        return x.transpose(1, 2).contiguous()

    o_ref, M_ref = delta_naive.delta_rule_recurrence(
        head_first(q), head_first(k), head_first(v), head_first(beta), initial_state=h0.clone(),
        output_final_state=True,
    )
    ref = (o_ref.transpose(1, 2), M_ref)
    _check(_ours(DELTANET, path, q * D**-0.5, k, v, h0, gain=beta), ref)  # fla always scales q by D^-1/2


@pytest.mark.parametrize("path", PATHS)
def test_kda(path):
    q, k, v, h0 = _inputs()
    beta = torch.rand(B, T, H).sigmoid()
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, D) + 3.0)  # per-channel log-decays
    ref = kda_naive.naive_recurrent_kda(q, k, v, g, beta, scale=1.0, initial_state=h0.clone(),
                                        output_final_state=True)
    _check(_ours(KDA, path, q, k, v, h0, gain=beta, alpha=g.exp()), ref)


@pytest.mark.parametrize("path", PATHS)
def test_linear_attention(path):
    q, k, v, h0 = _inputs()
    k = k / 4  # unnormalised sums grow with T; keep outputs of order a few
    ref = la_naive.naive_recurrent_linear_attn(q, k, v, scale=1.0, initial_state=h0.clone(),
                                               output_final_state=True)
    _check(_ours(LINEAR_ATTENTION, path, q, k, v, h0, gain=1.0), ref)


@pytest.mark.parametrize("path", PATHS)
def test_gla(path):
    q, k, v, h0 = _inputs()
    gk = torch.nn.functional.logsigmoid(torch.randn(B, T, H, D) + 3.0)
    ref = gla_naive.naive_recurrent_gla(q, k, v, gk, initial_state=h0.clone(), output_final_state=True)
    _check(_ours(GLA, path, q * D**-0.5, k, v, h0, gain=1.0, alpha=gk.exp()), ref)  # fla scales q by D^-1/2


@pytest.mark.parametrize("path", PATHS)
def test_mamba2_ssd_core(path):
    """SSD core ``h = exp(Δ a) h + Δ k vᵀ``: fla's simple GLA with keys ``Δ·k`` and gate ``g = Δ a``."""
    q, k, v, h0 = _inputs()
    dt_step = torch.nn.functional.softplus(torch.randn(B, T, H) - 1.0)  # Δ > 0
    a = -torch.rand(H) - 0.1  # A < 0 per head
    g = dt_step * a
    ref = sgla_naive.naive_recurrent_simple_gla(q, k * dt_step[..., None], v, g, scale=1.0,
                                                initial_state=h0.clone(), output_final_state=True)
    _check(_ours(MAMBA2, path, q, k, v, h0, gain=dt_step, alpha=g.exp()), ref)


@pytest.mark.parametrize("path", PATHS)
def test_retnet_fixed_decay(path):
    q, k, v, h0 = _inputs()
    gamma = torch.tensor([0.9, 0.97, 0.99])  # one fixed decay per head
    g = gamma.log().expand(B, T, H)
    ref = sgla_naive.naive_recurrent_simple_gla(q, k, v, g, scale=1.0, initial_state=h0.clone(),
                                                output_final_state=True)
    _check(_ours(RETNET, path, q, k, v, h0, gain=1.0, alpha=gamma.expand(B, T, H)), ref)
