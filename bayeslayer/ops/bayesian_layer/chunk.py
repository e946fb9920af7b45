"""Chunked (training / prefill) paths: matmul-form covariance pass + WY/UT mean pass (docs/theory.md §5).

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

This is the PyTorch path only; :func:`bayeslayer.ops.bl_chunk` and ``DesignModel.chunk`` choose
between it and the Triton kernels in :mod:`bayeslayer.ops.backend` (this module imports neither).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..utils.validation import (
    COVARIANCE_DTYPE,
    check_chunk_size,
    check_cu_seqlens,
    check_state_precision,
    state_pair_error,
    values_checked,
)
from .prepare import FilterInputs, FilterOutput, prepare_inputs
from .write_models import WriteModel, get_write_model


def _to_c(x: torch.Tensor) -> torch.Tensor:
    """Real ``[..., D]`` -> complex ``[..., D/2]``: channel pair (2c, 2c+1) is (re, im)."""
    return torch.complex(x[..., 0::2].contiguous(), x[..., 1::2].contiguous())


def _conj(z: torch.Tensor) -> torch.Tensor:
    """The complex conjugate, computed (``z.conj()`` is a lazily negated view, which ``torch.func.vmap`` cannot
    batch; ``conj_physical`` has no batching rule either)."""
    return torch.complex(z.real, -z.imag)


def _from_c(z: torch.Tensor) -> torch.Tensor:
    return torch.stack((z.real, z.imag), dim=-1).flatten(-2)


class ChunkDynamics:
    """The transition factors of a block of chunks, for tensors laid out ``[..., C, ...]``.

    ``log_alpha``: ``[..., C, Da]`` (Da = 1, D or D/2); ``theta``: ``[..., C, D/2]`` or None.
    The leading dims are ``[n, B, H]`` for a block of n chunks (``dyn.unbind()`` gives each chunk's).
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
        ratio = diff.masked_fill_(~mask[..., None], float("-inf")).exp_()  # in place: one C×C tensor
        end = torch.exp(g[..., -1:, :] - g)  # Φ_C Φ_i⁻¹ magnitudes [B,H,C,Da]
        gamma = torch.exp(g)
        if self.rot:
            ang = torch.cumsum(theta, dim=-2)  # [B,H,C,D/2]
            dang = ang[..., :, None, :] - ang[..., None, :, :]
            ratio = ratio * torch.polar(torch.ones_like(dang), dang)  # masked entries stay 0
            end = end * torch.polar(torch.ones_like(ang), ang[..., -1:, :] - ang)
            gamma = gamma * torch.polar(torch.ones_like(ang), ang)
        self.ratio, self.end, self.gamma = ratio, end, gamma
        # a copy, not a view of gamma: Inductor (torch 2.13) miscompiles the backward when both gamma and a view
        # of it are unbound per chunk (tests/layers/test_compile.py, diagonal decay, gradients 30-90% off)
        self.gamma_C = gamma[..., -1:, :].clone()  # [B,H,1,Dd]

    def unbind(self) -> list[ChunkDynamics]:
        """The factors of every chunk of a block, as views (one autograd node per factor, see :func:`_unbind`)."""
        return [self._of(*f) for f in zip(*_unbind(self.ratio, self.end, self.gamma, self.gamma_C), strict=True)]

    def _of(self, ratio, end, gamma, gamma_C) -> ChunkDynamics:
        out = object.__new__(ChunkDynamics)
        out.rot, out.scalar = self.rot, self.scalar
        out.ratio, out.end, out.gamma, out.gamma_C = ratio, end, gamma, gamma_C
        return out

    # -- per-token transforms of vectors x: [..., C, D] -------------------------------------------
    def _mul(self, factor: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.rot:
            return _from_c(factor * _to_c(x))
        return factor * x

    def fwd(self, x):
        """``Φ_i x_i``."""
        return self._mul(self.gamma, x)

    def adj(self, x):
        """``Φ_iᵀ x_i``."""
        return self._mul(_conj(self.gamma) if self.rot else self.gamma, x)

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
            return torch.einsum("...ic,...ijc,...jc->...ij", _conj(_to_c(a)), self.ratio, _to_c(b)).real
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
        proj = (_conj(self.ratio) * _to_c(x)[..., :, None, :]).real  # Σ keeps the real part
        z = torch.einsum("...jlc,...jlc,...l->...jc", self.ratio, proj.to(self.ratio.dtype), ell2.to(self.ratio.dtype))
        return _from_c(z)

    def noise_quad(self, ell2: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """``x_jᵀ B_j x_j`` -> ``[B,H,C]``."""
        if not self.rot:
            return (b * x * x).sum(-1)
        proj = (_conj(self.ratio) * _to_c(x)[..., :, None, :]).real
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


#: the diagonal blocks :func:`unit_lower_inverse` inverts by a triangular solve before merging them
UNIT_INVERSE_BASE = 16


def unit_lower_inverse(L: torch.Tensor, base: int = UNIT_INVERSE_BASE) -> torch.Tensor:
    """Inverse of a unit lower-triangular ``[..., C, C]`` matrix, by blocked doubling.

    Diagonal blocks of size ``base`` are inverted by a batched triangular solve; then
    pairs of inverted blocks merge, ``[[A, 0], [B, D]]⁻¹ = [[A⁻¹, 0], [−D⁻¹ B A⁻¹, D⁻¹]]``,
    doubling the block size each round.  Almost all the work is batched matmuls, which on
    a CPU run several times faster per flop than LAPACK's small triangular solves.
    Falls back to one triangular solve when ``C`` is not ``base·2^k``.
    """
    C = L.shape[-1]
    eye = torch.eye(C, dtype=L.dtype, device=L.device)
    nb = C // base if C % base == 0 else 0
    if C <= base or nb == 0 or nb & (nb - 1):
        return torch.linalg.solve_triangular(L, eye.expand_as(L), upper=False, unitriangular=True)
    lead = L.shape[:-2]

    def diag_blocks(X: torch.Tensor, s: int) -> torch.Tensor:  # [..., C/s, s, s]
        Xb = X.reshape(*lead, C // s, s, C // s, s)
        return torch.diagonal(Xb, dim1=-4, dim2=-2).movedim(-1, -3)

    blocks = diag_blocks(L, base)
    inv = torch.linalg.solve_triangular(
        blocks, torch.eye(base, dtype=L.dtype, device=L.device).expand_as(blocks), upper=False, unitriangular=True
    )
    s = base
    while s < C:
        A, D = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        B = diag_blocks(L, 2 * s)[..., s:, :s]
        merged = A.new_empty(*A.shape[:-2], 2 * s, 2 * s)  # [..., C/(2s), 2s, 2s], written once
        merged[..., :s, :s] = A
        merged[..., :s, s:] = 0.0
        merged[..., s:, :s] = -(D @ B @ A)
        merged[..., s:, s:] = D
        inv = merged
        s *= 2
    return inv[..., 0, :, :]


def _unbind(*xs: torch.Tensor | None) -> list:
    """Per-chunk views ``x.unbind(0)`` of block tensors ``[n, ...]`` for the chunk loops (None stays None).

    Not ``x[i]`` per chunk: under autograd each ``x[i]`` gets its own backward node that writes its
    gradient into a zero tensor of the whole block, n such fills of an ``[n, ...]`` tensor per block
    (quadratic in n; it was most of the backward time).  ``unbind`` has one node that stacks them.
    """
    return [x.unbind(0) if x is not None else None for x in xs]


def variance_output(ctx, o: torch.Tensor, var: torch.Tensor | None) -> torch.Tensor:
    """The variance an autograd ``Function.forward`` of the op returns: ``var``, or without one an empty
    tensor (``ctx`` marks it non-differentiable), since a ``Function`` returns tensors only."""
    if var is None:
        var = o.new_zeros(0)
        ctx.mark_non_differentiable(var)
    return var


def pad_time(x: torch.Tensor | None, pad: int, value: float = 0.0) -> torch.Tensor | None:
    """Pad ``[B, T, ...]`` along T at the end."""
    if x is None or pad == 0:
        return x
    widths = [0, 0] * (x.dim() - 2) + [0, pad]
    return F.pad(x, widths, value=value)


def to_chunks(x: torch.Tensor | None, C: int) -> torch.Tensor | None:
    """``[B, T, H, ...] -> [N, B, H, C, ...]`` (T a multiple of C)."""
    if x is None:
        return None
    B, T, H = x.shape[:3]
    rest = x.shape[3:]
    x = x.reshape(B, T // C, C, H, *rest).movedim(2, 3)  # [B,N,H,C,...]
    return x.movedim(1, 0).contiguous()  # strided views would make every matmul copy


def cat_blocks(xs: list[torch.Tensor]) -> torch.Tensor:
    return xs[0] if len(xs) == 1 else torch.cat(xs)  # one block (the usual case): no copy


def from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """``[N, B, H, C, ...] -> [B, T, H, ...]`` (drops padding)."""
    N, B, H, C = x.shape[:4]
    rest = x.shape[4:]
    x = x.movedim(0, 1).movedim(3, 2).reshape(B, N * C, H, *rest)
    return x[:, :T]


class Chunked:
    """Padded, chunked views of a :class:`Prepared` call (``[N, B, H, C, ...]``)."""

    def __init__(self, pr, C: int, need_noise: bool):
        T = pr.dims.T
        self.T, self.C = T, C
        pad = (-T) % C
        self.pad = pad
        self.q = to_chunks(pad_time(pr.q, pad), C)
        self.k = to_chunks(pad_time(pr.k, pad), C)
        self.v = to_chunks(pad_time(pr.v, pad), C)
        # Padding tokens are exact no-ops: k = 0, α = 1, θ = 0, ℓ² = 0, r² = 1.
        self.r2 = to_chunks(pad_time(pr.r2, pad, 1.0), C) if need_noise else None
        self.ell2 = to_chunks(pad_time(pr.ell2, pad), C) if need_noise else None
        la = pr.dyn.log_alpha
        if la is None:
            la = pr.q.new_zeros(*pr.q.shape[:3], 1)
        self.log_alpha = to_chunks(pad_time(la, pad), C)
        self.theta = to_chunks(pad_time(pr.dyn.theta, pad), C)
        self.n = self.q.shape[0]

    def blocks(self, max_elems: int = 1 << 24):
        """Ranges of chunks processed together: the ``[n, B, H, C, C, Dd]`` ratio tensor stays bounded."""
        per_chunk = self.log_alpha[0].numel() * self.C
        if self.theta is not None:
            per_chunk = self.theta[0].numel() * self.C * 2
        step = max(1, max_elems // max(per_chunk, 1))
        for s in range(0, self.n, step):
            yield s, min(s + step, self.n)

    def dyn(self, s: int, e: int, dtype: torch.dtype | None = None) -> ChunkDynamics:
        theta = self.theta[s:e] if self.theta is not None else None
        if dtype is not None:  # the covariance pass runs in float64
            return ChunkDynamics(self.log_alpha[s:e].to(dtype), theta.to(dtype) if theta is not None else None)
        return ChunkDynamics(self.log_alpha[s:e], theta)


def _bmm_add(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``c + alpha · a @ b`` for ``[..., i, j]`` batches, as one fused ``baddbmm``."""
    lead = c.shape[:-2]
    out = torch.baddbmm(c.reshape(-1, *c.shape[-2:]), a.reshape(-1, *a.shape[-2:]),
                        b.reshape(-1, *b.shape[-2:]), alpha=alpha)
    return out.view(*lead, *out.shape[-2:])


def covariance_prework(dyn: ChunkDynamics, k: torch.Tensor, r2: torch.Tensor, ell2: torch.Tensor):
    """What the covariance loop needs that does not depend on ``P``, for a whole block of chunks.

    Returns ``(b, K̃, B k, base, B_C)``: the in-chunk process noise ``b`` (diagonal, None with
    rotations), ``k̃_j = Φ_jᵀ k_j``, ``B_j k_j``, the state-free part of ``S`` (symmetric
    ``N + Nᵀ − diag N + diag r²``) and the noise at the chunk end ``B_C`` (its diagonal
    ``[n,B,H,1,Da]`` without rotations, added to ``P``'s diagonal in the loop; dense with them).
    """
    b = None if dyn.rot else dyn.noise_diag(ell2)
    kt = dyn.adj(k)  # k̃_j = Φ_jᵀ k_j
    NBk = dyn.noise_vec(ell2, k, b)  # B_j k_j
    Nl = dyn.scores(k, NBk)  # k_iᵀ Φ_iΦ_j⁻¹ B_j k_j, lower incl. diagonal
    base = Nl + Nl.transpose(-1, -2)  # symmetric; its diagonal 2 N_ii becomes N_ii + r²_i below
    base.diagonal(dim1=-2, dim2=-1).add_(r2 - torch.diagonal(Nl, dim1=-2, dim2=-1))
    BC = b[..., -1:, :] if b is not None else dyn.noise_end(ell2, b, k.shape[-1])
    return b, kt, NBk, base, BC


def covariance_pass(
    dyn: ChunkDynamics,
    q: torch.Tensor | None,
    k: torch.Tensor,
    r2: torch.Tensor,
    ell2: torch.Tensor,
    P: torch.Tensor,
):
    """Covariance pass over a block of ``n`` consecutive chunks. Returns ``(w, variance, P_end)``.

    k, q: ``[n, B, H, C, D]``; r2, ell2: ``[n, B, H, C]``; P: ``[B, H, D, D]`` at the block start.
    ``w = β u`` are the write keys ``[n, B, H, C, D]``; variance ``[n, B, H, C]`` when q is given.
    Everything that does not depend on ``P`` (process-noise terms, decays) is computed for the
    whole block at once; the loop over chunks does only the P-dependent matmuls and the C×C
    Cholesky.
    """
    D = k.shape[-1]
    P0_max = torch.diagonal(P.detach(), dim1=-2, dim2=-1).amax()  # for the error message only
    b, kt, NBk, base, BC = covariance_prework(dyn, k, r2, ell2)
    ktT = kt.transpose(-1, -2)
    if q is not None:
        qt = dyn.adj(q)
        qBq = dyn.noise_quad(ell2, q, b)
    n = k.shape[0]
    if dyn.scalar:
        ratio, gamma, end = dyn.ratio[..., 0], dyn.gamma, dyn.end
        gC2 = dyn.gamma_C * dyn.gamma_C
        eye = torch.eye(D, dtype=P.dtype, device=P.device)
    ws, variances, infos = [], [], []
    kt, ktT, base, NBk, BC = _unbind(kt, ktT, base, NBk, BC)
    if q is not None:
        q, qt, qBq = _unbind(q, qt, qBq)
    if dyn.scalar:
        ratio, gamma, end, gC2 = _unbind(ratio, gamma, end, gC2)
    dyns = dyn.unbind()
    for i in range(n):
        Y = kt[i] @ P  # rows (P_0 k̃_j)ᵀ: the one D²C product
        S = _bmm_add(base[i], Y, ktT[i])
        # LAPACK is column-major: the upper factor of the row-major S is the cheap one, and its
        # transpose is the lower factor L_c already laid out the way the triangular solve wants it.
        Uc, info = torch.linalg.cholesky_ex(S, upper=True)
        infos.append(info)
        Lc = Uc.transpose(-1, -2)
        dc = torch.diagonal(Uc, dim1=-2, dim2=-1)  # sqrt(d_t)
        if dyn.scalar:
            # Σ_j (L⁻¹)_ij (Γ_i/Γ_j) X_j with X_j = Γ_j Y_j + B_j k_j: since L⁻¹ ⊙ R = (L ⊙ R)⁻¹ for the
            # rank-one ratio R_ij = Γ_i/Γ_j, this is one triangular solve (only safe ratios i ≥ j).  Solving
            # with the Cholesky factor L_c = L diag(√d) itself gives Ū = diag(√d)⁻¹ U, so w = βU = Ū/√d
            # and β_t u_t u_tᵀ = ū_t ū_tᵀ: no rescaling to a unit diagonal, and fewer small ops per chunk.
            X = torch.addcmul(NBk[i], gamma[i], Y)
            LR = (Uc * ratio[i].transpose(-1, -2)).transpose(-1, -2)  # L_c ⊙ R, column-major
            Ub = torch.linalg.solve_triangular(LR, X, upper=False)
            Ue = Ub * end[i]  # Φ_C Φ_i⁻¹ ū_i
            P_next = _bmm_add(torch.addcmul(eye * BC[i], P, gC2[i]), Ue.transpose(-1, -2), Ue, alpha=-1.0)
            if q is not None:
                Gq = dyns[i].scores(q[i], Ub)
                variances.append(1.0 + ((qt[i] @ P) * qt[i]).sum(-1) + qBq[i] - (Gq * Gq).sum(-1))
            ws.append(Ub / dc[..., None])
        else:
            d = dyns[i]
            beta = 1.0 / (dc * dc)
            L = Lc / dc[..., None, :]  # L = L_c diag(√d)⁻¹ is unit lower
            Linv = unit_lower_inverse(L)
            U = d.fwd(Linv @ Y) + d.mix(Linv, NBk[i])
            Ue = d.to_end(U)
            P_next = d.end_rows(d.end_rows(P).transpose(-1, -2))
            P_next = P_next + (BC[i] if dyn.rot else torch.diag_embed(BC[i][..., 0, :].expand(*P.shape[:-1])))
            P_next = P_next - (Ue.transpose(-1, -2) * beta[..., None, :]) @ Ue
            if q is not None:
                Gq = d.scores(q[i], U)  # q_tᵀ Φ_tΦ_i⁻¹ u_i
                variances.append(
                    1.0 + ((qt[i] @ P) * qt[i]).sum(-1) + qBq[i] - (Gq * Gq * beta[..., None, :]).sum(-1)
                )
            ws.append(beta[..., None] * U)
        # symmetrise every chunk: P's value and the gradients it passes back then do not depend on
        # how the sequence is split into blocks (the Triton backward recomputes block by block)
        P = torch.add(P_next, P_next.transpose(-1, -2)).mul_(0.5)
    failed = torch.stack(infos)
    if values_checked(failed) and bool(failed.any()):  # an eager value check: a compiled graph has none
        raise ValueError(
            f"bl_chunk: a chunk's prior observation covariance S = K̃ P K̃ᵀ + N + diag(r2) is not positive "
            f"definite in {P.dtype} (the prior variance p0 or the initial P reaches {float(P0_max):.3g}, r2 "
            f"goes down to {float(r2.detach().amin()):.3g}); the chunked path, whose covariance runs in "
            f"float64, is accurate for p0·‖k‖²/r2 up to about 1e12: use a smaller p0 or a larger r2"
        )
    var = torch.stack(variances) if q is not None else None
    return torch.stack(ws), var, P


def mean_pass(
    dyn: ChunkDynamics,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    M: torch.Tensor,
    erase: bool,
):
    """Generalised delta rule over a block of ``n`` chunks (module docstring). Returns ``(o, M_end)``.

    q, k, w: ``[n, B, H, C, D]``; v: ``[n, B, H, C, m]``; M: ``[B, H, D, m]``.  The intra-chunk
    UT transform ``(I + T)⁻¹ [V, K̃]`` is one batched triangular inverse for the whole block;
    the loop carries only the state (one or two fused matmul-adds per chunk), and the outputs
    ``Q̃ M_0 + A E`` of all chunks are two batched products after it.
    """
    qt = dyn.adj(q)
    A = dyn.scores(q, w)
    w_end = dyn.to_end(w).transpose(-1, -2)  # [n,B,H,D,C]
    if erase:
        Tm = dyn.scores(k, w)  # strictly lower part is T; its diagonal becomes the unit one of I + T
        Tm.diagonal(dim1=-2, dim2=-1).fill_(1.0)
        Ainv = unit_lower_inverse(Tm)  # UT transform (I + T)⁻¹
        Vp = Ainv @ v
        Kp = Ainv @ dyn.adj(k)
    decay = None if dyn.rot else dyn.gamma_C.transpose(-1, -2)  # [n,B,H,Da,1]: Φ_C on the key dim
    dyns = dyn.unbind() if dyn.rot else None
    w_end_, decay_ = _unbind(w_end, decay)
    if erase:
        Vp_, Kp_ = _unbind(Vp, Kp)
    else:
        v_ = v.unbind(0)
    states, Es = [], []
    for i in range(q.shape[0]):
        states.append(M)
        if erase:
            E = _bmm_add(Vp_[i], Kp_[i], M, alpha=-1.0)
            Es.append(E)
        else:
            E = v_[i]
        M = _bmm_add(dyns[i].end_rows(M) if decay is None else M * decay_[i], w_end_[i], E)
    E = torch.stack(Es) if erase else v
    o = qt @ torch.stack(states) + A @ E
    return o, M


def filter_chunk(
    q, k, v, *, write: str | WriteModel, r2=None, ell2=None, lam=None, gain=None, alpha=None, theta=None,
    p0=1.0, initial_state=None, output_final_state: bool = False, return_variance: bool = False,
    chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None,
) -> FilterOutput:
    """Chunked counterpart of :func:`bayeslayer.ops.bayesian_layer.recurrent.filter_recurrent`.

    ``bayes``: matmul-form covariance pass + mean pass, chunk-sequential.
    ``reset``: ``w = η k``, ``η = λ/(r² + λ‖k‖²)``; ``latent``: ``w = ω k``, ``ω = λ/(λ + r²)``, no erase
    (or ``η``/``ω`` given directly as ``gain``).
    ``diagonal``: the diagonal covariance is an O(D)-per-token scan (it is not
    matmul-shaped), then the chunked mean pass.
    ``gain`` is reported (``kᵀ w``) for every write model.
    ``cu_seqlens`` (``[N + 1]``, B = 1) runs N packed sequences, each from its own state
    (``initial_state`` and the final state then have N in place of B).
    """
    C = check_chunk_size(chunk_size)
    write = get_write_model(write)
    inputs = FilterInputs(r2, ell2, lam, gain, alpha, theta)
    if cu_seqlens is not None:
        return _filter_chunk_varlen(q, k, v, cu_seqlens, write, inputs, p0=p0, initial_state=initial_state,
                                    output_final_state=output_final_state, return_variance=return_variance,
                                    chunk_size=C)
    return _filter_chunk(q, k, v, write, inputs, p0=p0, initial_state=initial_state,
                         output_final_state=output_final_state, return_variance=return_variance, chunk_size=C)


def _filter_chunk(
    q, k, v, write: WriteModel, inputs: FilterInputs, *, p0, initial_state, output_final_state: bool,
    return_variance: bool, chunk_size: int,
) -> FilterOutput:
    """:func:`filter_chunk` of one sequence per batch row (``chunk_size`` checked)."""
    pr = prepare_inputs(q, k, v, write, inputs, p0=p0, initial_state=initial_state, keep_float64_state=True)
    B, T, Hf = pr.q.shape[:3]
    if T == 0 or B == 0:  # nothing to filter: empty outputs, the state as it came (as filter_recurrent)
        empty = pr.q.new_zeros(B, T, Hf)
        return pr.finish(pr.v.new_zeros(pr.v.shape), empty if return_variance else None, empty, pr.M0, pr.P0,
                         output_final_state)
    C = min(chunk_size, T)  # one chunk holds the whole sequence: a longer one would only pad it
    P = pr.P0
    cd = pr.q.dtype
    # the covariance runs in float64 whatever the inputs (validation.COVARIANCE_DTYPE): a static choice,
    # where float32 would lose small directions of P next to large ones (docs/reliability.md); the mean
    # pass runs in the compute dtype, and the state's P goes back in the dtype it came in
    pd = COVARIANCE_DTYPE if P is not None else cd
    if P is not None:
        state_dtype = P.dtype
        if output_final_state:
            check_state_precision(P, pr.k, pr.r2, name="the initial state (or p0·I)")
        P = P.to(pd)
    # write keys for the whole sequence, or None: the dense covariance pass gives them block by block
    write_keys, var, P = write.chunk_write_keys(pr, return_variance, P)
    per_block = write_keys is None
    ch = Chunked(pr, C, need_noise=per_block)
    wch = to_chunks(pad_time(write_keys, ch.pad), C) if write_keys is not None else None
    M = pr.M0
    outs, variances, ws = [], [], []
    for s, e in ch.blocks():
        dyn = ch.dyn(s, e)
        if per_block:
            qv = ch.q[s:e].to(pd) if return_variance else None
            w, var_b, P = covariance_pass(dyn if pd == cd else ch.dyn(s, e, pd), qv, ch.k[s:e].to(pd),
                                          ch.r2[s:e].to(pd), ch.ell2[s:e].to(pd), P)
            w = w.to(cd)
            variances.append(var_b.to(cd) if var_b is not None else None)
        else:
            w = wch[s:e]
        o, M = mean_pass(dyn, ch.q[s:e], ch.k[s:e], ch.v[s:e], w, M, erase=write.erase)
        outs.append(o)
        ws.append((w * ch.k[s:e]).sum(-1))  # the gain kᵀw, per token
    o = from_chunks(cat_blocks(outs), T)
    gain = from_chunks(cat_blocks(ws), T)
    if per_block and return_variance:
        var = from_chunks(cat_blocks(variances), T)
    if P is not None:
        P = P.to(state_dtype)
    return pr.finish(o, var, gain, M.to(cd), P, output_final_state)


def _filter_chunk_varlen(q, k, v, cu_seqlens, write: WriteModel, inputs: FilterInputs, *, initial_state,
                         output_final_state, **kw) -> FilterOutput:
    """Packed variable-length sequences: each segment of ``cu_seqlens`` is filtered on its own."""
    return run_packed(lambda q, k, v, inputs, initial_state: _filter_chunk(
        q, k, v, write, inputs, initial_state=initial_state, output_final_state=True, **kw),
        q, k, v, inputs, cu_seqlens, initial_state=initial_state, output_final_state=output_final_state)


def run_packed(run, q, k, v, inputs: FilterInputs, cu_seqlens, *, initial_state,
               output_final_state: bool) -> FilterOutput:
    """Run ``run(q, k, v, inputs, initial_state) -> FilterOutput`` (with its final state) on each of the N
    sequences that ``cu_seqlens`` packs along T (B = 1), and put the results back together: outputs,
    variances and gains along T, states along dim 0 (``initial_state`` and the final state hold one
    sequence per row).  The offsets are read on the host once."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, D], got {getattr(q, 'shape', type(q).__name__)}")
    cu = check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[1], q.device).tolist()
    n_seq = len(cu) - 1
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise state_pair_error("initial_state", initial_state)
        if not isinstance(initial_state[0], torch.Tensor) or initial_state[0].shape[0] != n_seq:
            raise ValueError(f"with cu_seqlens, initial_state holds one state per sequence (N={n_seq}) along dim 0")

    # per-token tensors are [1, T, ...]: split once along T (one backward node, not one zero-filled
    # full-size gradient per sequence as x[:, a:b] would give); numbers pass through
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]

    def segments(x):
        return x.split(lengths, 1) if isinstance(x, torch.Tensor) and x.dim() >= 3 else [x] * n_seq

    qs, ks, vs = segments(q), segments(k), segments(v)
    per_seq = inputs.map(segments)
    if initial_state is not None:
        M0s = initial_state[0].split(1, 0)
        P0s = initial_state[1].split(1, 0) if initial_state[1] is not None else [None] * n_seq
    outs = []
    for n in range(n_seq):
        st = (M0s[n], P0s[n]) if initial_state is not None else None
        outs.append(run(qs[n], ks[n], vs[n], per_seq.map(lambda val: val[n]), st))  # noqa: B023
    o = torch.cat([x.o for x in outs], 1)
    var = torch.cat([x.variance for x in outs], 1) if outs[0].variance is not None else None
    gain = torch.cat([x.gain for x in outs], 1) if outs[0].gain is not None else None
    state = None
    if output_final_state:
        Ps = [x.state[1] for x in outs]
        state = (torch.cat([x.state[0] for x in outs], 0), torch.cat(Ps, 0) if Ps[0] is not None else None)
    return FilterOutput(o, var, gain, state)
