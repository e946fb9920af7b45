"""The covariance step's adjoint on its scalar fast path, swept over the chunks, equals autograd through the steps.

A fused backward kernel has to carry ``P̄`` backwards through the chunks and form every gradient from
per-chunk matrices, not from an autograd graph.
:func:`bayeslayer.ops.bayesian_layer.covariance.covariance_step_adjoint` writes that adjoint in plain tensor
algebra; for scalar decay without ``L⁻¹`` (the path :func:`bayeslayer.ops.bayesian_layer.chunk.covariance_pass`
runs) it works in the variables of the fast path (per chunk: ``Y = K̃P``, ``S = base + YK̃ᵀ = L_c L_cᵀ``,
``Ū = (L_c ⊙ R)⁻¹(NBk + γ ⊙ Y)``, ``P' = sym(b_C I + γ_C² P − ŪᵀdiagẼ²Ū)``, ``w = Ū / diag(L_c)``, the
variance ``1 + q̃ᵀPq̃ + qBq − Σ_i ((qŪᵀ) ⊙ R)_ti²``).  Checked against autograd in float64 — the reference a
kernel port is tested against, and a check of the algebra in ``docs/kernels.md``.  The general path's adjoint
(LDLᵀ factors, diagonal decay) is checked by ``ops/test_scan_backward.py::test_chunk_adjoint_equals_autograd``.
"""

from __future__ import annotations

import pytest
import torch

from bayeslayer.ops.bayesian_layer.chunk import ChunkDynamics, Chunked, covariance_pass
from bayeslayer.ops.bayesian_layer.covariance import covariance_prework, covariance_step, covariance_step_adjoint
from bayeslayer.ops.bayesian_layer.prepare import prepare

FACTORS = ("ratio", "end", "gamma", "gamma_C")


def _loop(x: dict, save: bool = False):
    """The covariance step over every chunk (inputs ``[n, B, H, ...]``); returns ``(w, var, P_end, steps)``."""
    P = x["P"]
    ws, variances, steps = [], [], []
    for i in range(len(x["kt"])):
        dyn = x["dyn"].with_factors(*(x[f][i] for f in FACTORS))
        st = covariance_step(dyn, x["kt"][i], x["NBk"][i], x["base"][i], x["BC"][i], P, q=x["q"][i], qt=x["qt"][i],
                             qBq=x["qBq"][i], save=save)
        steps.append((dyn, st))
        P = st["P"]
        ws.append(st["W"])
        variances.append(st["var"])
    return torch.stack(ws), torch.stack(variances), P, steps


def _prework(T=150, C=32, seed=0):
    """The steps' inputs for random scalar-decay data, built by the library's own prework."""
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
    assert dyn.scalar
    b, kt, NBk, base, BC = covariance_prework(dyn, ch.k, ch.r2, ch.ell2)
    A = torch.randn(B, H, D, D, generator=g, dtype=torch.float64)
    P0 = A @ A.mT / D + 0.5 * torch.eye(D, dtype=torch.float64)
    x = dict(P=P0, kt=kt, base=base, NBk=NBk, BC=BC, q=ch.q, qt=dyn.adj(ch.q), qBq=dyn.noise_quad(ch.ell2, ch.q, b),
             ratio=dyn.ratio, end=dyn.end, gamma=dyn.gamma, gamma_C=dyn.gamma_C)
    return {n: t.detach() for n, t in x.items()} | {"dyn": dyn}, g, (dyn, ch)


def test_loop_matches_covariance_pass():
    """``_loop`` takes the fast path and is the library's covariance pass (else the check below proves nothing)."""
    x, _, (dyn, ch) = _prework()
    w, var, P_end, steps = _loop(x, save=True)
    assert all("Ub" in st["saved"] and "Linv" not in st for _, st in steps)  # the fast path: no L⁻¹
    w2, var2, P2 = covariance_pass(dyn, ch.q, ch.k, ch.r2, ch.ell2, x["P"])
    assert torch.equal(w, w2) and torch.equal(var, var2) and torch.equal(P_end, P2)


def test_adjoint_equals_autograd():
    x, g, _ = _prework()
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items() if n != "dyn"}
    w, var, P_end, _ = _loop(leaves | {"dyn": x["dyn"]})
    dw = torch.randn(w.shape, generator=g, dtype=torch.float64)
    dvar = torch.randn(var.shape, generator=g, dtype=torch.float64)
    dP = torch.randn(P_end.shape, generator=g, dtype=torch.float64)
    auto = torch.autograd.grad((w, var, P_end), list(leaves.values()), (dw, dvar, dP))
    with torch.no_grad():
        _, _, _, steps = _loop(x, save=True)
        G, mine = dP, {}
        for i in range(len(steps) - 1, -1, -1):
            dyn, st = steps[i]
            G, gi, dq, _ = covariance_step_adjoint(dyn, x["kt"][i], x["NBk"][i], st["saved"], G, q=x["q"][i],
                                                   qt=x["qt"][i], dW=dw[i], dvar=dvar[i])
            for name, t in (gi | {"q": dq}).items():
                mine.setdefault(name, [None] * len(steps))[i] = t
    mine = {name: torch.stack(t) for name, t in mine.items()} | {"P": G}
    for name, a in zip(leaves, auto, strict=True):
        b = mine[name].reshape(a.shape)
        if name in ("ratio", "base"):  # only the lower triangle of R, and the symmetric S, are read
            a = a.tril() if name == "ratio" else 0.5 * (a + a.mT)
            b = b.tril() if name == "ratio" else b
        if name == "ratio":
            a, b = a[..., 0].tril()[..., None], b[..., 0].tril()[..., None]
        err = (a - b).abs().max().item()
        assert err < 1e-10 * max(1.0, a.abs().max().item()), f"d{name}: |explicit - autograd| = {err:.2e}"
        assert a.abs().max() > 0, f"d{name} is identically zero; the comparison would be vacuous"


def test_adjoint_bad_input():
    x, _, _ = _prework(T=64)
    _, _, _, steps = _loop(x, save=True)
    dyn, st = steps[0]
    args = (dyn, x["kt"][0], x["NBk"][0])
    with pytest.raises(ValueError, match="saved"):
        covariance_step_adjoint(*args, [], x["P"])
    with pytest.raises(ValueError, match="dW"):
        covariance_step_adjoint(*args, st["saved"], x["P"], dW=st["W"][..., :1])
    with pytest.raises(ValueError, match="dP_next"):
        covariance_step_adjoint(*args, st["saved"], x["P"][..., :1])
    with pytest.raises(ValueError, match="fast path"):
        covariance_step_adjoint(*args, st["saved"], x["P"], dbeta=st["W"][..., 0])
