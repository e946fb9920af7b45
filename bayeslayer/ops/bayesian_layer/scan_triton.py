"""The segment-scan forward on a GPU (docs/theory.md §6.3).

:func:`forward_scan_triton` runs the covariance pass as the exact segment scan of
:mod:`bayeslayer.ops.bayesian_layer.scan` and the mean pass on flash-linear-attention's kernels:

=========  =====================================================================  =====================
phase      what runs                                                              grid / order
=========  =====================================================================  =====================
prep       :func:`prep_triton`: :func:`bayeslayer.ops.bayesian_layer.kernels_triton.             (chunks, H'):
           bl_chunk_prep_kernel`, the P-free terms of every chunk (g, b, the      parallel over chunks
           base of S, qᵀBq), read by the covariance kernel of A and C (PREP)
A          :func:`phase_a_triton`: the covariance kernel from P = 0 over the      (segments, H'):
           segments, then :func:`scan_track_kernel` (float64)                     parallel over segments
B          :func:`phase_b_triton`: :func:`scan_phase_b_kernel`, the Cholesky      (sequences, H'):
           form in LDLᵀ factors, 16×16 ``tl.dot`` tiles (float64)                 serial over segments
C          :func:`bayeslayer.ops.bayesian_layer.kernels_triton.bl_chunk_cov_kernel` launched     (segments, H'):
           with the *segments* as its sequences, each from its ``P_s``            parallel over segments
C'         ``L⁻¹(γ⊙K)``, ``L⁻¹V`` from the stored ``L⁻¹`` rows (batched matmul)   parallel over chunks
mean       :func:`bayeslayer.ops.bayesian_layer.mean_pass_fla.mean_pass_fla` (fla's ``fwd_h`` +       as GDN
           ``fwd_o``), or the PyTorch twin for float64 / without fla
=========  =====================================================================  =====================

Phase C reuses the covariance kernel of the chunk-serial path: a segment is a run of whole
chunks of one sequence, so launching that kernel over the segment boundaries (``cu_seg``) from
the scanned segment-start covariances replays exactly the chunks of the chunk-serial pass,
``S_g`` times shorter per program.  Every factorisation (the per-chunk ``S``, Phase B's ``P_s``
and ``I + GᵀJG``) is the blocked LDLᵀ of :mod:`..utils.ldl_triton`; failures go to device-side flags that
are checked once, after the pass.  Forward only (no autograd).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..utils.ldl_triton import ldl_blocked
from . import scan as sc
from .kernels_triton import bl_chunk_cov_kernel, bl_chunk_mean_kernel, bl_chunk_prep_kernel
from .triton_support import MAX_HEAD_DIM, next_pow2, tile_sizes

SUPPORTED_CHUNK_SIZES = (16, 32, 64)
# fp32 tl.dot products of the mean kernel stay IEEE (a Kalman gain needs fp32; see ops/bayesian_layer/chunk_triton.py)
PREC = "ieee"
# Phase C's fp32 products: "ieee" (FFMA) or "tf32x3" (split precision: three TF32 tensor-core products per
# product, measured as accurate as IEEE in the typical, long-memory and stress regimes by an emulation, and
# compiled to HMMA/HGMMA for sm_90; docs/kernels.md "Tensor-core covariance products").  IEEE stays the default
# until a GPU run has timed both and checked tf32x3's values on the device.
COV_PRECISIONS = ("ieee", "tf32x3")
COV_PRECISION = "ieee"


@triton.jit
def scan_track_kernel(
    W, KW, BETA, la, cu_seg, segs, A, J, Hscr,
    H: tl.constexpr,
    D: tl.constexpr,
    C: tl.constexpr,
    BD: tl.constexpr,
    BK: tl.constexpr,
    DIAG: tl.constexpr,
    PREC: tl.constexpr,
):
    """Phase A's tracking for one (segment ``segs[i]``, head): the segment transition and information.

    From the P = 0 run of the segment (W = βU, KW = L⁻¹(γ⊙K), β per token, all ``[NT, H, ·]``),
    per chunk, serial over the segment's chunks, with ``W̃_i = Φ_CΦ_i⁻¹ w_i``::

        Hm = KW A ;   A ← Φ_C A − W̃ᵀ Hm ;   J += Hmᵀ diag(β) Hm

    A ``[n, H, D, D]`` holds I on entry, J zeros; Hscr ``[n, H, C, BD]`` is per-program scratch.
    This is fla's ``fwd_h`` recurrence with a D×D state (u = 0, h0 = I) plus the J accumulation,
    in the dtype of A (float64 for Phase A).
    """
    i_s = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    seg = tl.load(segs + i_s).to(tl.int64)
    bos = tl.load(cu_seg + seg).to(tl.int64)
    eos = tl.load(cu_seg + seg + 1).to(tl.int64)
    n_chunks = tl.cdiv(eos - bos, C)
    rows = tl.arange(0, C)
    offs = tl.arange(0, BK)
    dt = A.dtype.element_ty
    A_base = A + (i_s * H + i_h) * D * D
    J_base = J + (i_s * H + i_h) * D * D
    H_base = Hscr + (i_s * H + i_h) * C * BD
    for i_c in range(n_chunks):
        tok = bos + i_c * C + rows
        valid = tok < eos
        beta = tl.load(BETA + tok * H + i_h, mask=valid, other=0.0).to(dt)
        if not DIAG:
            lac = tl.load(la + tok * H + i_h, mask=valid, other=0.0).to(dt)
            g = tl.cumsum(lac, axis=0)
            g_end = tl.sum(lac, axis=0)
        # Hm = KW A, column block by column block (A is read before any of it is updated)
        for ob in range(0, BD, BK):
            o2 = ob + offs
            hm = tl.zeros([C, BK], dtype=dt)
            for ib in range(0, BD, BK):
                o1 = ib + offs
                kw = tl.load(KW + (tok[:, None] * H + i_h) * D + o1[None, :],
                             mask=valid[:, None] & (o1[None, :] < D), other=0.0).to(dt)
                a = tl.load(A_base + o1[:, None] * D + o2[None, :], mask=(o1[:, None] < D) & (o2[None, :] < D),
                            other=0.0)
                hm += tl.dot(kw, a, input_precision=PREC)
            tl.store(H_base + rows[:, None] * BD + o2[None, :], hm)
        tl.debug_barrier()
        for ib in range(0, BD, BK):
            o1 = ib + offs
            w1 = tl.load(W + (tok[:, None] * H + i_h) * D + o1[None, :], mask=valid[:, None] & (o1[None, :] < D),
                         other=0.0).to(dt)
            if DIAG:
                g1 = tl.cumsum(tl.load(la + (tok[:, None] * H + i_h) * D + o1[None, :],
                                       mask=valid[:, None] & (o1[None, :] < D), other=0.0).to(dt), axis=0)
                g1_end = tl.sum(tl.where(rows[:, None] == C - 1, g1, 0.0), axis=0)
                w1 = tl.exp(g1_end[None, :] - g1) * w1
                dec = tl.exp(g1_end)[:, None]
            else:
                w1 = tl.exp(g_end - g)[:, None] * w1
                dec = tl.exp(g_end)
            h1 = tl.load(H_base + rows[:, None] * BD + o1[None, :])
            h1b = beta[:, None] * h1
            for ob in range(0, BD, BK):
                o2 = ob + offs
                m = (o1[:, None] < D) & (o2[None, :] < D)
                h2 = tl.load(H_base + rows[:, None] * BD + o2[None, :])
                pa = A_base + o1[:, None] * D + o2[None, :]
                pj = J_base + o1[:, None] * D + o2[None, :]
                a = tl.load(pa, mask=m, other=0.0)
                tl.store(pa, dec * a - tl.dot(tl.trans(w1), h2, input_precision=PREC), mask=m)
                jj = tl.load(pj, mask=m, other=0.0)
                tl.store(pj, jj + tl.dot(tl.trans(h1b), h2, input_precision=PREC), mask=m)
        tl.debug_barrier()


@triton.jit
def load_block(src, ib, jb, r, D: tl.constexpr, BLK: tl.constexpr, PAD_EYE: tl.constexpr):
    """Block ``(ib, jb)`` of a row-major ``[D, D]`` matrix, zero outside (identity on the padded diagonal)."""
    ri = ib * BLK + r
    cj = jb * BLK + r
    x = tl.load(src + ri[:, None] * D + cj[None, :], mask=(ri[:, None] < D) & (cj[None, :] < D), other=0.0)
    if PAD_EYE:
        x = tl.where((ri[:, None] == cj[None, :]) & (ri[:, None] >= D), 1.0, x)
    return x


@triton.jit
def sblock(buf, ib, jb, r, BN: tl.constexpr, BLK: tl.constexpr):
    """Pointers to block ``(ib, jb)`` of a row-major ``[BN, BN]`` scratch matrix."""
    return buf + (ib * BLK + r[:, None]) * BN + (jb * BLK + r[None, :])


@triton.jit
def sym_update(dst, S, Lm, Rm, r, D: tl.constexpr, NB: tl.constexpr, BLK: tl.constexpr, BN: tl.constexpr,
               PREC: tl.constexpr, GRAM: tl.constexpr, IN_PLACE: tl.constexpr):
    """``dst = sym(S) + Lm Lmᵀ`` (``GRAM``) or ``dst = sym(S) + Lmᵀ Rm``, row-major ``[D, D]`` matrices ``dst``, ``S``
    and ``[BN, BN]`` scratch ``Lm``, ``Rm``, in 16×16 blocks: lower blocks, each written with its transpose
    above, so that ``dst`` is exactly symmetric.  ``IN_PLACE``: ``dst`` is ``S``, and each block of ``S`` is
    read (both triangles) before it and its mirror are written."""
    for ib in range(NB):
        for jb in range(ib + 1):
            acc = 0.5 * (load_block(S, ib, jb, r, D, BLK, False) + tl.trans(load_block(S, jb, ib, r, D, BLK, False)))
            for kb in range(NB):
                if GRAM:
                    Zj = tl.load(sblock(Lm, jb, kb, r, BN, BLK))
                    acc += tl.dot(tl.load(sblock(Lm, ib, kb, r, BN, BLK)), tl.trans(Zj), input_precision=PREC)
                else:
                    Aki = tl.load(sblock(Lm, kb, ib, r, BN, BLK))
                    acc += tl.dot(tl.trans(Aki), tl.load(sblock(Rm, kb, jb, r, BN, BLK)), input_precision=PREC)
            if ib == jb:
                acc = 0.5 * (acc + tl.trans(acc))
            ri = ib * BLK + r
            cj = jb * BLK + r
            if IN_PLACE:
                tl.debug_barrier()
            tl.store(dst + ri[:, None] * D + cj[None, :], acc, mask=(ri[:, None] < D) & (cj[None, :] < D))
            tl.store(dst + cj[:, None] * D + ri[None, :], tl.trans(acc), mask=(cj[:, None] < D) & (ri[None, :] < D))


@triton.jit
def times_g(Msrc, X, DP, TT, r, D: tl.constexpr, NB: tl.constexpr, BLK: tl.constexpr, BN: tl.constexpr,
             PREC: tl.constexpr):
    """``TT = M G`` with ``G = L_P D_P^½`` (L_P's lower blocks in scratch X, D_P in DP), M a row-major
    ``[D, D]`` matrix read in 16×16 blocks: ``(M G)_ij = Σ_{k≥j} M_ik (L_P)_kj · D_P,j^½`` (G_kj = 0 for k < j)."""
    for ib in range(NB):
        for jb in range(NB):
            acc = tl.zeros([BLK, BLK], dtype=TT.dtype.element_ty)
            for kb in range(jb, NB):
                acc += tl.dot(load_block(Msrc, ib, kb, r, D, BLK, False), tl.load(sblock(X, kb, jb, r, BN, BLK)),
                              input_precision=PREC)
            tl.store(sblock(TT, ib, jb, r, BN, BLK), acc * tl.sqrt(tl.load(DP + jb * BLK + r))[None, :])


@triton.jit
def woodbury_scratch(SCR, i_n, i_h, H, BN: tl.constexpr, N_MATS: tl.constexpr):
    """The per-program scratch of Phase B and B3 (one (sequence, head) program each): ``N_MATS`` row-major
    ``[BN, BN]`` matrices, then two ``[BN]`` vectors.  Returns ``(X, LI, MM, TT, DP, DM)``: the first four
    matrices and the two vectors (a kernel with ``N_MATS > 4`` finds its own after ``TT``)."""
    X = SCR + (i_n * H + i_h) * (N_MATS * BN * BN + 2 * BN)
    DP = X + N_MATS * BN * BN
    return X, X + BN * BN, X + 2 * BN * BN, X + 3 * BN * BN, DP, DP + BN


@triton.jit
def woodbury_factors(Pin, Jm, X, LI, MM, TT, DP, DM, r, D: tl.constexpr, NB: tl.constexpr, BLK: tl.constexpr,
                     BN: tl.constexpr, PREC: tl.constexpr):
    """The factorisations Phase B and B3 both start a segment with, in scratch: ``P_s = L_P D_P L_Pᵀ`` (``P_s``,
    row-major ``[D, D]`` at ``Pin``, padded with the identity; X: L_P's lower blocks, DP: D_P, pivots floored at
    0), ``TT = J G`` (``J`` at ``Jm``, ``G = L_P D_P^½``) and ``M = I + GᵀJG = L_M D_M L_Mᵀ`` (MM: M's lower
    blocks, LI: L_M⁻¹, DM: D_M, pivots floored at 1), every product a 16×16-tile ``tl.dot`` in ``Pin``'s dtype.
    Returns how many pivots were not positive."""
    dt = Pin.dtype.element_ty
    rn = tl.arange(0, BN)
    eye = r[:, None] == r[None, :]
    for ib in range(NB):
        for jb in range(ib + 1):
            tl.store(sblock(X, ib, jb, r, BN, BLK), load_block(Pin, ib, jb, r, D, BLK, True))
    tl.store(DP + rn, tl.zeros([BN], dtype=dt))  # floors: a pivot of P must be > 0
    tl.store(DM + rn, tl.zeros([BN], dtype=dt) + 1.0)  # M = I + GᵀJG ⪰ I: its pivots are ≥ 1
    tl.debug_barrier()
    fail = ldl_blocked(X, LI, DP, NB, BLK, PREC)  # X: L_P, DP: D_P
    times_g(Jm, X, DP, TT, r, D, NB, BLK, BN, PREC)  # TT = J G
    tl.debug_barrier()
    # M = I + Gᵀ (JG), lower blocks
    for ib in range(NB):
        sdi = tl.sqrt(tl.load(DP + ib * BLK + r))
        for jb in range(ib + 1):
            acc = tl.where((ib == jb) & eye, 1.0, 0.0).to(dt)
            for kb in range(ib, NB):
                G_ki = tl.load(sblock(X, kb, ib, r, BN, BLK)) * sdi[None, :]
                acc += tl.dot(tl.trans(G_ki), tl.load(sblock(TT, kb, jb, r, BN, BLK)), input_precision=PREC)
            tl.store(sblock(MM, ib, jb, r, BN, BLK), acc)
    tl.debug_barrier()
    fail += ldl_blocked(MM, LI, DM, NB, BLK, PREC)  # LI: L_M⁻¹, DM: D_M
    return fail


@triton.jit
def times_lm_inv_t(TT, LI, DM, X, r, NB: tl.constexpr, BLK: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
                   HALF: tl.constexpr):
    """``X = TT L_M⁻ᵀ D_M^-½`` (``HALF``) or ``X = TT L_M⁻ᵀ D_M⁻¹``, in scratch: TT's blocks by the lower
    blocks of ``L_M⁻¹`` (LI) transposed, each column scaled by the pivots ``D_M`` (DM)."""
    for ib in range(NB):
        for jb in range(NB):
            acc = tl.zeros([BLK, BLK], dtype=TT.dtype.element_ty)
            for kb in range(jb + 1):
                Ljk = tl.load(sblock(LI, jb, kb, r, BN, BLK))
                acc += tl.dot(tl.load(sblock(TT, ib, kb, r, BN, BLK)), tl.trans(Ljk), input_precision=PREC)
            dm = tl.load(DM + jb * BLK + r)
            if HALF:
                dm = tl.sqrt(dm)
            tl.store(sblock(X, ib, jb, r, BN, BLK), acc / dm[None, :])


@triton.jit
def scan_phase_b_kernel(
    PS, A, CM, J, elem_of_seg, seq_first, seq_nseg, SCR, FAIL,
    H: tl.constexpr,
    D: tl.constexpr,
    NB: tl.constexpr,
    PREC: tl.constexpr,
):
    """Phase B for one (sequence, head): P at the start of each of its segments, serial over them.

    ``P_{s+1} = Z Zᵀ + C_s`` with ``Z = A_s G R⁻ᵀ``, ``G = chol(P_s)``, ``R = chol(I + GᵀJ_sG)``, in
    LDLᵀ form: ``P_s = L_P D_P L_Pᵀ`` (G = L_P D_P^½), ``M = I + GᵀJG = L_M D_M L_Mᵀ`` (pivots ≥ 1),
    ``Z = A L_P D_P^½ L_M⁻ᵀ D_M^-½``; both factorisations are :func:`..utils.ldl_triton.ldl_blocked` (16×16 tiles,
    ``tl.dot``), every product is a 16×16-tile ``tl.dot``, and the result is exactly symmetric (each
    lower block is written with its transpose above).  PSD by construction.
    PS ``[S, H, D, D]`` holds ``P`` of each sequence's first segment on entry; A, CM, J
    ``[n, H, D, D]`` the segment elements, segment ``s``'s at ``elem_of_seg[s]``; SCR
    ``[N, H, 4·BN² + 2·BN]`` scratch (``BN = 16·NB ≥ D``); FAIL ``[N, H]`` int32 counts pivots that were
    not positive (P_s not positive definite).  Arithmetic in PS's dtype (float64 for the scan).
    """
    BLK: tl.constexpr = 16
    BN: tl.constexpr = NB * BLK
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    r = tl.arange(0, BLK)
    X, LI, MM, TT, DP, DM = woodbury_scratch(SCR, i_n, i_h, H, BN, 4)
    first = tl.load(seq_first + i_n).to(tl.int64)
    nseg = tl.load(seq_nseg + i_n).to(tl.int64)
    fail = tl.sum(tl.zeros([BLK], dtype=tl.int32), axis=0)
    for j in range(nseg - 1):
        s = first + j
        e = tl.load(elem_of_seg + s).to(tl.int64)
        Pin = PS + (s * H + i_h) * D * D
        Pout = PS + ((s + 1) * H + i_h) * D * D
        Ae = A + (e * H + i_h) * D * D
        Je = J + (e * H + i_h) * D * D
        Ce = CM + (e * H + i_h) * D * D
        fail += woodbury_factors(Pin, Je, X, LI, MM, TT, DP, DM, r, D, NB, BLK, BN, PREC)  # T = J G
        times_g(Ae, X, DP, TT, r, D, NB, BLK, BN, PREC)  # T = A G
        tl.debug_barrier()
        times_lm_inv_t(TT, LI, DM, X, r, NB, BLK, BN, PREC, True)  # Z = T L_M⁻ᵀ D_M^-½ (X: L_P no longer needed)
        tl.debug_barrier()
        sym_update(Pout, Ce, X, X, r, D, NB, BLK, BN, PREC, True, False)  # P_{s+1} = sym(C) + Z Zᵀ
        tl.debug_barrier()
    tl.store(FAIL + i_n * H + i_h, fail)


def woodbury_launch(S: int, segs: torch.Tensor, N: int, Hf: int, D: int, n_mats: int, dtype: torch.dtype, device):
    """What Phase B's and B3's kernels are launched with, for ``S`` segments of ``N`` sequences: ``elem_of_seg``
    ``[S]`` int64 (segment ``segs[i]``'s element is row ``i``; −1: none), ``NB`` (16×16 blocks per side of ``D``)
    and the per-program scratch ``[N, H', n_mats·BN² + 2·BN]`` that :func:`woodbury_scratch` splits
    (``BN = 16·NB``)."""
    elem = torch.full((S,), -1, dtype=torch.int64, device=device)
    elem[segs] = torch.arange(segs.numel(), device=device)
    NB = max(16, next_pow2(D)) // 16
    BN = 16 * NB
    return elem, NB, torch.empty(N, Hf, n_mats * BN * BN + 2 * BN, dtype=dtype, device=device)


def phase_b_triton(lay: sc.ScanLayout, P0: torch.Tensor, elements):
    """Phase B as one kernel: P at the start of every segment ``[S, H', D, D]``, and ``failed [N, H']``.

    Arguments and results as :func:`bayeslayer.ops.bayesian_layer.scan.phase_b` (``P0 [N, H', D, D]``,
    ``elements = (A, C, J, segs)``); one launch of :func:`scan_phase_b_kernel` over (sequence, head),
    serial over each sequence's segments inside its program: no host loop, no host sync.
    Arithmetic in P0's dtype (float64 for the scan).
    """
    A, Cm, J, segs = elements
    N, Hf, D = P0.shape[0], P0.shape[1], P0.shape[-1]
    S, dev, dt = lay.n_segments, P0.device, P0.dtype
    P_starts = P0.new_zeros(S, Hf, D, D)
    P_starts[lay.seq_first_seg] = P0
    fail = torch.zeros(N, Hf, dtype=torch.int32, device=dev)
    if segs.numel() == 0:
        return P_starts, fail != 0
    elem, NB, scr = woodbury_launch(S, segs, N, Hf, D, 4, dt, dev)
    scan_phase_b_kernel[(N, Hf)](
        P_starts, A.to(dt).contiguous(), Cm.to(dt).contiguous(), J.to(dt).contiguous(), elem, lay.seq_first_seg,
        lay.seq_n_seg, scr, fail, H=Hf, D=D, NB=NB, PREC="ieee", num_warps=4,
    )
    return P_starts, fail != 0


class Prep(NamedTuple):
    """The prep kernel's per-chunk buffers (:func:`prep_triton`) and where each segment's chunks start.

    g, b ``[NC, H', C, Da]``, base ``[NC, H', C, C]``, qBq ``[NC, H', C]`` or None; ``seg_first``
    ``[S]`` (int64): the first chunk of every segment of the layout it was made for.
    """

    g: torch.Tensor
    b: torch.Tensor
    base: torch.Tensor
    qBq: torch.Tensor | None
    seg_first: torch.Tensor

    def kernel_args(self) -> dict:
        """The covariance kernel's PREP keyword arguments."""
        return dict(PG=self.g, PB=self.b, PBASE=self.base, PQN=self.qBq if self.qBq is not None else self.g,
                    chunk_first=self.seg_first, PREP=True)


def prep_triton(lay: sc.ScanLayout, q, k, r2, ell2, log_alpha, *, dtype: torch.dtype, want_var: bool) -> Prep:
    """The prep kernel (docs/theory.md §6.7, F1): the P-free terms of every chunk, one program per (chunk, head).

    Packed inputs ``[NT, H', ·]`` as :class:`bayeslayer.ops.bayesian_layer.scan.ScanCall`'s (log_alpha ``[NT, H',
    Da]``); the chunks are those of ``lay.cu`` (:func:`bayeslayer.ops.bayesian_layer.scan.chunk_bounds`; the layout's
    segments are runs of them).  Buffers in ``dtype`` (the covariance kernel's state dtype); ``want_var``
    adds ``qᵀBq`` for the predictive variance.  The PyTorch twin is
    :func:`bayeslayer.ops.bayesian_layer.scan.prep_reference`.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    NT, Hf, D = k.shape
    C, dev = lay.C, k.device
    diag = log_alpha.shape[-1] > 1
    bos, eos, first = sc.chunk_bounds(lay.cu, C)
    NC = len(bos)
    i64 = dict(dtype=torch.int64, device=dev)
    # segment j of sequence n starts at that sequence's chunk j·n_s (host lists, as scan_layout: no device sync)
    seg_first = [a + j * lay.n_s for a, z in zip(first[:-1], first[1:], strict=True)
                 for j in range(max(1, -(-(z - a) // lay.n_s)))]
    Da = D if diag else 1
    g = torch.empty(NC, Hf, C, Da, dtype=dtype, device=dev)
    b = torch.empty_like(g)
    base = torch.empty(NC, Hf, C, C, dtype=dtype, device=dev)
    qBq = torch.empty(NC, Hf, C, dtype=dtype, device=dev) if want_var else None
    if NC > 0:
        la_k = log_alpha.contiguous() if diag else log_alpha[..., 0].contiguous()
        bl_chunk_prep_kernel[(NC, Hf)](
            q if want_var else k, k, r2, ell2, la_k, torch.tensor(bos, **i64), torch.tensor(eos, **i64), g, b, base,
            qBq if want_var else g, H=Hf, D=D, C=C, BD=max(16, next_pow2(D)), BK=16, DIAG=diag, RETURN_VAR=want_var,
            PREC=PREC, num_warps=4,
        )
    return Prep(g, b, base, qBq, torch.tensor(seg_first, **i64))


def ldl_scratch(n: int, Hf: int, C: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The covariance kernel's blocked-LDLᵀ scratch ``[n, H', 2C² + C]`` and its failure flags ``[n, H']`` (int32)."""
    return (torch.empty(n, Hf, 2 * C * C + C, dtype=dtype, device=device),
            torch.zeros(n, Hf, dtype=torch.int32, device=device))


class _Clock:
    """Per-phase device times (CUDA events on a GPU, wall clock elsewhere) into ``out`` when given."""

    def __init__(self, out: dict | None, device: torch.device):
        self.out, self.cuda = out, device.type == "cuda"
        self.marks: list[tuple[str, object]] = []
        self.mark("start")

    def mark(self, name: str) -> None:
        if self.out is None:
            return
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((name, ev))
        else:
            self.marks.append((name, time.perf_counter()))

    def finish(self) -> None:
        if self.out is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        for (_, a), (name, b) in zip(self.marks[:-1], self.marks[1:], strict=True):
            self.out[name] = a.elapsed_time(b) / 1e3 if self.cuda else b - a


def segment_offsets(lay: sc.ScanLayout, NT: int) -> torch.Tensor:
    """Token boundaries of the segments ``[S + 1]`` (int64): a ``cu_seqlens`` whose sequences are the segments."""
    starts = lay.tok[:, 0, 0]
    return torch.cat([starts, starts.new_tensor([NT])])


def substituted_inputs(lay: sc.ScanLayout, linv: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                       log_alpha: torch.Tensor):
    """``(L⁻¹(γ⊙K), L⁻¹V, g)`` packed, from the per-token rows of every chunk's ``L⁻¹`` (``[NT, H', C]``).

    One batched product per chunk; ``g`` is the chunk-local cumulative log-decay ``[NT, H', Da]``.
    ``L⁻¹V`` is None when ``v`` is.  Arithmetic in ``linv``'s dtype.
    """
    NT = k.shape[0]
    Lg = lay.grid(linv, 0.0)  # [n_s, S, H', C, C]
    g = torch.cumsum(lay.grid(log_alpha.to(linv.dtype), 0.0), dim=-2)
    kw = Lg @ (torch.exp(g) * lay.grid(k.to(linv.dtype), 0.0))
    vu = lay.scatter(Lg @ lay.grid(v.to(linv.dtype), 0.0), NT) if v is not None else None
    return lay.scatter(kw, NT), vu, lay.scatter(g, NT)


def phase_a_triton(lay: sc.ScanLayout, q, k, r2, ell2, log_alpha, segs: torch.Tensor, dtype=torch.float64,
                   prep: Prep | None = None):
    """Phase A on the GPU: segment elements ``(A_s, C_s, J_s, failed)`` of the segments ``segs``.

    1. the covariance kernel from P = 0 over every segment, its state (P, hence ``C_s``) in ``dtype``
       (float64): it writes W and the ``L⁻¹`` rows in the inputs' compute dtype (``k.dtype``);
    2. ``β_i = (1 − k_iᵀw_i)/r_i²`` (exact: ``k_iᵀu_i = d_i − r_i²``), the dot product in the compute dtype,
       the rest in ``dtype``, and ``L⁻¹(γ⊙K)`` in the compute dtype;
    3. :func:`scan_track_kernel` over ``segs``: ``A_s``, ``J_s`` in ``dtype`` from those per-token terms.
    Only the D×D state, the segment elements and per-segment scratch are ``dtype``: no per-token buffer of
    T·D elements is (the per-token hand-off's fp32 rounding, measured against float64 in three regimes by
    ``benchmarks/scan_precision.py``, is docs/kernels.md's "Precision of the hand-offs").
    Packed inputs ``[NT, H', ·]`` as :class:`bayeslayer.ops.bayesian_layer.scan.ScanCall`'s.  The kernel of step 1
    also runs the last segment of each sequence (whose element is never used): one launch.  ``prep``:
    the prep kernel's buffers for ``lay`` (:func:`prep_triton`; in the compute dtype: Phase C's, which the
    kernel reads and casts to ``dtype``), which step 1 then reads instead of forming the P-free terms itself;
    None: it forms them (per-channel decays are then cast to ``dtype`` first: the kernel accumulates them).
    """
    NT, Hf, D = k.shape
    dev, C, S, n = k.device, lay.C, lay.n_segments, segs.numel()
    cd = k.dtype
    BD = max(16, next_pow2(D))
    diag = log_alpha.shape[-1] > 1
    la_k = (log_alpha.contiguous() if prep is not None else log_alpha.to(dtype).contiguous()) if diag \
        else log_alpha[..., 0].contiguous()
    P = torch.zeros(S, Hf, D, D, dtype=dtype, device=dev)
    W = torch.empty(NT, Hf, D, dtype=cd, device=dev)
    linv = torch.empty(NT, Hf, C, dtype=cd, device=dev)
    scr = torch.empty(S, Hf, C, BD, dtype=dtype, device=dev)
    scr2 = torch.empty_like(scr)
    cu_seg = segment_offsets(lay, NT)
    A = torch.eye(D, dtype=dtype, device=dev).expand(n, Hf, D, D).contiguous()
    J = torch.zeros(n, Hf, D, D, dtype=dtype, device=dev)
    if NT == 0 or n == 0:
        return A, P[segs], J, torch.zeros(n, Hf, dtype=torch.bool, device=dev)
    if prep is not None and prep.base.dtype != cd:
        raise TypeError(f"prep must hold {cd} buffers (the inputs' compute dtype), got {prep.base.dtype}")
    ldl_scr, ldl_fail = ldl_scratch(S, Hf, C, dtype, dev)
    bl_chunk_cov_kernel[(S, Hf)](
        q, k, r2, ell2, la_k, cu_seg, P, W, linv, scr, scr2, W, ldl_scr, ldl_fail,
        H=Hf, D=D, C=C, BD=BD, BK=16, DIAG=diag, HAS_ALPHA=True, RETURN_VAR=False,
        PREC="ieee", num_warps=8 if C >= 64 else 4, **(prep.kernel_args() if prep is not None else {}),
    )
    beta = (1.0 - torch.linalg.vecdot(k, W).to(dtype)) / r2.to(dtype)
    kw, _, _ = substituted_inputs(lay, linv, k, None, log_alpha)
    Hscr = torch.empty(n, Hf, C, BD, dtype=dtype, device=dev)
    scan_track_kernel[(n, Hf)](
        W, kw, beta, la_k, cu_seg, segs, A, J, Hscr, H=Hf, D=D, C=C, BD=BD, BK=16, DIAG=diag, PREC="ieee",
        num_warps=4,
    )
    Cm = P[segs]
    bad = (ldl_fail[segs] != 0) | ~(torch.isfinite(Cm).flatten(-2).all(-1) & torch.isfinite(A).flatten(-2).all(-1)
            & torch.isfinite(J).flatten(-2).all(-1))
    return A, Cm, J, bad


def mean_pass_triton(call: sc.ScanCall, W: torch.Tensor, linv: torch.Tensor, want_dtype: torch.dtype):
    """The mean pass on :func:`bayeslayer.ops.bayesian_layer.kernels_triton.bl_chunk_mean_kernel` (one program per value
    block, sequence and head): the generalised delta rule with erase key k and write key ``W``, its UT
    transform the ``L⁻¹`` rows of Phase C.  Returns packed ``(o [NT, H', m'] in want_dtype, M [N, H', D, m'])``."""
    NT, Hf, D = call.k.shape
    mg = call.v.shape[-1]
    cd, dev, C = call.k.dtype, call.k.device, call.C
    diag = call.log_alpha.shape[-1] > 1
    BD, BK, BV = tile_sizes(D, mg)
    M = call.M0.clone()
    o = torch.empty(NT, Hf, mg, dtype=want_dtype, device=dev)
    if NT == 0:
        return o, M
    cu = torch.tensor(call.cu, dtype=torch.int64, device=dev)  # host-to-device copy, no sync
    la_k = call.log_alpha.contiguous() if diag else call.log_alpha[..., 0].contiguous()
    bl_chunk_mean_kernel[(triton.cdiv(mg, BV), len(call.cu) - 1, Hf)](
        call.q, call.k, call.v, W, linv, la_k, cu, M, o, H=Hf, D=D, MV=mg, C=C, BD=BD, BK=BK, BV=BV,
        DIAG=diag, HAS_ALPHA=True, PREC="ieee" if cd == torch.float64 else PREC,
        num_warps=8 if C >= 64 else 4,
    )
    return o, M


def forward_scan_triton(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, want_var, *, n_segments=None,
                        segment_chunks=None, mean=None, timings: dict | None = None, phase_a: str = "triton",
                        phase_b: str = "triton", prep: bool = True, cov_precision: str | None = None):
    """The BL forward, covariance pass as a segment scan with Phase C on Triton; mean pass on fla's kernels.

    Same arguments and returns as ``ops/bayesian_layer/chunk_triton.py::_forward_triton``:
    ``(o [B, T, H, m], variance [B, T, H, G] or None, M [N, H, D, m], P [N, H, D, D] or [N, H, G, D, D])``.
    q, k ``[B, T, H, D]`` (D ≤ ``MAX_HEAD_DIM``), v ``[B, T, H, m]``, r2 ``[B, T, H]`` or ``[B, T, H, G]``, ell2
    ``[B, T, H]``, alpha None / ``[B, T, H]`` / ``[B, T, H, D]``; ``cu`` packs sequences (B = 1).
    ``n_segments`` / ``segment_chunks``: see :func:`bayeslayer.ops.bayesian_layer.scan.prepare_scan`.  ``mean``:
    the mean pass — ``"triton"`` (default, :func:`mean_pass_triton`: our kernel, on the ``L⁻¹`` rows),
    ``"fla"`` (fla's ``fwd_h`` + ``fwd_o`` on the substituted tensors; not float64), ``"torch"`` (the
    twin) or a callable ``(q, w, kw, vu, g, M0, cu, C) -> (o, M)`` on packed tensors.
    ``timings``: a dict that receives per-phase seconds (``prep``, ``phase_a``, ``phase_b``, ``phase_c``,
    ``substitute``, ``mean``) — it synchronises the device once, at the end.
    ``prep``: run the prep kernel (:func:`prep_triton`, parallel over chunks) and let the covariance
    kernel of Phase A and C read its P-free terms; False: the covariance kernel forms them in its
    serial chunk loop (the path before the prep kernel).  One prep, in the compute dtype, serves both
    (Phase A's float64 kernel casts what it reads).
    ``phase_a``: ``"triton"`` (:func:`phase_a_triton`) or ``"torch"``
    (:func:`bayeslayer.ops.bayesian_layer.scan.phase_a`), both float64.  ``phase_b``: ``"triton"``
    (:func:`phase_b_triton`, one kernel) or ``"torch"`` (:func:`bayeslayer.ops.bayesian_layer.scan.phase_b`, a host
    loop of batched steps).  ``cov_precision``: Phase C's fp32 product precision, one of :data:`COV_PRECISIONS` (None:
    :data:`COV_PRECISION`; float64 inputs always run IEEE).  Forward only: no autograd graph is recorded.
    """
    if chunk_size not in SUPPORTED_CHUNK_SIZES or isinstance(chunk_size, bool):
        raise ValueError(f"the Triton path supports chunk_size in {SUPPORTED_CHUNK_SIZES}, got {chunk_size!r}")
    if isinstance(q, torch.Tensor) and q.dim() == 4 and not 1 <= q.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"the Triton path supports key dims D in 1..{MAX_HEAD_DIM}, got D={q.shape[-1]}")
    if not isinstance(prep, bool):
        raise TypeError(f"prep must be a bool, got {prep!r}")
    with torch.no_grad():
        call = sc.prepare_scan(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, n_segments=n_segments,
                               segment_chunks=segment_chunks)
        res = scan_packed(call, want_var, out_dtype=call.dims.dtype, mean=mean, timings=timings, phase_a=phase_a,
                          phase_b=phase_b, prep=prep, cov_precision=cov_precision)
        sc.raise_if_failed(res.failed, "forward_scan_triton")
        return sc.finish_scan(call, res.o, res.var, res.M, res.P)


class PackedScan(NamedTuple):
    """What :func:`scan_packed` returns, all packed (``NT`` tokens, ``H'`` folded heads): the mean pass's
    output ``o`` (in ``out_dtype``), the variance (None unless asked for), the final states ``M``, ``P``
    per sequence, and what a backward needs — the write keys ``W``, the ``L⁻¹`` rows ``linv``, the
    segment-start covariances ``P_starts`` (float64, from Phase B) and Phase A's ``(A_s, J_s)`` (float64);
    ``failed`` is the device-side ``[N, H']`` flag (not yet checked)."""

    o: torch.Tensor
    var: torch.Tensor | None
    M: torch.Tensor
    P: torch.Tensor
    W: torch.Tensor
    linv: torch.Tensor
    P_starts: torch.Tensor
    elements: tuple
    failed: torch.Tensor


def scan_packed(call: sc.ScanCall, want_var: bool, *, out_dtype: torch.dtype, mean=None,
                timings: dict | None = None, phase_a: str = "triton", phase_b: str = "triton",
                prep: bool = True, cov_precision: str | None = None) -> PackedScan:
    """The launches of the segment-scan forward on :func:`bayeslayer.ops.bayesian_layer.scan.prepare_scan`'s packed
    tensors (prep, Phase A, B, C, mean pass), shared by :func:`forward_scan_triton` and the autograd forward of
    the scan path (``ops/bayesian_layer/chunk_triton.py::forward_scan_packed``) so that both run exactly the same
    kernels.  Arguments as :func:`forward_scan_triton`; ``out_dtype``: the dtype of ``o`` from the mean
    kernel.  Failures are left in ``PackedScan.failed`` for the caller to raise once."""
    if not isinstance(prep, bool):
        raise TypeError(f"prep must be a bool, got {prep!r}")
    cov_precision = COV_PRECISION if cov_precision is None else cov_precision
    if cov_precision not in COV_PRECISIONS:
        raise ValueError(f"cov_precision must be one of {COV_PRECISIONS}, got {cov_precision!r}")

    clock = _Clock(timings, call.k.device)
    NT, Hf, D = call.k.shape
    cd, dev, C = call.k.dtype, call.k.device, call.C
    lay = sc.scan_layout(call.cu, C, call.segment_chunks, dev)
    diag = call.log_alpha.shape[-1] > 1

    # ---- Phase A (segment elements, float64) and Phase B (segment-start covariances) ----
    last = lay.last_segments
    segs = lay.element_segments  # sized on the host by the layout: no device-to-host sync
    f64 = torch.float64
    # ---- prep: the P-free per-chunk terms, parallel over chunks, in the compute dtype; Phase A's float64
    # covariance kernel reads the same buffers (cast on load): no T-sized float64 copy ----
    prep_c = prep_triton(lay, call.q, call.k, call.r2, call.ell2, call.log_alpha, dtype=cd, want_var=want_var) \
        if prep else None
    clock.mark("prep")
    if phase_a == "triton":
        A, Cm, J, info_a = phase_a_triton(lay, call.q, call.k, call.r2, call.ell2, call.log_alpha, segs,
                                          prep=prep_c)
    elif phase_a == "torch":
        xa = {name: lay.grid(x, fill).to(f64) for name, x, fill in
              (("k", call.k, 0.0), ("r2", call.r2, 1.0), ("ell2", call.ell2, 0.0), ("la", call.log_alpha, 0.0))}
        A, Cm, J, info_a = sc.phase_a(lay, xa, segs)
    else:
        raise ValueError(f"phase_a must be 'triton' or 'torch', got {phase_a!r}")
    clock.mark("phase_a")
    if phase_b == "triton":
        P_starts, failed = phase_b_triton(lay, call.P0.to(f64), (A, Cm, J, segs))
    elif phase_b == "torch":
        P_starts, failed = sc.phase_b(lay, call.P0.to(f64), (A, Cm, J, segs))
    else:
        raise ValueError(f"phase_b must be 'triton' or 'torch', got {phase_b!r}")
    sc.mark_failed(failed, lay.seg_seq[segs], info_a)
    clock.mark("phase_b")

    # ---- Phase C: the chunk-serial covariance kernel over the segments, from P_s ----
    S = lay.n_segments
    BD = max(16, next_pow2(D))
    P = P_starts.to(cd, copy=True).contiguous()  # the kernel writes segment ends in place; keep P_starts
    W = torch.empty(NT, Hf, D, dtype=cd, device=dev)
    linv = torch.empty(NT, Hf, C, dtype=cd, device=dev)
    var = torch.empty(NT, Hf, dtype=cd, device=dev) if want_var else W.new_empty(1)
    Yscr = torch.empty(S, Hf, C, BD, dtype=cd, device=dev)
    Uscr = torch.empty_like(Yscr)
    cu_seg = segment_offsets(lay, NT)
    la_k = call.log_alpha.contiguous() if diag else call.log_alpha[..., 0].contiguous()
    ldl_scr, ldl_fail = ldl_scratch(S, Hf, C, cd, dev)
    if NT > 0:
        bl_chunk_cov_kernel[(S, Hf)](
            call.q, call.k, call.r2, call.ell2, la_k, cu_seg, P, W, linv, Yscr, Uscr, var, ldl_scr, ldl_fail,
            H=Hf, D=D, C=C, BD=BD, BK=16, DIAG=diag, HAS_ALPHA=True, RETURN_VAR=want_var,
            PREC="ieee" if cd == f64 else cov_precision, num_warps=8 if C >= 64 else 4,
            **(prep_c.kernel_args() if prep_c is not None else {}),
        )
    # a failed LDLᵀ pivot leaves non-finite numbers behind: folded into the same device-side flag
    failed |= ~torch.isfinite(P[last]).flatten(-2).all(-1)
    sc.mark_failed(failed, lay.seg_seq, ldl_fail != 0)
    clock.mark("phase_c")

    if mean is None or mean == "triton":
        # our mean kernel: the UT transform is the L⁻¹ of Phase C, no substituted tensors needed
        clock.mark("substitute")
        o, M = mean_pass_triton(call, W, linv, want_dtype=out_dtype)
    else:
        kw, vu, g = substituted_inputs(lay, linv, call.k, call.v, call.log_alpha)
        clock.mark("substitute")
        if mean == "fla":
            from .mean_pass_fla import mean_pass_fla, require_fla

            require_fla()
            if cd == f64:
                raise TypeError("mean='fla' cannot run float64 inputs (fla keeps its state in float32); "
                                "use mean='triton'")
            # fla's kernels, on operands in the caller's dtype when it is 16-bit (as GDN runs its w, u)
            md = out_dtype if out_dtype in (torch.bfloat16, torch.float16) else cd
            o, M = mean_pass_fla(call.q.to(md), W.to(md), kw.to(md), vu.to(md), g, call.M0, call.cu, C)
        elif mean == "torch":
            o, M = sc.mean_pass_reference(call.q, W, kw, vu, g, call.M0, call.cu, C)
        elif callable(mean):
            o, M = mean(call.q, W, kw, vu, g, call.M0, call.cu, C)
        else:
            raise ValueError(f"mean must be 'triton', 'fla', 'torch' or a callable, got {mean!r}")
    clock.mark("mean")
    clock.finish()
    return PackedScan(o, var if want_var else None, M, P[last], W, linv, P_starts, (A, J), failed)
