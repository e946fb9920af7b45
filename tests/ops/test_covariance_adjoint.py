"""The covariance pass's adjoint, written out per chunk, equals autograd through the chunk loop.

A fused backward kernel has to carry ``P̄`` backwards through the chunks and form
every gradient from per-chunk matrices, not from an autograd graph.  This module writes that
adjoint in plain tensor algebra for scalar decay (library code:
:func:`bayeslayer.ops.bayesian_layer.scan_backward.covariance_pass_adjoint_scalar`), in the same variables as the loop
of
:func:`bayeslayer.ops.bayesian_layer.chunk.covariance_pass` (per chunk: ``Y = K̃P``, ``S = base + YK̃ᵀ``,
``S = L_c L_cᵀ``, ``Ū = (L_c ⊙ R)⁻¹(NBk + γ ⊙ Y)``, ``P' = sym(b_C I + γ_C² P − ŪᵀdiagẼ²Ū)``,
``w = Ū / diag(L_c)``), and checks it against autograd in float64 — the reference a kernel
port is tested against, and a check of the algebra in ``docs/kernels.md``.
"""

from __future__ import annotations

import pytest
import torch

from bayeslayer.ops.bayesian_layer.chunk import ChunkDynamics, Chunked, covariance_prework
from bayeslayer.ops.bayesian_layer.prepare import prepare
from bayeslayer.ops.bayesian_layer.scan_backward import covariance_pass_adjoint_scalar


def _loop(P, kt, base, NBk, gamma, ratio, end, b_end, gC2):
    """The scalar-decay covariance loop over chunks (inputs ``[n, B, H, ...]``); returns ``(w, P_end, saved)``."""
    eye = torch.eye(P.shape[-1], dtype=P.dtype)
    ws, saved = [], []
    for i in range(len(kt)):
        Y = kt[i] @ P
        S = base[i] + Y @ kt[i].mT
        Lc = torch.linalg.cholesky(S)
        X = NBk[i] + gamma[i] * Y
        Ub = torch.linalg.solve_triangular(Lc * ratio[i], X, upper=False)
        Ue = Ub * end[i]
        Pn = eye * b_end[i] + gC2[i] * P - Ue.mT @ Ue
        saved.append((P, Y, Lc, Ub))
        P = 0.5 * (Pn + Pn.mT)
        ws.append(Ub / torch.diagonal(Lc, dim1=-2, dim2=-1)[..., None])
    return torch.stack(ws), P, saved


def _prework(T=150, C=32, seed=0):
    """The loop's inputs for random scalar-decay data, built by the library's own prework."""
    g = torch.Generator().manual_seed(seed)
    B, H, D = 1, 2, 16
    q = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, 8, generator=g, dtype=torch.float64)
    r2 = 0.1 + torch.rand(B, T, H, generator=g, dtype=torch.float64)
    ell2 = 0.01 + 0.1 * torch.rand(B, T, H, generator=g, dtype=torch.float64)
    alpha = 0.6 + 0.4 * torch.rand(B, T, H, generator=g, dtype=torch.float64)
    pr = prepare(q, k, v, write="bayes", r2=r2, ell2=ell2, alpha=alpha)
    ch = Chunked(pr, C, need_noise=True)
    dyn = ChunkDynamics(ch.log_alpha, None)
    _, kt, NBk, base, b_end = covariance_prework(dyn, ch.k, ch.r2, ch.ell2)
    A = torch.randn(B, H, D, D, generator=g, dtype=torch.float64)
    P0 = A @ A.mT / D + 0.5 * torch.eye(D, dtype=torch.float64)
    x = dict(P=P0, kt=kt, base=base, NBk=NBk, gamma=dyn.gamma, ratio=dyn.ratio[..., 0], end=dyn.end,
             b_end=b_end, gC2=dyn.gamma_C * dyn.gamma_C)
    return x, g, (dyn, ch)


def test_loop_matches_covariance_pass():
    """``_loop`` is the same computation as the library's covariance pass (else the check below proves nothing)."""
    from bayeslayer.ops.bayesian_layer.chunk import covariance_pass

    x, _, (dyn, ch) = _prework()
    w, P_end, _ = _loop(**x)
    w2, _, P2 = covariance_pass(dyn, None, ch.k, ch.r2, ch.ell2, x["P"])
    assert torch.allclose(w, w2, atol=1e-12, rtol=0)
    assert torch.allclose(P_end, P2, atol=1e-12, rtol=0)


def test_adjoint_equals_autograd():
    x, g, _ = _prework()
    leaves = {name: t.detach().clone().requires_grad_(True) for name, t in x.items()}
    w, P_end, saved = _loop(**leaves)
    dw = torch.randn(w.shape, generator=g, dtype=torch.float64)
    dP = torch.randn(P_end.shape, generator=g, dtype=torch.float64)
    auto = torch.autograd.grad((w, P_end), list(leaves.values()), (dw, dP))
    with torch.no_grad():
        saved = [tuple(t.detach() for t in s) for s in saved]
        dP0, mine = covariance_pass_adjoint_scalar(dw, dP, saved,
                                                   *(x[n] for n in ("kt", "gamma", "ratio", "end", "gC2")))
    mine["P"] = dP0
    for name, a in zip(leaves, auto, strict=True):
        b = mine[name].reshape(a.shape) if mine[name].numel() == a.numel() else mine[name].expand_as(a)
        if name in ("ratio", "base"):  # only the lower triangle of R, and the symmetric S, are read
            a = a.tril() if name == "ratio" else 0.5 * (a + a.mT)
            b = b.tril() if name == "ratio" else b
        err = (a - b).abs().max().item()
        assert err < 1e-10 * max(1.0, a.abs().max().item()), f"d{name}: |explicit - autograd| = {err:.2e}"
        assert a.abs().max() > 0, f"d{name} is identically zero; the comparison would be vacuous"


def test_adjoint_bad_input():
    x, g, _ = _prework(T=64)
    w, P_end, saved = _loop(**x)
    args = [x[n] for n in ("kt", "gamma", "ratio", "end", "gC2")]
    with pytest.raises(ValueError, match="saved"):
        covariance_pass_adjoint_scalar(w, P_end, [], *args)
    with pytest.raises(ValueError, match="dw"):
        covariance_pass_adjoint_scalar(w[:1], P_end, saved, *args)
    with pytest.raises(ValueError, match="dP_next"):
        covariance_pass_adjoint_scalar(w, P_end[..., :1], saved, *args)
