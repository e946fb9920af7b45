"""The covariance pass's backward through the segment scan on Triton (design note ``gpu-kernels.md`` §2, §4).

Ports of the plain-PyTorch twin :mod:`bayeslayer.ops.scan_backward` (every kernel is tested against it,
``tests/ops/test_scan_backward_triton.py``):

* **B2/B4** :func:`segment_adjoint_triton` → :func:`scan_segment_adjoint_kernel`, grid (segments, H'),
  serial over a segment's chunks: replay from the checkpoint ``P_s`` (each chunk's start P kept in a
  scratch, :func:`chunk_state_scratch`, which B4 reads instead of replaying again), then the per-chunk
  adjoint back to the segment start (twin ``segment_adjoint``; B4 adds every input gradient).  Scalar
  decay specialised (C×C ratio, ``tl.dot``); diagonal decay in its own kernel (``[C, C, BD]`` per-channel
  ratio, its contractions register reductions); whole register tiles; the inputs' dtype.
* **B3** :func:`reverse_segments_triton` → :func:`scan_reverse_kernel`, grid (sequences, H'), serial over
  each sequence's segments in reverse: ``P̄_s = Ā_sᵀ P̄_{s+1} Ā_s + G_s`` with ``Ā_s`` from Phase B's
  factors (twin ``element_transition`` + ``reverse_segments``); float64, 16×16 ``tl.dot`` tiles.
* **all** :func:`covariance_scan_backward_triton`: B2, Phase A's elements (``phase_a_triton``), B3, B4
  (twin ``covariance_scan_backward``).

Not here: the mean pass (B1), the prep's own kernel (B5: its adjoint is folded into B4 per chunk), an
autograd.Function wiring, 16×16 blocking of B2/B4's register tiles (they hold ``[BD, BD]`` P and ``[C, BD]``
operands whole, the diagonal kernel ``[C, C, BD]`` ratios: fine for the tests' D ≤ 32, C = 16, never compiled
for a GPU, and not viable as written at C = 64, D ≥ 64).

Every launch count is independent of T: one launch per kernel, whatever the number of chunks or segments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import scan as sc
from ..checks import check_shaped
from .ldl import ldl_blocked
from .scan import load_block, sblock
from .support import next_pow2

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
                tl.store(sblock(X, ib, jb, r, BN, BLK), load_block(Pin, ib, jb, r, D, BLK, True))
        tl.store(DP + rn, tl.zeros([BN], dtype=dt))  # floors: a pivot of P must be > 0
        tl.store(DM + rn, tl.zeros([BN], dtype=dt) + 1.0)  # M = I + GᵀJG ⪰ I: its pivots are ≥ 1
        tl.debug_barrier()
        fail += ldl_blocked(X, LI, DP, NB, BLK, PREC)  # X: L_P, DP: D_P
        # TT = J G,  G = L_P D_P^½ (lower blocks: G_kj = 0 for k < j)
        for ib in range(NB):
            for jb in range(NB):
                acc = tl.zeros([BLK, BLK], dtype=dt)
                for kb in range(jb, NB):
                    acc += tl.dot(load_block(Je, ib, kb, r, D, BLK, False), tl.load(sblock(X, kb, jb, r, BN, BLK)),
                                  input_precision=PREC)
                tl.store(sblock(TT, ib, jb, r, BN, BLK), acc * tl.sqrt(tl.load(DP + jb * BLK + r))[None, :])
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
        # Q = L_M⁻¹ (JG)ᵀ into MM (L_M itself is no longer needed)
        for ib in range(NB):
            for jb in range(NB):
                acc = tl.zeros([BLK, BLK], dtype=dt)
                for kb in range(ib + 1):
                    TTjk = tl.load(sblock(TT, jb, kb, r, BN, BLK))
                    acc += tl.dot(tl.load(sblock(LI, ib, kb, r, BN, BLK)), tl.trans(TTjk), input_precision=PREC)
                tl.store(sblock(MM, ib, jb, r, BN, BLK), acc)
        tl.debug_barrier()
        # TT = A G
        for ib in range(NB):
            for jb in range(NB):
                acc = tl.zeros([BLK, BLK], dtype=dt)
                for kb in range(jb, NB):
                    acc += tl.dot(load_block(Ae, ib, kb, r, D, BLK, False), tl.load(sblock(X, kb, jb, r, BN, BLK)),
                                  input_precision=PREC)
                tl.store(sblock(TT, ib, jb, r, BN, BLK), acc * tl.sqrt(tl.load(DP + jb * BLK + r))[None, :])
        tl.debug_barrier()
        # Z' = (AG) L_M⁻ᵀ D_M⁻¹ into X (L_P is no longer needed)
        for ib in range(NB):
            for jb in range(NB):
                acc = tl.zeros([BLK, BLK], dtype=dt)
                for kb in range(jb + 1):
                    Ljk = tl.load(sblock(LI, jb, kb, r, BN, BLK))
                    acc += tl.dot(tl.load(sblock(TT, ib, kb, r, BN, BLK)), tl.trans(Ljk), input_precision=PREC)
                tl.store(sblock(X, ib, jb, r, BN, BLK), acc / tl.load(DM + jb * BLK + r)[None, :])
        tl.debug_barrier()
        # Ā = A − Z' Q into TT
        for ib in range(NB):
            for jb in range(NB):
                acc = load_block(Ae, ib, jb, r, D, BLK, False)
                for kb in range(NB):
                    acc -= tl.dot(tl.load(sblock(X, ib, kb, r, BN, BLK)), tl.load(sblock(MM, kb, jb, r, BN, BLK)),
                                  input_precision=PREC)
                tl.store(sblock(TT, ib, jb, r, BN, BLK), acc)
        tl.debug_barrier()
        # WW = P̄_{s+1} Ā
        for ib in range(NB):
            for jb in range(NB):
                acc = tl.zeros([BLK, BLK], dtype=dt)
                for kb in range(NB):
                    acc += tl.dot(load_block(Pnext, ib, kb, r, D, BLK, False), tl.load(sblock(TT, kb, jb, r, BN, BLK)),
                                  input_precision=PREC)
                tl.store(sblock(WW, ib, jb, r, BN, BLK), acc)
        tl.debug_barrier()
        # P̄_s = sym(G_s) + Āᵀ WW: lower blocks, each written with its transpose above
        for ib in range(NB):
            for jb in range(ib + 1):
                acc = 0.5 * (load_block(Gs, ib, jb, r, D, BLK, False)
                             + tl.trans(load_block(Gs, jb, ib, r, D, BLK, False)))
                for kb in range(NB):
                    Aki = tl.load(sblock(TT, kb, ib, r, BN, BLK))
                    acc += tl.dot(tl.trans(Aki), tl.load(sblock(WW, kb, jb, r, BN, BLK)), input_precision=PREC)
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
    check_shaped("G", G, (S, Hf, D, D))
    check_shaped("P_starts", P_starts, (S, Hf, D, D))
    n = lay.element_segments.numel()
    check_shaped("A", A, (n, Hf, D, D))
    check_shaped("J", J, (n, Hf, D, D))
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


# ---------------------------------------------------------------------------------------------------
# B2 / B4: replay a segment from its checkpoint and run the per-chunk adjoint back to its start
# ---------------------------------------------------------------------------------------------------

@triton.jit
def _chunk_scalar(k, r2c, ell2c, lac, P, X_base, LI_base, DV_base, rows, od,
                  D: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr):
    """One chunk of scalar decay from ``P`` (twins :func:`~bayeslayer.ops.scan_backward.chunk_terms` and
    :func:`~bayeslayer.ops.scan_backward.chunk_replay`): the P-free terms, ``S = base + K̃PK̃ᵀ`` factored by
    :func:`.ldl.ldl_blocked` (pivots clamped at r², as the forward), ``U`` and the next ``P`` (symmetrised).
    ``R`` is the C×C decay ratio ``Φ_iΦ_j⁻¹`` (one value for all channels)."""
    low = rows[:, None] >= rows[None, :]
    eye = rows[:, None] == rows[None, :]
    g = tl.cumsum(lac, axis=0)
    gend = tl.sum(lac, axis=0)
    R = tl.where(low, tl.exp(tl.where(low, g[:, None] - g[None, :], 0.0)), 0.0)
    gam = tl.exp(g)
    endv = tl.exp(gend - g)
    gC = tl.exp(gend)
    b = tl.sum(R * R * ell2c[None, :], axis=1)
    bC = tl.sum(tl.where(rows == C - 1, b, 0.0), axis=0)
    kt = gam[:, None] * k
    NBk = b[:, None] * k
    Nl = R * tl.dot(k, tl.trans(NBk), input_precision=PREC)
    base = Nl + tl.trans(Nl) + tl.where(eye, r2c[:, None] - Nl, 0.0)
    Y = tl.dot(kt, P, input_precision=PREC)
    S = base + tl.dot(Y, tl.trans(kt), input_precision=PREC)
    tl.store(X_base + rows[:, None] * C + rows[None, :], S)
    tl.store(DV_base + rows, r2c)
    tl.debug_barrier()
    fail = ldl_blocked(X_base, LI_base, DV_base, C // 16, 16, PREC)
    L = tl.where(low, tl.load(X_base + rows[:, None] * C + rows[None, :]), 0.0)
    Li = tl.load(LI_base + rows[:, None] * C + rows[None, :])
    d = tl.load(DV_base + rows)
    tl.debug_barrier()
    beta = 1.0 / d
    Z = tl.dot(Li, Y, input_precision=PREC)
    U = gam[:, None] * Z + tl.dot(Li * R, NBk, input_precision=PREC)
    Ue = endv[:, None] * U
    eyeD = (od[:, None] == od[None, :]) & (od[:, None] < D)
    Pn = gC * gC * tl.trans(P) + tl.where(eyeD, bC, 0.0) - tl.dot(tl.trans(Ue * beta[:, None]), Ue,
                                                                   input_precision=PREC)
    Pn = 0.5 * (Pn + tl.trans(Pn))
    return R, gam, endv, gC, b, kt, NBk, Y, L, Li, d, Z, U, Ue, Pn, fail


@triton.jit
def scan_segment_adjoint_kernel(
    Q, K, V, R2, ELL2, LA, DW, DBETA, DLINV, DVAR, DKW, DVU, DG,
    cu_seg, PST, PEND, PSCR, LDLSCR, DPST, FAIL,
    GQ, GK, GV, GR2, GELL2, GLA,
    H: tl.constexpr,
    D: tl.constexpr,
    MV: tl.constexpr,
    C: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    NS: tl.constexpr,
    INPUTS: tl.constexpr,
    REPLAY: tl.constexpr,
    PREC: tl.constexpr,
):
    """B2/B4 for one (segment, head), scalar decay: replay the segment's chunks from ``P_s``, then the adjoint back.

    Forward (REPLAY): the chunk step from PST ``[S, H, D, D]`` (the checkpoint), writing each chunk's start ``P``
    into PSCR ``[S, H, NS, BD, BD]`` (stored, not recomputed: recomputing chunk ``c``'s P from the checkpoint
    would cost ``c`` chunk steps); without REPLAY, PSCR already holds them (B4 reads what B2 wrote).
    Reverse: per chunk, the terms, ``S``, its LDLᵀ, ``U`` are recomputed from the stored P (the twin
    :func:`~bayeslayer.ops.scan_backward.chunk_adjoint` in the LDLᵀ factors: Lc = L·diag(√d),
    Lc⁻¹ = diag(1/√d) L⁻¹, so the Cholesky adjoint needs no triangular solve), starting from PEND ``[S, H, D, D]``
    (the adjoint arriving at the segment end); DPST ``[S, H, D, D]`` receives the symmetrised adjoint of ``P_s``.
    With INPUTS (B4) the terms' adjoint (:func:`~bayeslayer.ops.scan_backward.terms_adjoint`) gives GQ, GK
    ``[NT, H, D]``, GV ``[NT, H, MV]``, GR2, GELL2, GLA ``[NT, H]`` at the segment's real tokens.
    Packed inputs ``[NT, H, ·]`` (LA: the scalar log-decay ``[NT, H]``) and output adjoints (DW, DKW
    ``[NT, H, D]``, DBETA, DVAR, DG ``[NT, H]``, DLINV ``[NT, H, C]``, DVU ``[NT, H, MV]``; zeros for none);
    segment ``i`` is tokens ``cu_seg[i] .. cu_seg[i+1]-1``, ragged chunks padded with no-op tokens.
    LDLSCR ``[S, H, 2C² + C]`` the LDLᵀ scratch, FAIL ``[S, H]`` int32 its failed pivots.  Every C×C, C×D and
    D×D product is one ``tl.dot`` on whole register tiles (no 16×16 blocking yet).  Arithmetic in PST's dtype.
    """
    i_s = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    bos = tl.load(cu_seg + i_s).to(tl.int64)
    eos = tl.load(cu_seg + i_s + 1).to(tl.int64)
    n_chunks = tl.cdiv(eos - bos, C)
    dt = PST.dtype.element_ty
    rows = tl.arange(0, C)
    od = tl.arange(0, BD)
    om = tl.arange(0, BM)
    low = rows[:, None] >= rows[None, :]
    eye = rows[:, None] == rows[None, :]
    mD = od < D
    mM = om < MV
    mDD = mD[:, None] & mD[None, :]
    X_base = LDLSCR + (i_s * H + i_h) * (2 * C * C + C)
    LI_base = X_base + C * C
    DV_base = LI_base + C * C
    P_scr = PSCR + (i_s * H + i_h) * NS * BD * BD
    pDD = od[:, None] * BD + od[None, :]
    fail = tl.sum(tl.zeros([C], dtype=tl.int32), axis=0)
    if REPLAY:  # else PSCR holds the chunk states of an earlier replay from the same checkpoints (B2 for B4)
        P = tl.load(PST + (i_s * H + i_h) * D * D + od[:, None] * D + od[None, :], mask=mDD, other=0.0).to(dt)
        for i_c in range(n_chunks):
            tl.store(P_scr + i_c * BD * BD + pDD, P)
            tok = bos + i_c * C + rows
            valid = tok < eos
            mk = valid[:, None] & mD[None, :]
            k = tl.load(K + (tok[:, None] * H + i_h) * D + od[None, :], mask=mk, other=0.0).to(dt)
            r2c = tl.load(R2 + tok * H + i_h, mask=valid, other=1.0).to(dt)
            ell2c = tl.load(ELL2 + tok * H + i_h, mask=valid, other=0.0).to(dt)
            lac = tl.load(LA + tok * H + i_h, mask=valid, other=0.0).to(dt)
            _R, _g, _e, _gC, _b, _kt, _NBk, _Y, _L, _Li, _d, _Z, _U, _Ue, P, f1 = _chunk_scalar(
                k, r2c, ell2c, lac, P, X_base, LI_base, DV_base, rows, od, D, C, PREC)
            fail += f1
    tl.debug_barrier()
    Gb = tl.load(PEND + (i_s * H + i_h) * D * D + od[:, None] * D + od[None, :], mask=mDD, other=0.0).to(dt)
    for i_r in range(n_chunks):
        i_c = n_chunks - 1 - i_r
        P = tl.load(P_scr + i_c * BD * BD + pDD)
        tok = bos + i_c * C + rows
        valid = tok < eos
        mk = valid[:, None] & mD[None, :]
        pk = (tok[:, None] * H + i_h) * D + od[None, :]
        k = tl.load(K + pk, mask=mk, other=0.0).to(dt)
        q = tl.load(Q + pk, mask=mk, other=0.0).to(dt)
        pv = (tok[:, None] * H + i_h) * MV + om[None, :]
        mv = valid[:, None] & mM[None, :]
        v = tl.load(V + pv, mask=mv, other=0.0).to(dt)
        r2c = tl.load(R2 + tok * H + i_h, mask=valid, other=1.0).to(dt)
        ell2c = tl.load(ELL2 + tok * H + i_h, mask=valid, other=0.0).to(dt)
        lac = tl.load(LA + tok * H + i_h, mask=valid, other=0.0).to(dt)
        dW = tl.load(DW + pk, mask=mk, other=0.0).to(dt)
        dkw = tl.load(DKW + pk, mask=mk, other=0.0).to(dt)
        dvu = tl.load(DVU + pv, mask=mv, other=0.0).to(dt)
        dbeta = tl.load(DBETA + tok * H + i_h, mask=valid, other=0.0).to(dt)
        dvar = tl.load(DVAR + tok * H + i_h, mask=valid, other=0.0).to(dt)
        dLinv = tl.load(DLINV + (tok[:, None] * H + i_h) * C + rows[None, :], mask=valid[:, None], other=0.0).to(dt)
        R, gam, endv, gC, b, kt, NBk, Y, L, Li, d, Z, U, Ue, Pn, f2 = _chunk_scalar(
            k, r2c, ell2c, lac, P, X_base, LI_base, DV_base, rows, od, D, C, PREC)
        fail += f2  # (without REPLAY these are the only factorisations this launch checks)
        beta = 1.0 / d
        PT = tl.trans(P)
        # P' = sym(γ_C² Pᵀ + b_C I − Ueᵀ diag(β) Ue)
        Gs = 0.5 * (Gb + tl.trans(Gb))
        dP = gC * gC * tl.trans(Gs)
        dgC = 2.0 * gC * tl.sum(tl.sum(Gs * PT, axis=1), axis=0)
        dbC = tl.sum(tl.sum(tl.where((od[:, None] == od[None, :]), Gs, 0.0), axis=1), axis=0)
        UeG = tl.dot(Ue, Gs, input_precision=PREC)
        dUe = -2.0 * beta[:, None] * UeG
        dbeta_c = dbeta - tl.sum(UeG * Ue, axis=1)
        dend = tl.sum(dUe * U, axis=1)
        dU = endv[:, None] * dUe + beta[:, None] * dW
        dbeta_c += tl.sum(dW * U, axis=1)
        # the variance 1 + q̃ᵀPq̃ + qᵀBq − Σ_i β_i (q_tᵀΦ_tΦ_i⁻¹u_i)²
        qt = gam[:, None] * q
        QU = tl.dot(q, tl.trans(U), input_precision=PREC)
        Gq = R * QU
        dP += tl.dot(tl.trans(qt * dvar[:, None]), qt, input_precision=PREC)
        dqt = dvar[:, None] * tl.dot(qt, P + PT, input_precision=PREC)
        dGq = -2.0 * dvar[:, None] * beta[None, :] * Gq
        dbeta_c -= tl.sum(dvar[:, None] * Gq * Gq, axis=0)
        dq_dir = tl.dot(dGq * R, U, input_precision=PREC)
        dU += tl.dot(tl.trans(dGq * R), q, input_precision=PREC)
        dratio = dGq * QU
        # U = γ ⊙ (L⁻¹Y) + (L⁻¹ ⊙ R) B k
        dgam = tl.sum(dU * Z, axis=1)
        dZ = gam[:, None] * dU
        dUN = tl.dot(dU, tl.trans(NBk), input_precision=PREC)
        dLi = R * dUN + tl.dot(dZ, tl.trans(Y), input_precision=PREC)
        dNBk = tl.dot(tl.trans(Li * R), dU, input_precision=PREC)
        dratio += Li * dUN
        LiT = tl.trans(Li)
        dY = tl.dot(LiT, dZ, input_precision=PREC)
        dLi += dLinv + tl.dot(dkw, tl.trans(kt), input_precision=PREC) + tl.dot(dvu, tl.trans(v), input_precision=PREC)
        dkt = tl.dot(LiT, dkw, input_precision=PREC)
        # L⁻¹ = Lu⁻¹: dLu = −L⁻ᵀ dL⁻¹ L⁻ᵀ (strictly lower); Lc = Lu diag(√d), β = 1/d
        dLu = -tl.where(low & ~eye, tl.dot(tl.dot(LiT, dLi, input_precision=PREC), LiT, input_precision=PREC), 0.0)
        dc = tl.sqrt(d)
        Lc = L * dc[None, :]
        ddc = -tl.sum(dLu * Lc, axis=0) / d - 2.0 * dbeta_c / (d * dc)
        dLc = dLu / dc[None, :] + tl.where(eye, ddc[None, :], 0.0)
        # Cholesky adjoint: S̄ = sym(Lc⁻ᵀ Φ(Lcᵀ L̄c) Lc⁻¹), Lc⁻¹ = diag(1/√d) L⁻¹
        Phi = tl.where(low, tl.dot(tl.trans(Lc), dLc, input_precision=PREC), 0.0)
        Phi = Phi - 0.5 * tl.where(eye, Phi, 0.0)
        LcI = Li / dc[:, None]
        Sb = tl.dot(tl.dot(tl.trans(LcI), Phi, input_precision=PREC), LcI, input_precision=PREC)
        Sb = 0.5 * (Sb + tl.trans(Sb))
        # S = base + Y K̃ᵀ, Y = K̃ P
        dY += tl.dot(Sb, kt, input_precision=PREC)
        dkt += tl.dot(Sb, Y, input_precision=PREC) + tl.dot(dY, PT, input_precision=PREC)
        dP += tl.dot(tl.trans(kt), dY, input_precision=PREC)
        if INPUTS:
            # the P-free terms' adjoint (twin: terms_adjoint), every decay term one value for all channels
            dr2 = tl.sum(tl.where(eye, Sb, 0.0), axis=1)
            dNl = Sb + tl.trans(Sb) - tl.where(eye, Sb, 0.0)
            dNBk += tl.dot(tl.trans(dNl * R), k, input_precision=PREC)
            dratio += dNl * tl.dot(k, tl.trans(NBk), input_precision=PREC)
            dk = gam[:, None] * dkt + b[:, None] * dNBk + tl.dot(dNl * R, NBk, input_precision=PREC)
            last = rows == C - 1
            dbn = tl.sum(dNBk * k, axis=1) + tl.where(last, dbC, 0.0) + dvar * tl.sum(q * q, axis=1)
            dgam += tl.sum(dkt * k, axis=1) + tl.sum(dqt * q, axis=1)
            dq = gam[:, None] * dqt + 2.0 * (dvar * b)[:, None] * q + dq_dir
            dell2 = tl.sum(dbn[:, None] * R * R, axis=0)
            dratio += 2.0 * dbn[:, None] * R * ell2c[None, :]
            te = dend * endv
            tr = dratio * R
            dGv = dgam * gam + tl.where(last, dgC * gC + tl.sum(te, axis=0), 0.0) - te
            dGv += tl.sum(tr, axis=1) - tl.sum(tr, axis=0)
            dGv += tl.load(DG + tok * H + i_h, mask=valid, other=0.0).to(dt)
            dla = tl.sum(dGv, axis=0) - tl.cumsum(dGv, axis=0) + dGv
            dv = tl.dot(LiT, dvu, input_precision=PREC)
            tl.store(GQ + pk, dq.to(GQ.dtype.element_ty), mask=mk)
            tl.store(GK + pk, dk.to(GK.dtype.element_ty), mask=mk)
            tl.store(GV + pv, dv.to(GV.dtype.element_ty), mask=mv)
            tl.store(GR2 + tok * H + i_h, dr2.to(GR2.dtype.element_ty), mask=valid)
            tl.store(GELL2 + tok * H + i_h, dell2.to(GELL2.dtype.element_ty), mask=valid)
            tl.store(GLA + tok * H + i_h, dla.to(GLA.dtype.element_ty), mask=valid)
        Gb = dP
    Gb = 0.5 * (Gb + tl.trans(Gb))
    tl.store(DPST + (i_s * H + i_h) * D * D + od[:, None] * D + od[None, :], Gb.to(DPST.dtype.element_ty), mask=mDD)
    tl.store(FAIL + i_s * H + i_h, fail)


@triton.jit
def _chunk_diag(k, r2c, ell2c, la, P, X_base, LI_base, DV_base, rows, od,
                D: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr):
    """:func:`_chunk_scalar` for diagonal decay: ``R`` is the ``[C, C, BD]`` per-channel ratio ``Φ_iΦ_j⁻¹``,
    ``gam``, ``endv``, ``b`` are ``[C, BD]``, ``gC``, ``bC`` ``[BD]``; the per-channel C×C contractions are
    register reductions over the 3-D tile (CUDA cores), the D×D products ``tl.dot``."""
    low = rows[:, None] >= rows[None, :]
    low3 = low[:, :, None]
    eye = rows[:, None] == rows[None, :]
    g = tl.cumsum(la, axis=0)
    gend = tl.sum(la, axis=0)
    R = tl.where(low3, tl.exp(tl.where(low3, g[:, None, :] - g[None, :, :], 0.0)), 0.0)
    gam = tl.exp(g)
    endv = tl.exp(gend[None, :] - g)
    gC = tl.exp(gend)
    b = tl.sum(R * R * ell2c[None, :, None], axis=1)
    bC = tl.sum(tl.where((rows == C - 1)[:, None], b, 0.0), axis=0)
    kt = gam * k
    NBk = b * k
    Nl = tl.sum(k[:, None, :] * R * NBk[None, :, :], axis=2)
    base = Nl + tl.trans(Nl) + tl.where(eye, r2c[:, None] - Nl, 0.0)
    Y = tl.dot(kt, P, input_precision=PREC)
    S = base + tl.dot(Y, tl.trans(kt), input_precision=PREC)
    tl.store(X_base + rows[:, None] * C + rows[None, :], S)
    tl.store(DV_base + rows, r2c)
    tl.debug_barrier()
    fail = ldl_blocked(X_base, LI_base, DV_base, C // 16, 16, PREC)
    L = tl.where(low, tl.load(X_base + rows[:, None] * C + rows[None, :]), 0.0)
    Li = tl.load(LI_base + rows[:, None] * C + rows[None, :])
    d = tl.load(DV_base + rows)
    tl.debug_barrier()
    beta = 1.0 / d
    Z = tl.dot(Li, Y, input_precision=PREC)
    U = gam * Z + tl.sum(Li[:, :, None] * R * NBk[None, :, :], axis=1)
    Ue = endv * U
    eyeD = (od[:, None] == od[None, :]) & (od[:, None] < D)
    Pn = gC[:, None] * tl.trans(P) * gC[None, :] + tl.where(eyeD, bC[None, :], 0.0) \
        - tl.dot(tl.trans(Ue * beta[:, None]), Ue, input_precision=PREC)
    Pn = 0.5 * (Pn + tl.trans(Pn))
    return R, gam, endv, gC, b, kt, NBk, Y, L, Li, d, Z, U, Ue, Pn, fail


@triton.jit
def scan_segment_adjoint_diag_kernel(
    Q, K, V, R2, ELL2, LA, DW, DBETA, DLINV, DVAR, DKW, DVU, DG,
    cu_seg, PST, PEND, PSCR, LDLSCR, DPST, FAIL,
    GQ, GK, GV, GR2, GELL2, GLA,
    H: tl.constexpr,
    D: tl.constexpr,
    MV: tl.constexpr,
    C: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    NS: tl.constexpr,
    INPUTS: tl.constexpr,
    REPLAY: tl.constexpr,
    PREC: tl.constexpr,
):
    """:func:`scan_segment_adjoint_kernel` for diagonal decay: LA, DG, GLA are ``[NT, H, D]`` (per-channel
    log-decays, their adjoints), every decay term per channel (:func:`_chunk_diag`); the rest is the same."""
    i_s = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    bos = tl.load(cu_seg + i_s).to(tl.int64)
    eos = tl.load(cu_seg + i_s + 1).to(tl.int64)
    n_chunks = tl.cdiv(eos - bos, C)
    dt = PST.dtype.element_ty
    rows = tl.arange(0, C)
    od = tl.arange(0, BD)
    om = tl.arange(0, BM)
    low = rows[:, None] >= rows[None, :]
    eye = rows[:, None] == rows[None, :]
    mD = od < D
    mM = om < MV
    mDD = mD[:, None] & mD[None, :]
    X_base = LDLSCR + (i_s * H + i_h) * (2 * C * C + C)
    LI_base = X_base + C * C
    DV_base = LI_base + C * C
    P_scr = PSCR + (i_s * H + i_h) * NS * BD * BD
    pDD = od[:, None] * BD + od[None, :]
    fail = tl.sum(tl.zeros([C], dtype=tl.int32), axis=0)
    if REPLAY:  # else PSCR holds the chunk states of an earlier replay from the same checkpoints (B2 for B4)
        P = tl.load(PST + (i_s * H + i_h) * D * D + od[:, None] * D + od[None, :], mask=mDD, other=0.0).to(dt)
        for i_c in range(n_chunks):
            tl.store(P_scr + i_c * BD * BD + pDD, P)
            tok = bos + i_c * C + rows
            valid = tok < eos
            mk = valid[:, None] & mD[None, :]
            pk = (tok[:, None] * H + i_h) * D + od[None, :]
            k = tl.load(K + pk, mask=mk, other=0.0).to(dt)
            r2c = tl.load(R2 + tok * H + i_h, mask=valid, other=1.0).to(dt)
            ell2c = tl.load(ELL2 + tok * H + i_h, mask=valid, other=0.0).to(dt)
            la = tl.load(LA + pk, mask=mk, other=0.0).to(dt)
            _R, _g, _e, _gC, _b, _kt, _NBk, _Y, _L, _Li, _d, _Z, _U, _Ue, P, f1 = _chunk_diag(
                k, r2c, ell2c, la, P, X_base, LI_base, DV_base, rows, od, D, C, PREC)
            fail += f1
    tl.debug_barrier()
    Gb = tl.load(PEND + (i_s * H + i_h) * D * D + od[:, None] * D + od[None, :], mask=mDD, other=0.0).to(dt)
    for i_r in range(n_chunks):
        i_c = n_chunks - 1 - i_r
        P = tl.load(P_scr + i_c * BD * BD + pDD)
        tok = bos + i_c * C + rows
        valid = tok < eos
        mk = valid[:, None] & mD[None, :]
        pk = (tok[:, None] * H + i_h) * D + od[None, :]
        k = tl.load(K + pk, mask=mk, other=0.0).to(dt)
        q = tl.load(Q + pk, mask=mk, other=0.0).to(dt)
        pv = (tok[:, None] * H + i_h) * MV + om[None, :]
        mv = valid[:, None] & mM[None, :]
        v = tl.load(V + pv, mask=mv, other=0.0).to(dt)
        r2c = tl.load(R2 + tok * H + i_h, mask=valid, other=1.0).to(dt)
        ell2c = tl.load(ELL2 + tok * H + i_h, mask=valid, other=0.0).to(dt)
        la = tl.load(LA + pk, mask=mk, other=0.0).to(dt)
        dW = tl.load(DW + pk, mask=mk, other=0.0).to(dt)
        dkw = tl.load(DKW + pk, mask=mk, other=0.0).to(dt)
        dvu = tl.load(DVU + pv, mask=mv, other=0.0).to(dt)
        dbeta = tl.load(DBETA + tok * H + i_h, mask=valid, other=0.0).to(dt)
        dvar = tl.load(DVAR + tok * H + i_h, mask=valid, other=0.0).to(dt)
        dLinv = tl.load(DLINV + (tok[:, None] * H + i_h) * C + rows[None, :], mask=valid[:, None], other=0.0).to(dt)
        R, gam, endv, gC, b, kt, NBk, Y, L, Li, d, Z, U, Ue, Pn, f2 = _chunk_diag(
            k, r2c, ell2c, la, P, X_base, LI_base, DV_base, rows, od, D, C, PREC)
        fail += f2  # (without REPLAY these are the only factorisations this launch checks)
        beta = 1.0 / d
        PT = tl.trans(P)
        # P' = sym(Φ_C Pᵀ Φ_C + diag b_C − Ueᵀ diag(β) Ue)
        Gs = 0.5 * (Gb + tl.trans(Gb))
        dP = tl.trans(gC[:, None] * Gs * gC[None, :])
        GP = Gs * PT
        dgC = tl.sum(GP * gC[None, :], axis=1) + tl.sum(GP * gC[:, None], axis=0)
        dbC = tl.sum(tl.where(od[:, None] == od[None, :], Gs, 0.0), axis=1)
        UeG = tl.dot(Ue, Gs, input_precision=PREC)
        dUe = -2.0 * beta[:, None] * UeG
        dbeta_c = dbeta - tl.sum(UeG * Ue, axis=1)
        dend = dUe * U
        dU = endv * dUe + beta[:, None] * dW
        dbeta_c += tl.sum(dW * U, axis=1)
        # the variance
        qt = gam * q
        Gq = tl.sum(q[:, None, :] * R * U[None, :, :], axis=2)
        dP += tl.dot(tl.trans(qt * dvar[:, None]), qt, input_precision=PREC)
        dqt = dvar[:, None] * tl.dot(qt, P + PT, input_precision=PREC)
        dGq = -2.0 * dvar[:, None] * beta[None, :] * Gq
        dbeta_c -= tl.sum(dvar[:, None] * Gq * Gq, axis=0)
        dGR = dGq[:, :, None] * R
        dq_dir = tl.sum(dGR * U[None, :, :], axis=1)
        dU += tl.sum(dGR * q[:, None, :], axis=0)
        dratio = dGq[:, :, None] * q[:, None, :] * U[None, :, :]
        # U = γ ⊙ (L⁻¹Y) + mix(L⁻¹, B k)
        dgam = dU * Z
        dZ = gam * dU
        dLi = tl.sum(dU[:, None, :] * R * NBk[None, :, :], axis=2) + tl.dot(dZ, tl.trans(Y), input_precision=PREC)
        dNBk = tl.sum(Li[:, :, None] * R * dU[:, None, :], axis=0)
        dratio += Li[:, :, None] * dU[:, None, :] * NBk[None, :, :]
        LiT = tl.trans(Li)
        dY = tl.dot(LiT, dZ, input_precision=PREC)
        dLi += dLinv + tl.dot(dkw, tl.trans(kt), input_precision=PREC) + tl.dot(dvu, tl.trans(v), input_precision=PREC)
        dkt = tl.dot(LiT, dkw, input_precision=PREC)
        dLu = -tl.where(low & ~eye, tl.dot(tl.dot(LiT, dLi, input_precision=PREC), LiT, input_precision=PREC), 0.0)
        dc = tl.sqrt(d)
        Lc = L * dc[None, :]
        ddc = -tl.sum(dLu * Lc, axis=0) / d - 2.0 * dbeta_c / (d * dc)
        dLc = dLu / dc[None, :] + tl.where(eye, ddc[None, :], 0.0)
        Phi = tl.where(low, tl.dot(tl.trans(Lc), dLc, input_precision=PREC), 0.0)
        Phi = Phi - 0.5 * tl.where(eye, Phi, 0.0)
        LcI = Li / dc[:, None]
        Sb = tl.dot(tl.dot(tl.trans(LcI), Phi, input_precision=PREC), LcI, input_precision=PREC)
        Sb = 0.5 * (Sb + tl.trans(Sb))
        dY += tl.dot(Sb, kt, input_precision=PREC)
        dkt += tl.dot(Sb, Y, input_precision=PREC) + tl.dot(dY, PT, input_precision=PREC)
        dP += tl.dot(tl.trans(kt), dY, input_precision=PREC)
        if INPUTS:
            dr2 = tl.sum(tl.where(eye, Sb, 0.0), axis=1)
            dNl = Sb + tl.trans(Sb) - tl.where(eye, Sb, 0.0)
            dNR = dNl[:, :, None] * R
            dNBk += tl.sum(dNR * k[:, None, :], axis=0)
            dratio += dNl[:, :, None] * k[:, None, :] * NBk[None, :, :]
            dk = gam * dkt + b * dNBk + tl.sum(dNR * NBk[None, :, :], axis=1)
            lastc = (rows == C - 1)[:, None]
            dbn = dNBk * k + tl.where(lastc, dbC[None, :], 0.0) + dvar[:, None] * q * q
            dgam += dkt * k + dqt * q
            dq = gam * dqt + 2.0 * dvar[:, None] * b * q + dq_dir
            dell2 = tl.sum(tl.sum(dbn[:, None, :] * R * R, axis=2), axis=0)
            dratio += 2.0 * dbn[:, None, :] * R * ell2c[None, :, None]
            te = dend * endv
            tr = dratio * R
            dGv = dgam * gam + tl.where(lastc, (dgC * gC)[None, :] + tl.sum(te, axis=0)[None, :], 0.0) - te
            dGv += tl.sum(tr, axis=1) - tl.sum(tr, axis=0)
            dGv += tl.load(DG + pk, mask=mk, other=0.0).to(dt)
            dla = tl.sum(dGv, axis=0)[None, :] - tl.cumsum(dGv, axis=0) + dGv
            dv = tl.dot(LiT, dvu, input_precision=PREC)
            tl.store(GQ + pk, dq.to(GQ.dtype.element_ty), mask=mk)
            tl.store(GK + pk, dk.to(GK.dtype.element_ty), mask=mk)
            tl.store(GV + pv, dv.to(GV.dtype.element_ty), mask=mv)
            tl.store(GR2 + tok * H + i_h, dr2.to(GR2.dtype.element_ty), mask=valid)
            tl.store(GELL2 + tok * H + i_h, dell2.to(GELL2.dtype.element_ty), mask=valid)
            tl.store(GLA + pk, dla.to(GLA.dtype.element_ty), mask=mk)
        Gb = dP
    Gb = 0.5 * (Gb + tl.trans(Gb))
    tl.store(DPST + (i_s * H + i_h) * D * D + od[:, None] * D + od[None, :], Gb.to(DPST.dtype.element_ty), mask=mDD)
    tl.store(FAIL + i_s * H + i_h, fail)


ADJOINT_NAMES = ("w", "beta", "linv", "variance", "kw", "vu", "g")  # as scan_backward.GRAD_NAMES


def chunk_state_scratch(lay: sc.ScanLayout, Hf: int, D: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The per-chunk start states of every segment's replay, ``[S, H', n_s, BD, BD]`` (``BD`` = D padded)."""
    BD = max(16, next_pow2(D))
    return torch.empty(lay.n_segments, Hf, lay.n_s, BD, BD, dtype=dtype, device=device)


