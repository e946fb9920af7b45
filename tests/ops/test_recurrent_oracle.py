"""The recurrent oracle against docs/theory.md §2.1 and §3 written out with dense matrices.

Every other path is tested against ``filter_recurrent``; this file tests the oracle itself
against a separate, deliberately naive NumPy transcription: ``A_t`` built as an explicit D×D
matrix (block-diagonal damped rotations included), the process-noise mask ``Σ`` as a matrix,
one filter per batch element, head and noise group.  It pins down the conventions the oracle
relies on: channel pair ``(2c, 2c+1)`` is ``(re, im)``, noise enters the even channels only
with rotations, group ``g`` owns value columns ``g·m/G .. (g+1)·m/G − 1``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bayeslayer.ops import filter_recurrent

from .inputs import DYNAMICS, dynamics_inputs, random_psd


def _transition(alpha, theta, D: int) -> np.ndarray:
    """Dense ``A_t`` for one (batch, token, head): alpha None / scalar / [D] / [D/2]; theta None / [D/2]."""
    if theta is None:
        if alpha is None:
            return np.eye(D)
        return np.diag(np.broadcast_to(alpha, (D,)).astype(float))
    shrink = np.ones(D // 2) if alpha is None else np.broadcast_to(alpha, (D // 2,))
    A = np.zeros((D, D))
    for c in range(D // 2):
        cs, sn = np.cos(theta[c]), np.sin(theta[c])
        A[2 * c : 2 * c + 2, 2 * c : 2 * c + 2] = shrink[c] * np.array([[cs, -sn], [sn, cs]])
    return A


def dense_filter(write, q, k, v, r2, ell2, lam, alpha, theta, M0, P0):
    """NumPy reference. q, k [B,T,H,D]; v [B,T,H,m]; r2 [B,T,H,G]; ell2/lam [B,T,H] or None;
    M0 [B,H,D,m]; P0 [B,H,G,D,D].  Returns o, variance [B,T,H,G] (or None), gain [B,T,H,G], M, P."""
    B, T, H, D = q.shape
    m, G = v.shape[-1], r2.shape[-1]
    w = m // G
    sigma = np.diag([1.0 if (theta is None or d % 2 == 0) else 0.0 for d in range(D)])
    o = np.zeros((B, T, H, m))
    var = np.zeros((B, T, H, G))
    gain = np.zeros((B, T, H, G))
    M, P = M0.copy(), P0.copy()
    for b in range(B):
        for h in range(H):
            for g in range(G):
                cols = slice(g * w, (g + 1) * w)
                Mg, Pg = M[b, h][:, cols].copy(), P[b, h, g].copy()
                for t in range(T):
                    A = _transition(None if alpha is None else alpha[b, t, h],
                                    None if theta is None else theta[b, t, h], D)
                    kt, qt, vt = k[b, t, h], q[b, t, h], v[b, t, h, cols]
                    Mbar = A @ Mg
                    if write in ("bayes", "diagonal"):
                        Pbar = A @ Pg @ A.T + ell2[b, t, h] * sigma
                        if write == "diagonal":
                            Pbar = np.diag(np.diag(Pbar))
                        u = Pbar @ kt
                        beta = 1.0 / (r2[b, t, h, g] + kt @ u)
                        Mg = Mbar + beta * np.outer(u, vt - Mbar.T @ kt)
                        Pg = Pbar - beta * np.outer(u, u)
                        if write == "diagonal":
                            Pg = np.diag(np.diag(Pg))
                        var[b, t, h, g] = 1.0 + qt @ Pg @ qt
                        gain[b, t, h, g] = beta * (kt @ u)
                    elif write == "reset":
                        lt = lam[b, t, h]
                        eta = lt / (r2[b, t, h, g] + lt * kt @ kt)
                        Mg = Mbar + eta * np.outer(kt, vt - Mbar.T @ kt)
                        post = lt * np.eye(D) - eta * lt * np.outer(kt, kt)
                        var[b, t, h, g] = 1.0 + qt @ post @ qt
                        gain[b, t, h, g] = eta * (kt @ kt)
                    else:  # latent
                        omega = lam[b, t, h] / (lam[b, t, h] + r2[b, t, h, g])
                        Mg = Mbar + omega * np.outer(kt, vt)
                        gain[b, t, h, g] = omega * (kt @ kt)
                    o[b, t, h, cols] = Mg.T @ qt
                M[b, h][:, cols], P[b, h, g] = Mg, Pg
    return o, (None if write == "latent" else var), gain, M, P


def _np(x):
    return None if x is None else x.detach().numpy()


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("dynamics", DYNAMICS)
@pytest.mark.parametrize("write", ["bayes", "diagonal", "reset", "latent"])
def test_oracle_matches_dense_transcription(write, dynamics, G):
    B, T, H, D, m = 2, 6, 2, 4, 4
    dt = torch.float64
    q = torch.randn(B, T, H, D, dtype=dt)
    k = torch.randn(B, T, H, D, dtype=dt) / 2
    v = torch.randn(B, T, H, m, dtype=dt)
    r2 = 0.1 + torch.rand(B, T, H, G, dtype=dt)
    ell2 = 0.01 + 0.1 * torch.rand(B, T, H, dtype=dt)
    lam = 0.2 + torch.rand(B, T, H, dtype=dt)
    alpha, theta = dynamics_inputs(dynamics, B, T, H, D, low=0.7)
    M0 = torch.randn(B, H, D, m, dtype=dt)
    has_cov = write in ("bayes", "diagonal")
    P0 = random_psd(B, H, G, D=D)
    if write == "diagonal":
        P0 = torch.diag_embed(torch.diagonal(P0, dim1=-2, dim2=-1))
    noise = dict(r2=r2 if G > 1 else r2[..., 0])
    noise.update(dict(ell2=ell2) if has_cov else dict(lam=lam))
    state = (M0, P0 if G > 1 else P0[:, :, 0]) if has_cov else (M0, None)
    out = filter_recurrent(q, k, v, write=write, alpha=alpha, theta=theta, initial_state=state,
                           output_final_state=True, **noise)

    ref_o, ref_var, ref_gain, ref_M, ref_P = dense_filter(
        write, _np(q), _np(k), _np(v), _np(r2), _np(ell2), _np(lam), _np(alpha), _np(theta), _np(M0), _np(P0)
    )
    tol = dict(atol=1e-11, rtol=1e-10)
    np.testing.assert_allclose(out.o.numpy(), ref_o, **tol)
    np.testing.assert_allclose(out.gain.numpy(), ref_gain, **tol)
    np.testing.assert_allclose(out.state[0].numpy(), ref_M, **tol)
    if ref_var is None:
        assert out.variance is None
    else:
        np.testing.assert_allclose(out.variance.numpy(), ref_var, **tol)
    if has_cov:
        P = out.state[1].numpy()
        np.testing.assert_allclose(P if G > 1 else P[:, :, None], ref_P, **tol)


def test_output_is_exactly_the_mean_readout():
    """``o_t = M_tᵀ q_t`` with no hidden scaling: a one-token call read back from its own state."""
    B, H, D, m = 1, 1, 3, 2
    dt = torch.float64
    q = torch.randn(B, 1, H, D, dtype=dt)
    k = torch.tensor([[[[1.0, 0.0, 0.0]]]], dtype=dt)
    v = torch.tensor([[[[2.0, -1.0]]]], dtype=dt)
    r2, ell2, p0 = 0.5, 0.25, 3.0
    out = filter_recurrent(q, k, v, write="bayes", r2=r2, ell2=ell2, p0=p0, output_final_state=True)
    # P̄ = (p0 + ℓ²) I, u = P̄ k, β = 1/(r² + p0 + ℓ²): M = β u vᵀ has one non-zero row
    gain = (p0 + ell2) / (r2 + p0 + ell2)
    M_expected = torch.zeros(B, H, D, m, dtype=dt)
    M_expected[0, 0, 0] = gain * v[0, 0, 0]
    torch.testing.assert_close(out.state[0], M_expected)
    torch.testing.assert_close(out.o[0, 0, 0], M_expected[0, 0].T @ q[0, 0, 0])
    torch.testing.assert_close(out.gain[0, 0, 0, 0], torch.tensor(gain, dtype=dt))
