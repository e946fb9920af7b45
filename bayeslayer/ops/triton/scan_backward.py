"""The covariance pass's backward through the segment scan on Triton (design note ``gpu-kernels.md`` §2, §4).

Ports of the plain-PyTorch twin :mod:`bayeslayer.ops.scan_backward` (every kernel is tested against it,
``tests/ops/test_scan_backward_triton.py``):

=====  ==========================================================  =====================================
B3     :func:`reverse_segments_triton` → :func:`scan_reverse_kernel`  grid (sequences, H'), serial over each
       ``P̄_s = Ā_sᵀ P̄_{s+1} Ā_s + G_s``, ``Ā_s`` from Phase B's       sequence's segments in reverse, float64,
       factors (twin: ``element_transition`` + ``reverse_segments``)  16×16 ``tl.dot`` tiles through scratch
=====  ==========================================================  =====================================

Every launch count is independent of T: one launch per kernel, whatever the number of chunks or segments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import scan as sc
from .ldl import ldl_blocked
from .scan import _load_block, _sblk
from .support import next_pow2


def _check(name: str, x, shape: tuple, dtype: torch.dtype | None = None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {x.dtype}")


# ---------------------------------------------------------------------------------------------------
# B3: the reverse pass over segments
# ---------------------------------------------------------------------------------------------------

@triton.jit
def scan_reverse_kernel(
    PB, PS, A, J, elem_of_seg, seq_first, seq_nseg, SCR, FAIL,
    H: tl.constexpr,
    D: tl.constexpr,
    NB: tl.constexpr,
    PREC: tl.constexpr,
):
    """B3 for one (sequence, head): ``P̄_s = G_s + sym(Ā_sᵀ P̄_{s+1} Ā_s)``, serial over its segments in reverse.

    ``Ā = A (I + PJ)⁻¹ = A − (AG) M⁻¹ GᵀJ`` (Woodbury) in the LDLᵀ factors of Phase B
    (:func:`bayeslayer.ops.triton.scan.scan_phase_b_kernel`): ``P_s = L_P D_P L_Pᵀ``, ``G = L_P D_P^½``,
    ``M = I + GᵀJG = L_M D_M L_Mᵀ`` (pivots clamped at 1), so ``Ā = A − Z' Q`` with
    ``Z' = (AG) L_M⁻ᵀ D_M⁻¹`` and ``Q = L_M⁻¹ (JG)ᵀ``.  PB ``[S, H, D, D]`` holds the local adjoints
    ``G_s`` on entry and the totals ``P̄_s`` on exit (the last segment of a sequence is left as it is);
    PS ``[S, H, D, D]`` the checkpoints ``P_s``; A, J ``[n, H, D, D]`` the elements, segment ``s``'s at
    ``elem_of_seg[s]``; SCR ``[N, H, 5·BN² + 2·BN]`` scratch (``BN = 16·NB ≥ D``); FAIL ``[N, H]`` int32
    counts pivots of ``P_s`` that were not positive.  Arithmetic in PB's dtype (float64); every product
    a 16×16-tile ``tl.dot``; each ``P̄_s`` written exactly symmetric (lower blocks and their transposes).
    """
    BLK: tl.constexpr = 16
    BN: tl.constexpr = NB * BLK
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    r = tl.arange(0, BLK)
    eye = r[:, None] == r[None, :]
    rn = tl.arange(0, BN)
    dt = PB.dtype.element_ty
    X = SCR + (i_n * H + i_h) * (5 * BN * BN + 2 * BN)
    LI = X + BN * BN
    MM = LI + BN * BN
    TT = MM + BN * BN
    WW = TT + BN * BN
    DP = WW + BN * BN
    DM = DP + BN
    first = tl.load(seq_first + i_n).to(tl.int64)
    nseg = tl.load(seq_nseg + i_n).to(tl.int64)
    fail = tl.sum(tl.zeros([BLK], dtype=tl.int32), axis=0)
    for jj in range(nseg - 1):
        s = first + nseg - 2 - jj
        e = tl.load(elem_of_seg + s).to(tl.int64)
        Pin = PS + (s * H + i_h) * D * D
        Gs = PB + (s * H + i_h) * D * D
        Pnext = PB + ((s + 1) * H + i_h) * D * D
        Ae = A + (e * H + i_h) * D * D
        Je = J + (e * H + i_h) * D * D
        for ib in range(NB):
            for jb in range(ib + 1):
                tl.store(_sblk(X, ib, jb, r, BN, BLK), _load_block(Pin, ib, jb, r, D, BLK, True))
        tl.store(DP + rn, tl.zeros([BN], dtype=dt))  # floors: a pivot of P must be > 0
        tl.store(DM + rn, tl.zeros([BN], dtype=dt) + 1.0)  # M = I + GᵀJG ⪰ I: its pivots are ≥ 1
        tl.debug_barrier()
        fail += ldl_blocked(X, LI, DP, NB, BLK, PREC)  # X: L_P, DP: D_P
        # TT = J G,  G = L_P D_P^½ (lower blocks: G_kj = 0 for k < j)
        for ib in range(NB):
            for jb in range(NB):
                acc = tl.zeros([BLK, BLK], dtype=dt)
                for kb in range(jb, NB):
                    acc += tl.dot(_load_block(Je, ib, kb, r, D, BLK, False), tl.load(_sblk(X, kb, jb, r, BN, BLK)),
                                  input_precision=PREC)
                tl.store(_sblk(TT, ib, jb, r, BN, BLK), acc * tl.sqrt(tl.load(DP + jb * BLK + r))[None, :])
        tl.debug_barrier()
        # M = I + Gᵀ (JG), lower blocks
        for ib in range(NB):
            sdi = tl.sqrt(tl.load(DP + ib * BLK + r))
            for jb in range(ib + 1):
                acc = tl.where((ib == jb) & eye, 1.0, 0.0).to(dt)
                for kb in range(ib, NB):
                    G_ki = tl.load(_sblk(X, kb, ib, r, BN, BLK)) * sdi[None, :]
                    acc += tl.dot(tl.trans(G_ki), tl.load(_sblk(TT, kb, jb, r, BN, BLK)), input_precision=PREC)
                tl.store(_sblk(MM, ib, jb, r, BN, BLK), acc)
        tl.debug_barrier()
        fail += ldl_blocked(MM, LI, DM, NB, BLK, PREC)  # LI: L_M⁻¹, DM: D_M
        # Q = L_M⁻¹ (JG)ᵀ into MM (L_M itself is no longer needed)
        for ib in range(NB):
            for jb in range(NB):
                acc = tl.zeros([BLK, BLK], dtype=dt)
                for kb in range(ib + 1):
                    TTjk = tl.load(_sblk(TT, jb, kb, r, BN, BLK))
                    acc += tl.dot(tl.load(_sblk(LI, ib, kb, r, BN, BLK)), tl.trans(TTjk), input_precision=PREC)
                tl.store(_sblk(MM, ib, jb, r, BN, BLK), acc)
        tl.debug_barrier()
        # TT = A G
        for ib in range(NB):
            for jb in range(NB):
                acc = tl.zeros([BLK, BLK], dtype=dt)
                for kb in range(jb, NB):
                    acc += tl.dot(_load_block(Ae, ib, kb, r, D, BLK, False), tl.load(_sblk(X, kb, jb, r, BN, BLK)),
                                  input_precision=PREC)
                tl.store(_sblk(TT, ib, jb, r, BN, BLK), acc * tl.sqrt(tl.load(DP + jb * BLK + r))[None, :])
        tl.debug_barrier()
        # Z' = (AG) L_M⁻ᵀ D_M⁻¹ into X (L_P is no longer needed)
        for ib in range(NB):
            for jb in range(NB):
                acc = tl.zeros([BLK, BLK], dtype=dt)
                for kb in range(jb + 1):
                    Ljk = tl.load(_sblk(LI, jb, kb, r, BN, BLK))
                    acc += tl.dot(tl.load(_sblk(TT, ib, kb, r, BN, BLK)), tl.trans(Ljk), input_precision=PREC)
                tl.store(_sblk(X, ib, jb, r, BN, BLK), acc / tl.load(DM + jb * BLK + r)[None, :])
        tl.debug_barrier()
        # Ā = A − Z' Q into TT
        for ib in range(NB):
            for jb in range(NB):
                acc = _load_block(Ae, ib, jb, r, D, BLK, False)
                for kb in range(NB):
                    acc -= tl.dot(tl.load(_sblk(X, ib, kb, r, BN, BLK)), tl.load(_sblk(MM, kb, jb, r, BN, BLK)),
                                  input_precision=PREC)
                tl.store(_sblk(TT, ib, jb, r, BN, BLK), acc)
        tl.debug_barrier()
        # WW = P̄_{s+1} Ā
        for ib in range(NB):
            for jb in range(NB):
                acc = tl.zeros([BLK, BLK], dtype=dt)
                for kb in range(NB):
                    acc += tl.dot(_load_block(Pnext, ib, kb, r, D, BLK, False), tl.load(_sblk(TT, kb, jb, r, BN, BLK)),
                                  input_precision=PREC)
                tl.store(_sblk(WW, ib, jb, r, BN, BLK), acc)
        tl.debug_barrier()
        # P̄_s = sym(G_s) + Āᵀ WW: lower blocks, each written with its transpose above
        for ib in range(NB):
            for jb in range(ib + 1):
                acc = 0.5 * (_load_block(Gs, ib, jb, r, D, BLK, False)
                             + tl.trans(_load_block(Gs, jb, ib, r, D, BLK, False)))
                for kb in range(NB):
                    Aki = tl.load(_sblk(TT, kb, ib, r, BN, BLK))
                    acc += tl.dot(tl.trans(Aki), tl.load(_sblk(WW, kb, jb, r, BN, BLK)), input_precision=PREC)
                if ib == jb:
                    acc = 0.5 * (acc + tl.trans(acc))
                ri = ib * BLK + r
                cj = jb * BLK + r
                tl.debug_barrier()  # G_s is read (both triangles) before this block and its mirror are written
                tl.store(Gs + ri[:, None] * D + cj[None, :], acc, mask=(ri[:, None] < D) & (cj[None, :] < D))
                tl.store(Gs + cj[:, None] * D + ri[None, :], tl.trans(acc), mask=(cj[:, None] < D) & (ri[None, :] < D))
        tl.debug_barrier()
    tl.store(FAIL + i_n * H + i_h, fail)


def reverse_segments_triton(lay: sc.ScanLayout, G: torch.Tensor, P_starts: torch.Tensor, A: torch.Tensor,
                            J: torch.Tensor):
    """B3 as one kernel: the total adjoint ``P̄ [S, H', D, D]`` of every segment's start state, and ``failed [N, H']``.

    ``G`` ``[S, H', D, D]``: the local adjoints from B2 (symmetric; the last segment of a sequence already
    holds its total adjoint); ``P_starts`` ``[S, H', D, D]``: Phase B's checkpoints; ``A``, ``J``
    ``[len(lay.element_segments), H', D, D]``: Phase A's elements of the segments that are not last.
    One launch of :func:`scan_reverse_kernel`, grid (sequence, head): no host loop, no host sync.
    Arithmetic in G's dtype (float64 for the scan; the others are cast to it).  Twin:
    :func:`bayeslayer.ops.scan_backward.reverse_segments` with
    :func:`~bayeslayer.ops.scan_backward.element_transition`.
    """
    if not isinstance(lay, sc.ScanLayout):
        raise TypeError(f"lay must be a ScanLayout, got {type(lay).__name__}")
    if not isinstance(G, torch.Tensor) or G.dim() != 4 or G.shape[-1] != G.shape[-2]:
        raise ValueError(f"G must be a [S, H', D, D] tensor, got {getattr(G, 'shape', type(G).__name__)}")
    S, Hf, D = lay.n_segments, G.shape[1], G.shape[-1]
    _check("G", G, (S, Hf, D, D))
    _check("P_starts", P_starts, (S, Hf, D, D))
    n = lay.element_segments.numel()
    _check("A", A, (n, Hf, D, D))
    _check("J", J, (n, Hf, D, D))
    dt, dev = G.dtype, G.device
    N = lay.n_seq
    Pbar = G.contiguous().clone()
    fail = torch.zeros(N, Hf, dtype=torch.int32, device=dev)
    if n == 0:
        return Pbar, fail != 0
    elem = torch.full((S,), -1, dtype=torch.int64, device=dev)
    elem[lay.element_segments] = torch.arange(n, device=dev)
    NB = max(16, next_pow2(D)) // 16
    BN = 16 * NB
    scr = torch.empty(N, Hf, 5 * BN * BN + 2 * BN, dtype=dt, device=dev)
    scan_reverse_kernel[(N, Hf)](
        Pbar, P_starts.to(dt).contiguous(), A.to(dt).contiguous(), J.to(dt).contiguous(), elem, lay.seq_first_seg,
        lay.seq_n_seg, scr, fail, H=Hf, D=D, NB=NB, PREC="ieee", num_warps=4,
    )
    return Pbar, fail != 0
