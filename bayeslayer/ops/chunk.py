"""Chunked (training / prefill) paths: matmul-form covariance pass + WY/UT mean pass (SPEC §3.2).

Inside a chunk of ``C`` tokens that starts from ``(M_0, P_0)``, write
``Φ_t = A_t ⋯ A_1`` for the transition from the chunk start to token ``t``.
All dynamics the library supports (identity, scalar, diagonal, damped 2×2
rotations) form commuting families, so ``Φ_i Φ_j⁻¹`` (``i ≥ j``) is a per-channel
(complex, for rotations) factor ``ρ_ij = exp(g_i − g_j + i(ϑ_i − ϑ_j))`` with
``g`` the cumulative log-decay and ``ϑ`` the cumulative angle.  Only these
*ratios* with ``i ≥ j`` are ever formed, so nothing overflows however strong
the decay (no ``Γ⁻¹`` is materialised).

Covariance pass (per chunk, sequential across chunks)::

    k̃_j = Φ_jᵀ k_j ;  Y = K̃ P_0                         (C×D, one D²C matmul)
    S    = K̃ P_0 K̃ᵀ + N + diag(r²)                     (prior observation covariance, C×C)
    N_ij = k_iᵀ Φ_iΦ_j⁻¹ B_j k_j  (i ≥ j, symmetrised)   (B_j: process noise accrued in the chunk)
    S    = L_c L_cᵀ  (Cholesky; L = L_c diag(L_c)⁻¹, d = diag(L_c)², β = 1/d)
    u_i  = Φ_i (L⁻¹ Y)_i + Σ_{j≤i} (L⁻¹)_ij Φ_iΦ_j⁻¹ B_j k_j
    P_C  = Φ_C P_0 Φ_Cᵀ + B_C − Σ_i β_i (Φ_CΦ_i⁻¹ u_i)(Φ_CΦ_i⁻¹ u_i)ᵀ

Sequential Kalman conditioning on the chunk's observations *is* the LDLᵀ
factorisation of ``S``: ``u_i = Cov(s_i, e_i)`` with ``e = L⁻¹ y`` the innovations.

Mean pass (generalised delta rule: erase key ``k``, write key ``w = β u``)::

    (I + T) E = V − K̃ M_0,   T_ij = k_iᵀ Φ_iΦ_j⁻¹ w_j  (i > j)       [additive family: E = V]
    O   = Q̃ M_0 + A E,       A_ti = q_tᵀ Φ_tΦ_i⁻¹ w_i  (i ≤ t)
    M_C = Φ_C M_0 + Σ_i (Φ_CΦ_i⁻¹ w_i) e_iᵀ

Everything is batched matmuls and einsums plus one C×C Cholesky and triangular
solves per chunk; the Python loop runs over chunks, never over tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import Dynamics, check_chunk_size
from .prepare import FilterOutput, prepare


def _to_c(x: torch.Tensor) -> torch.Tensor:
    """Real ``[..., D]`` -> complex ``[..., D/2]``: channel pair (2c, 2c+1) is (re, im)."""
    return torch.complex(x[..., 0::2].contiguous(), x[..., 1::2].contiguous())


def _from_c(z: torch.Tensor) -> torch.Tensor:
    return torch.stack((z.real, z.imag), dim=-1).flatten(-2)


class ChunkDynamics:
    """The transition factors of one chunk, for tensors laid out ``[B, H, C, ...]``.

    ``log_alpha``: ``[B, H, C, Da]`` (Da = 1, D or D/2); ``theta``: ``[B, H, C, D/2]`` or None.
    Real per-channel factors for identity/scalar/diagonal, complex per-pair
    factors for rotations.
    """

    def __init__(self, log_alpha: torch.Tensor, theta: torch.Tensor | None):
        self.rot = theta is not None
        self.scalar = not self.rot and log_alpha.shape[-1] == 1
        g = torch.cumsum(log_alpha, dim=-2)  # [B,H,C,Da]
        C = g.shape[-2]
        mask = torch.ones(C, C, dtype=torch.bool, device=g.device).tril()
        diff = g[..., :, None, :] - g[..., None, :, :]  # [B,H,C(i),C(j),Da]
        ratio = torch.exp(torch.where(mask[..., None], diff, torch.full_like(diff, float("-inf"))))
        end = torch.exp(g[..., -1:, :] - g)  # Φ_C Φ_i⁻¹ magnitudes [B,H,C,Da]
        gamma = torch.exp(g)
        if self.rot:
            ang = torch.cumsum(theta, dim=-2)  # [B,H,C,D/2]
            dang = ang[..., :, None, :] - ang[..., None, :, :]
            ratio = ratio * torch.polar(torch.ones_like(dang), dang)  # masked entries stay 0
            end = end * torch.polar(torch.ones_like(ang), ang[..., -1:, :] - ang)
            gamma = gamma * torch.polar(torch.ones_like(ang), ang)
        self.ratio, self.end, self.gamma = ratio, end, gamma
        self.gamma_C = gamma[..., -1:, :]  # [B,H,1,Dd]
        self.mask = mask

    # -- per-token transforms of vectors x: [B,H,C,D] -------------------------------------------
    def _mul(self, factor: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.rot:
            return _from_c(factor * _to_c(x))
        return factor * x

    def fwd(self, x):
        """``Φ_i x_i``."""
        return self._mul(self.gamma, x)

    def adj(self, x):
        """``Φ_iᵀ x_i``."""
        return self._mul(self.gamma.conj() if self.rot else self.gamma, x)

    def to_end(self, x):
        """``Φ_C Φ_i⁻¹ x_i``."""
        return self._mul(self.end, x)

    def end_rows(self, X: torch.Tensor) -> torch.Tensor:
        """``Φ_C X`` for ``X: [B, H, D, n]`` (acts on the key dim)."""
        return self._mul(self.gamma_C, X.transpose(-1, -2)).transpose(-1, -2)

    # -- pairwise (C×C) contractions ---------------------------------------------------------------
    def scores(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``[.., i, j] = a_iᵀ Φ_iΦ_j⁻¹ b_j`` for ``i ≥ j`` (zero above the diagonal)."""
        if self.scalar:
            return (a @ b.transpose(-1, -2)) * self.ratio[..., 0]
        if self.rot:
            return torch.einsum("...ic,...ijc,...jc->...ij", _to_c(a).conj(), self.ratio, _to_c(b)).real
        return torch.einsum("...id,...ijd,...jd->...ij", a, self.ratio, b)

    def mix(self, L: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out_i = Σ_j L_ij Φ_iΦ_j⁻¹ x_j`` (``L`` lower-triangular C×C, x ``[B,H,C,D]``)."""
        if self.scalar:
            return (L * self.ratio[..., 0]) @ x
        if self.rot:
            return _from_c(torch.einsum("...ij,...ijc,...jc->...ic", L.to(self.ratio.dtype), self.ratio, _to_c(x)))
        return torch.einsum("...ij,...ijd,...jd->...id", L, self.ratio, x)

    # -- process noise accrued inside the chunk: B_j = Σ_{l≤j} ℓ_l² Φ_jΦ_l⁻¹ Σ (Φ_jΦ_l⁻¹)ᵀ -----------
    def noise_diag(self, ell2: torch.Tensor) -> torch.Tensor:
        """Non-rotation case: B_j is diagonal; returns its diagonal ``[B,H,C,Da]``."""
        return torch.einsum("...jld,...l->...jd", self.ratio * self.ratio, ell2)

    def noise_vec(self, ell2: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """``B_j x_j`` for x ``[B,H,C,D]``."""
        if not self.rot:
            return b * x
        proj = (self.ratio.conj() * _to_c(x)[..., :, None, :]).real  # Σ keeps the real part
        z = torch.einsum("...jlc,...jlc,...l->...jc", self.ratio, proj.to(self.ratio.dtype), ell2.to(self.ratio.dtype))
        return _from_c(z)

    def noise_quad(self, ell2: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """``x_jᵀ B_j x_j`` -> ``[B,H,C]``."""
        if not self.rot:
            return (b * x * x).sum(-1)
        proj = (self.ratio.conj() * _to_c(x)[..., :, None, :]).real
        return torch.einsum("...jlc,...l->...j", proj * proj, ell2)

    def noise_end(self, ell2: torch.Tensor, b: torch.Tensor | None, D: int) -> torch.Tensor:
        """``B_C`` as a dense ``[B, H, D, D]`` matrix."""
        if not self.rot:
            return torch.diag_embed(b[..., -1, :].expand(*b.shape[:-2], D))
        rho = self.ratio[..., -1, :, :]  # [B,H,C(l),D/2]
        f = torch.stack((rho.real, rho.imag), dim=-1)  # [B,H,l,c,2]
        blocks = torch.einsum("...lca,...lcb,...l->...cab", f, f, ell2)  # [B,H,D/2,2,2]
        eye = torch.eye(D // 2, dtype=blocks.dtype, device=blocks.device)
        full = torch.einsum("...cab,ce->...caeb", blocks, eye)
        return full.reshape(*blocks.shape[:-3], D, D)


def _pad_time(x: torch.Tensor | None, pad: int, value: float = 0.0) -> torch.Tensor | None:
    """Pad ``[B, T, ...]`` along T at the end."""
    if x is None or pad == 0:
        return x
    widths = [0, 0] * (x.dim() - 2) + [0, pad]
    return F.pad(x, widths, value=value)


def _chunks(x: torch.Tensor | None, C: int) -> torch.Tensor | None:
    """``[B, T, H, ...] -> [N, B, H, C, ...]`` (T a multiple of C)."""
    if x is None:
        return None
    B, T, H = x.shape[:3]
    rest = x.shape[3:]
    x = x.reshape(B, T // C, C, H, *rest).movedim(2, 3)  # [B,N,H,C,...]
    return x.movedim(1, 0)


def _unchunk(x: torch.Tensor, T: int) -> torch.Tensor:
    """``[N, B, H, C, ...] -> [B, T, H, ...]`` (drops padding)."""
    N, B, H, C = x.shape[:4]
    rest = x.shape[4:]
    x = x.movedim(0, 1).movedim(3, 2).reshape(B, N * C, H, *rest)
    return x[:, :T]


class _Chunked:
    """Padded, chunked views of a :class:`Prepared` call (``[N, B, H, C, ...]``)."""

    def __init__(self, pr, C: int, need_noise: bool):
        T = pr.dims.T
        self.T, self.C = T, C
        pad = (-T) % C
        self.q = _chunks(_pad_time(pr.q, pad), C)
        self.k = _chunks(_pad_time(pr.k, pad), C)
        self.v = _chunks(_pad_time(pr.v, pad), C)
        # Padding tokens are exact no-ops: k = 0, α = 1, θ = 0, ℓ² = 0, r² = 1.
        self.r2 = _chunks(_pad_time(pr.r2, pad, 1.0), C)
        self.ell2 = _chunks(_pad_time(pr.ell2, pad), C) if need_noise else None
        la = pr.dyn.log_alpha
        if la is None:
            la = pr.q.new_zeros(*pr.q.shape[:3], 1)
        self.log_alpha = _chunks(_pad_time(la, pad), C)
        self.theta = _chunks(_pad_time(pr.dyn.theta, pad), C)
        self.n = self.q.shape[0]

    def dyn(self, n: int) -> ChunkDynamics:
        return ChunkDynamics(self.log_alpha[n], self.theta[n] if self.theta is not None else None)


def covariance_chunk_step(
    dyn: ChunkDynamics,
    q: torch.Tensor | None,
    k: torch.Tensor,
    r2: torch.Tensor,
    ell2: torch.Tensor,
    P: torch.Tensor,
):
    """One chunk of the covariance pass. Returns ``(u, beta, variance_or_None, P_end)``.

    k, q: ``[B, H, C, D]``; r2, ell2: ``[B, H, C]``; P: ``[B, H, D, D]``.
    """
    D = k.shape[-1]
    C = k.shape[-2]
    b = None if dyn.rot else dyn.noise_diag(ell2)
    kt = dyn.adj(k)  # k̃_j = Φ_jᵀ k_j
    Y = kt @ P  # rows (P_0 k̃_j)ᵀ
    NBk = dyn.noise_vec(ell2, k, b)  # B_j k_j
    Nl = dyn.scores(k, NBk)  # lower incl. diagonal
    N = Nl + Nl.transpose(-1, -2) - torch.diag_embed(torch.diagonal(Nl, dim1=-2, dim2=-1))
    S = Y @ kt.transpose(-1, -2) + N + torch.diag_embed(r2)
    S = 0.5 * (S + S.transpose(-1, -2))
    Lc = torch.linalg.cholesky(S)
    dc = torch.diagonal(Lc, dim1=-2, dim2=-1)  # sqrt(d)
    beta = 1.0 / (dc * dc)
    eye = torch.eye(C, dtype=S.dtype, device=S.device).expand_as(S)
    Linv = torch.linalg.solve_triangular(Lc, eye, upper=False) * dc[..., :, None]  # unit-lower L⁻¹
    U = dyn.fwd(Linv @ Y) + dyn.mix(Linv, NBk)
    Ue = dyn.to_end(U)
    P_end = dyn.end_rows(dyn.end_rows(P).transpose(-1, -2)) + dyn.noise_end(ell2, b, D)
    P_end = P_end - (Ue.transpose(-1, -2) * beta[..., None, :]) @ Ue
    P_end = 0.5 * (P_end + P_end.transpose(-1, -2))
    var = None
    if q is not None:
        qt = dyn.adj(q)
        Gq = dyn.scores(q, U)  # q_tᵀ Φ_tΦ_i⁻¹ u_i
        var = 1.0 + ((qt @ P) * qt).sum(-1) + dyn.noise_quad(ell2, q, b) - (Gq * Gq * beta[..., None, :]).sum(-1)
    return U, beta, var, P_end


def mean_chunk_step(
    dyn: ChunkDynamics,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    M: torch.Tensor,
    erase: bool,
):
    """One chunk of the generalised delta rule (module docstring). Returns ``(o, M_end)``.

    q, k, w: ``[B, H, C, D]``; v: ``[B, H, C, m]``; M: ``[B, H, D, m]``.
    """
    qt = dyn.adj(q)
    if erase:
        Tm = dyn.scores(k, w).tril(-1)
        eye = torch.eye(Tm.shape[-1], dtype=Tm.dtype, device=Tm.device)
        rhs = v - dyn.adj(k) @ M
        E = torch.linalg.solve_triangular(Tm + eye, rhs, upper=False, unitriangular=True)
    else:
        E = v
    A = dyn.scores(q, w)
    o = qt @ M + A @ E
    M = dyn.end_rows(M) + dyn.to_end(w).transpose(-1, -2) @ E
    return o, M


def filter_chunk(
    q, k, v, *, write: str, r2=None, ell2=None, lam=None, gain=None, alpha=None, theta=None, p0=1.0,
    initial_state=None, output_final_state: bool = False, return_variance: bool = False,
    chunk_size: int = 64,
) -> FilterOutput:
    """Chunked counterpart of :func:`bayeslayer.ops.recurrent.filter_recurrent`.

    ``bayes``: matmul-form covariance pass + mean pass, one loop over chunks.
    ``reset``: ``w = η k``, ``η = λ/(r² + λ‖k‖²)``; ``latent``: ``w = ω k``, ``ω = λ/(λ + r²)``, no erase
    (or ``η``/``ω`` given directly as ``gain``).
    ``diagonal``: the diagonal covariance is an O(D)-per-token scan (it is not
    matmul-shaped), then the chunked mean pass.
    ``gain`` is reported (``kᵀ w``) for every write model.
    """
    C = check_chunk_size(chunk_size)
    pr = prepare(q, k, v, write=write, r2=r2, ell2=ell2, lam=lam, gain=gain, alpha=alpha, theta=theta,
                 p0=p0, initial_state=initial_state)
    B, T, Hf = pr.q.shape[:3]
    if T == 0:
        empty = pr.q.new_zeros(B, 0, Hf)
        return pr.finish(pr.v.new_zeros(pr.v.shape), empty, empty, pr.M0, pr.P0, output_final_state)
    write_keys = None
    var_full = None
    if write in ("reset", "latent"):
        write_keys = pr.coef[..., None] * pr.k
    elif write == "diagonal":
        write_keys, var_full, P_diag = _diagonal_cov_scan(pr, return_variance)
    ch = _Chunked(pr, C, need_noise=write == "bayes")
    wch = _chunks(_pad_time(write_keys, (-T) % C), C) if write_keys is not None else None
    M, P = pr.M0, pr.P0
    outs, variances, ws = [], [], []
    for n in range(ch.n):
        dyn = ch.dyn(n)
        if write == "bayes":
            U, beta, var, P = covariance_chunk_step(
                dyn, ch.q[n] if return_variance else None, ch.k[n], ch.r2[n], ch.ell2[n], P
            )
            w = beta[..., None] * U
            variances.append(var)
        else:
            w = wch[n]
        ws.append(w)
        o, M = mean_chunk_step(dyn, ch.q[n], ch.k[n], ch.v[n], w, M, erase=write != "latent")
        outs.append(o)
    o = _unchunk(torch.stack(outs), T)
    w_all = _unchunk(torch.stack(ws), T)
    gain = (w_all * pr.k).sum(-1)
    var = None
    if write == "bayes" and return_variance:
        var = _unchunk(torch.stack(variances), T)
    elif write == "diagonal":
        var, P = var_full, P_diag
    elif return_variance and write == "reset" and pr.lam is not None:
        # the reset family's posterior before its next reset: P_t = λ I − η λ k kᵀ
        qk = (pr.q * pr.k).sum(-1)
        var = 1.0 + pr.lam * (pr.q * pr.q).sum(-1) - pr.coef * pr.lam * qk * qk
    return pr.finish(o, var, gain, M, P, output_final_state)


def _diagonal_cov_scan(pr, want_var: bool):
    """Diagonal-covariance ablation: ``p̄ = diag(A P Aᵀ) + ℓ²σ``, ``u = p̄ ⊙ k``, ``P = diag(p̄ − β u²)``.

    O(D) per token; returns write keys ``β u`` ``[B, T, H', D]``, variance and the final ``P``.
    """
    from .recurrent import apply_transition, noise_mask

    dyn: Dynamics = pr.dyn
    B, T, H, D = pr.k.shape
    p = torch.diagonal(pr.P0, dim1=-2, dim2=-1)  # [B,H,D]
    sig = noise_mask(dyn, D, pr.k.dtype, pr.k.device)
    ws, vs = [], []
    for t in range(T):
        la_t = dyn.log_alpha[:, t] if dyn.log_alpha is not None else None
        th_t = dyn.theta[:, t] if dyn.theta is not None else None
        if dyn.kind == "rotation":
            Pm = torch.diag_embed(p)
            Pm = apply_transition(apply_transition(Pm, dyn.kind, la_t, th_t).transpose(-1, -2), dyn.kind, la_t, th_t)
            p_bar = torch.diagonal(Pm, dim1=-2, dim2=-1)
        elif dyn.kind == "identity":
            p_bar = p
        else:
            p_bar = torch.exp(2 * la_t) * p
        p_bar = p_bar + pr.ell2[:, t, :, None] * sig
        k_t = pr.k[:, t]
        u = p_bar * k_t
        beta = 1.0 / (pr.r2[:, t, :, None] + (k_t * u).sum(-1, keepdim=True))
        ws.append(beta * u)
        p = p_bar - beta * u * u
        if want_var:
            vs.append(1.0 + (pr.q[:, t] ** 2 * p).sum(-1))
    w = torch.stack(ws, 1)
    var = torch.stack(vs, 1) if want_var else None
    return w, var, torch.diag_embed(p)


def bl_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    r2,
    ell2,
    alpha=None,
    theta=None,
    p0=1.0,
    initial_state=None,
    output_final_state: bool = False,
    return_variance: bool = False,
    chunk_size: int = 64,
):
    """The Bayesian Layer, chunked: same contract and results as :func:`bl_recurrent`.

    Cost per token ≈ 2D² (``K̃ P_0`` and the ``P_C`` update) + O(C(D + m)) + O(Dm)
    multiply-adds, all matmul-shaped, plus a C×C Cholesky per chunk.  Diagonal and
    rotation dynamics use ``[C, C, D]`` ratio tensors (O(C·D) per token).
    """
    out = filter_chunk(
        q, k, v, write="bayes", r2=r2, ell2=ell2, alpha=alpha, theta=theta, p0=p0,
        initial_state=initial_state, output_final_state=output_final_state,
        return_variance=return_variance, chunk_size=chunk_size,
    )
    if return_variance:
        return out.o, out.variance, out.state
    return out.o, out.state