def segment_adjoint_triton(lay: sc.ScanLayout, q, k, v, r2, ell2, log_alpha, adjoints: dict,
                           P_starts: torch.Tensor, P_end_bar: torch.Tensor, *, inputs: bool,
                           chunk_states: torch.Tensor | None = None, replay: bool = True):
    """B2 (``inputs=False``) or B4 (``inputs=True``) as one launch of :func:`scan_segment_adjoint_kernel`
    (scalar decay) or :func:`scan_segment_adjoint_diag_kernel` (diagonal decay).

    Packed inputs as the forward's (q, k ``[NT, H', D]``, v ``[NT, H', m]``, r2, ell2 ``[NT, H']``, log_alpha
    ``[NT, H', Da]``, Da = 1 scalar, D diagonal); ``adjoints``: the output adjoints keyed by :data:`ADJOINT_NAMES`
    (packed like the outputs: w, kw ``[NT, H', D]``, beta, variance ``[NT, H']``, linv ``[NT, H', C]``, vu
    ``[NT, H', m]``, g ``[NT, H', Da]``), None or missing for zero; ``P_starts``, ``P_end_bar``
    ``[S, H', D, D]``.  Returns ``(dP_start [S, H', D, D], grads, failed [S, H'])``: the symmetrised adjoint of
    every segment's start state, and with ``inputs`` a dict of packed gradients (``q, k, v, r2, ell2, la``;
    ``la`` ``[NT, H', Da]``), else None.  ``chunk_states`` (:func:`chunk_state_scratch`): where the replay
    keeps each chunk's start P (allocated here when None); ``replay=False`` skips the replay and reads them
    from ``chunk_states`` as an earlier call from the same ``P_starts`` wrote them (B4 after B2).
    Twin: :func:`bayeslayer.ops.scan_backward.segment_adjoint`.  Arithmetic in k's dtype.
    """
    if not isinstance(lay, sc.ScanLayout):
        raise TypeError(f"lay must be a ScanLayout, got {type(lay).__name__}")
    if not isinstance(k, torch.Tensor) or k.dim() != 3:
        raise ValueError(f"k must be a packed [NT, H', D] tensor, got {getattr(k, 'shape', type(k).__name__)}")
    NT, Hf, D = k.shape
    if not isinstance(log_alpha, torch.Tensor) or log_alpha.dim() != 3 or tuple(log_alpha.shape[:2]) != (NT, Hf) \
            or log_alpha.shape[-1] not in (1, D):
        raise ValueError(f"log_alpha must be [NT={NT}, H'={Hf}, 1 or {D}], got "
                         f"{getattr(log_alpha, 'shape', type(log_alpha).__name__)}")
    diag = log_alpha.shape[-1] > 1
    check_shaped("q", q, (NT, Hf, D))
    if not isinstance(v, torch.Tensor) or v.dim() != 3 or tuple(v.shape[:2]) != (NT, Hf):
        raise ValueError(f"v must be [NT={NT}, H'={Hf}, m], got {getattr(v, 'shape', type(v).__name__)}")
    check_shaped("r2", r2, (NT, Hf))
    check_shaped("ell2", ell2, (NT, Hf))
    S, C, dt, dev = lay.n_segments, lay.C, k.dtype, k.device
    if C % 16 != 0:
        raise ValueError(f"the layout's chunk size must be a multiple of 16 (tl.dot tiles), got {C}")
    check_shaped("P_starts", P_starts, (S, Hf, D, D), dt)
    check_shaped("P_end_bar", P_end_bar, (S, Hf, D, D), dt)
    for name, x in (("q", q), ("v", v), ("r2", r2), ("ell2", ell2), ("log_alpha", log_alpha),
                    ("P_starts", P_starts), ("P_end_bar", P_end_bar)):
        if x.dtype != dt or x.device != dev:
            raise ValueError(f"{name} must be a {dt} tensor on {dev} like k, got {x.dtype} on {x.device}")
    MV = v.shape[-1]
    Da = log_alpha.shape[-1]
    shapes = dict(w=(NT, Hf, D), beta=(NT, Hf), linv=(NT, Hf, C), variance=(NT, Hf), kw=(NT, Hf, D), vu=(NT, Hf, MV),
                  g=(NT, Hf, Da))
    if not isinstance(adjoints, dict) or set(adjoints) - set(ADJOINT_NAMES):
        raise ValueError(f"adjoints must be a dict keyed by {ADJOINT_NAMES}, got "
                         f"{sorted(adjoints) if isinstance(adjoints, dict) else type(adjoints).__name__}")
    adj = {}
    for name in ADJOINT_NAMES:
        x = adjoints.get(name)
        if x is None:
            x = torch.zeros(shapes[name], dtype=dt, device=dev)
        check_shaped(f"adjoints[{name!r}]", x, shapes[name], dt)
        adj[name] = x.contiguous()
    BD = max(16, next_pow2(D))
    BM = max(16, next_pow2(MV))
    dP_start = torch.zeros(S, Hf, D, D, dtype=dt, device=dev)
    fail = torch.zeros(S, Hf, dtype=torch.int32, device=dev)
    grads = None
    if inputs:
        grads = dict(q=torch.zeros_like(q), k=torch.zeros_like(k), v=torch.zeros_like(v), r2=torch.zeros_like(r2),
                     ell2=torch.zeros_like(ell2), la=torch.zeros(NT, Hf, Da, dtype=dt, device=dev))
    if NT == 0:
        return _sym(P_end_bar), grads, fail != 0
    from .scan import segment_offsets

    cu_seg = segment_offsets(lay, NT)
    if chunk_states is None:
        if not replay:
            raise ValueError("replay=False needs the chunk_states of an earlier replay")
        chunk_states = chunk_state_scratch(lay, Hf, D, dt, dev)
    check_shaped("chunk_states", chunk_states, (S, Hf, lay.n_s, BD, BD), dt)
    pscr = chunk_states
    ldl = torch.empty(S, Hf, 2 * C * C + C, dtype=dt, device=dev)
    g = grads if inputs else dict(q=dP_start, k=dP_start, v=dP_start, r2=dP_start, ell2=dP_start, la=dP_start)
    kernel = scan_segment_adjoint_diag_kernel if diag else scan_segment_adjoint_kernel
    kernel[(S, Hf)](
        q.contiguous(), k.contiguous(), v.contiguous(), r2.contiguous(), ell2.contiguous(),
        log_alpha.contiguous(), adj["w"], adj["beta"], adj["linv"], adj["variance"], adj["kw"], adj["vu"],
        adj["g"], cu_seg, P_starts.contiguous(), P_end_bar.contiguous(), pscr, ldl, dP_start,
        fail, g["q"], g["k"], g["v"], g["r2"], g["ell2"], g["la"],
        H=Hf, D=D, MV=MV, C=C, BD=BD, BM=BM, NS=lay.n_s, INPUTS=inputs, REPLAY=replay, PREC="ieee", num_warps=4,
    )
    return dP_start, grads, fail != 0


