"""The transition factors of a chunk and the triangular inverse, shared by the covariance and mean passes.

Inside a chunk of ``C`` tokens every dynamics the library supports (identity, scalar, diagonal, damped 2×2
rotations) gives ``Φ_iΦ_j⁻¹`` (``i ≥ j``) as a per-channel factor (complex for rotations), built from
differences of cumulative log-decays and angles (docs/theory.md §5.5): :class:`ChunkDynamics` holds those
factors and applies them.  :func:`unit_lower_inverse` inverts the unit lower-triangular ``L`` of the
covariance pass and the ``I + T`` of the mean pass.
"""

from __future__ import annotations

import torch


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
        """The factors of every chunk of a block, as views (one autograd node per factor, see :func:`unbind_chunks`)."""
        factors = unbind_chunks(self.ratio, self.end, self.gamma, self.gamma_C)
        return [self.with_factors(*f) for f in zip(*factors, strict=True)]

    def with_factors(self, ratio, end, gamma, gamma_C) -> ChunkDynamics:
        """Dynamics of the same kind with these factors (one chunk's views, or leaves to differentiate)."""
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


def unbind_chunks(*xs: torch.Tensor | None) -> list:
    """Per-chunk views ``x.unbind(0)`` of block tensors ``[n, ...]`` for the chunk loops (None stays None).

    Not ``x[i]`` per chunk: under autograd each ``x[i]`` gets its own backward node that writes its
    gradient into a zero tensor of the whole block, n such fills of an ``[n, ...]`` tensor per block
    (quadratic in n; it was most of the backward time).  ``unbind`` has one node that stacks them.
    """
    return [x.unbind(0) if x is not None else None for x in xs]


def bmm_add(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``c + alpha · a @ b`` for ``[..., i, j]`` batches, as one fused ``baddbmm``."""
    lead = c.shape[:-2]
    out = torch.baddbmm(c.reshape(-1, *c.shape[-2:]), a.reshape(-1, *a.shape[-2:]),
                        b.reshape(-1, *b.shape[-2:]), alpha=alpha)
    return out.view(*lead, *out.shape[-2:])