def _sym(X: torch.Tensor) -> torch.Tensor:
    return 0.5 * (X + X.transpose(-1, -2))


# ---------------------------------------------------------------------------------------------------
# the whole covariance-pass backward: B2, Phase A's elements, B3, B4
# ---------------------------------------------------------------------------------------------------

def covariance_scan_backward_triton(q, k, v, r2, ell2, log_alpha, P0, cu: list[int], C: int, *, segment_chunks: int,
                                    P_starts: torch.Tensor, dw=None, dbeta=None, dlinv=None, dvariance=None, dkw=None,
                                    dvu=None, dg=None, dP=None, elements=None):
    """Gradients of :func:`bayeslayer.ops.scan.covariance_scan`'s inputs on Triton (scalar or diagonal decay).

    Arguments as :func:`bayeslayer.ops.scan_backward.covariance_scan_backward` (packed ``[NT, H', ...]``
    inputs, ``P0 [N, H', D, D]``, the forward's checkpoints ``P_starts [S, H', D, D]``, output adjoints
    None for zero, ``elements = (A, C, J)`` of ``lay.element_segments`` if the forward kept them).
    Launches, whatever T: B2 (:func:`segment_adjoint_triton`), Phase A's elements when not given
    (:func:`bayeslayer.ops.triton.scan.phase_a_triton`, two kernels, float64), B3
    (:func:`reverse_segments_triton`, float64), B4; no host loop over chunks or segments, no host sync.
    Returns ``(ScanGrads, failed [N, H'])``: a factorisation that was not positive definite sets its
    sequence's device-side flag (never checked here).
    """
    from .. import scan_backward as sbw
    from .scan import phase_a_triton

    if not isinstance(k, torch.Tensor) or k.dim() != 3:
        raise ValueError(f"k must be a packed [NT, H', D] tensor, got {getattr(k, 'shape', type(k).__name__)}")
    NT, Hf, D = k.shape
    if not isinstance(cu, (list, tuple)) or len(cu) < 2 or cu[0] != 0 or cu[-1] != NT or \
            any(b < a for a, b in zip(cu[:-1], cu[1:], strict=False)):
        raise ValueError(f"cu must be a non-decreasing list of offsets from 0 to NT={NT}, got {cu!r}")
    N = len(cu) - 1
    check_shaped("P0", P0, (N, Hf, D, D), k.dtype)
    lay = sc.scan_layout(list(cu), C, segment_chunks, k.device)
    check_shaped("P_starts", P_starts, (lay.n_segments, Hf, D, D), k.dtype)
    if dP is not None:
        check_shaped("dP", dP, (N, Hf, D, D), k.dtype)
    adj = dict(w=dw, beta=dbeta, linv=dlinv, variance=dvariance, kw=dkw, vu=dvu, g=dg)
    last, segs = lay.last_segments, lay.element_segments
    end_bar = torch.zeros_like(P_starts)
    if dP is not None:
        end_bar[last] = dP
    # B2: local adjoints of the checkpoints
    states = chunk_state_scratch(lay, Hf, D, k.dtype, k.device)
    G, _, f2 = segment_adjoint_triton(lay, q, k, v, r2, ell2, log_alpha, adj, P_starts, end_bar, inputs=False,
                                      chunk_states=states)
    # Phase A's elements (float64), B3 (float64)
    f64 = torch.float64
    if elements is None:
        A, _, J, f_a = phase_a_triton(lay, q, k, r2, ell2, log_alpha, segs)
    else:
        if not isinstance(elements, (tuple, list)) or len(elements) != 3:
            raise ValueError(f"elements must be Phase A's (A, C, J), got {type(elements).__name__}")
        A, _, J = elements
        f_a = torch.zeros(segs.numel(), Hf, dtype=torch.bool, device=k.device)
    Pbar, f3 = reverse_segments_triton(lay, G.to(f64), P_starts.to(f64), A, J)
    Pbar = Pbar.to(k.dtype)
    # B4: the true adjoint, P̄_{s+1} arriving at the end of every segment that is not last
    if segs.numel() > 0:
        end_bar[segs] = Pbar[segs + 1]
    # B4 reads the chunk states B2 kept (same checkpoints, same replay): no second replay
    dP_start, gr, f4 = segment_adjoint_triton(lay, q, k, v, r2, ell2, log_alpha, adj, P_starts, end_bar, inputs=True,
                                              chunk_states=states, replay=False)
    failed = f3.clone()
    sc.mark_failed(failed, lay.seg_seq, f2 | f4)
    sc.mark_failed(failed, lay.seg_seq[segs], f_a)
    grads = sbw.ScanGrads(q=gr["q"], k=gr["k"], v=gr["v"], r2=gr["r2"], ell2=gr["ell2"], log_alpha=gr["la"],
                          P0=dP_start[lay.seq_first_seg])
    return grads, failed
