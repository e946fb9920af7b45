"""The covariance pass's backward through the segment scan on Triton (docs/theory.md §6.5, §6.7).

Ports of the plain-PyTorch twin :mod:`bayeslayer.ops.bayesian_layer.scan_backward` (every kernel is tested against it,
``tests/ops/test_scan_backward_triton.py``):

* **B2/B4** :func:`segment_adjoint_triton` → :func:`scan_segment_adjoint_kernel`, grid (segments, H'),
  serial over a segment's chunks: replay from the checkpoint ``P_s`` (each chunk's start P kept in a
  scratch, :func:`chunk_state_scratch`, which B4 reads instead of replaying again), then the per-chunk
  adjoint back to the segment start (twin ``segment_adjoint``; B4 adds every input gradient).  One kernel
  for both decays (``DIAG``), blocked like the forward's covariance kernel: P, its adjoint and the ``[C, D]``
  operands in per-program scratch, read in 16-column key blocks; scalar decay's C×C-weighted products are
  ``tl.dot`` with the ratio, diagonal decay's CUDA-core loops over the chunk (reading the prep kernel's g, b
  and base of S); the inputs' dtype.
* **B3** :func:`reverse_segments_triton` → :func:`scan_reverse_kernel`, grid (sequences, H'), serial over
  each sequence's segments in reverse: ``P̄_s = Ā_sᵀ P̄_{s+1} Ā_s + G_s`` with ``Ā_s`` from Phase B's
  factors (twin ``element_transition`` + ``reverse_segments``); float64, 16×16 ``tl.dot`` tiles.
* **all** :func:`covariance_scan_backward_triton`: the prep (diagonal decay), B2, Phase A's elements
  (``phase_a_triton``) unless the forward kept them, B3, B4 (twin ``covariance_scan_backward``).

Not here: the mean pass (B1), a kernel of its own for the prep's adjoint (B5: folded into B4 per chunk), the
autograd wiring (``ops/bayesian_layer/scan_grad.py``).  Compiled for sm_90 every variant builds at D ≤ 256; at C = 64
B2/B4 spill 1.2–3 KB per thread, at C = 32 ≤ 272 bytes (docs/kernels.md, "B2/B4 blocked").  Scratch written by some
threads of a program and read by others is fenced by ``tl.debug_barrier()``: the interpreter cannot check that.

Every launch count is independent of T: one launch per kernel, whatever the number of chunks or segments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils.ldl_triton import ldl_blocked
from ..utils.validation import check_shaped
from . import scan as sc
from .covariance import sym
from .kernels_triton import decay_mix, decay_scores, load_tile, prep_tile, row_of, tile_at
from .scan_triton import (
    Prep,
    load_block,
    phase_a_triton,
    prep_triton,
    sblock,
    segment_offsets,
    sym_update,
    times_g,
    times_lm_inv_t,
    woodbury_factors,
    woodbury_launch,
    woodbury_scratch,
)
from .triton_support import next_pow2

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
    (:func:`bayeslayer.ops.bayesian_layer.scan_triton.scan_phase_b_kernel`): ``P_s = L_P D_P L_Pᵀ``, ``G = L_P D_P^½``,
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
    dt = PB.dtype.element_ty
    X, LI, MM, TT, DP, DM = woodbury_scratch(SCR, i_n, i_h, H, BN, 5)
    WW = TT + BN * BN
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
        fail += woodbury_factors(Pin, Je, X, LI, MM, TT, DP, DM, r, D, NB, BLK, BN, PREC)  # TT = J G
        # Q = L_M⁻¹ (JG)ᵀ into MM (L_M itself is no longer needed)
        for ib in range(NB):
            for jb in range(NB):
                acc = tl.zeros([BLK, BLK], dtype=dt)
                for kb in range(ib + 1):
                    TTjk = tl.load(sblock(TT, jb, kb, r, BN, BLK))
                    acc += tl.dot(tl.load(sblock(LI, ib, kb, r, BN, BLK)), tl.trans(TTjk), input_precision=PREC)
                tl.store(sblock(MM, ib, jb, r, BN, BLK), acc)
        tl.debug_barrier()
        times_g(Ae, X, DP, TT, r, D, NB, BLK, BN, PREC)  # TT = A G
        tl.debug_barrier()
        times_lm_inv_t(TT, LI, DM, X, r, NB, BLK, BN, PREC, False)  # Z' = (AG) L_M⁻ᵀ D_M⁻¹ (X: L_P no longer needed)
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
        sym_update(Gs, Gs, TT, WW, r, D, NB, BLK, BN, PREC, False, True)  # P̄_s = sym(G_s) + Āᵀ WW, in place
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
    :func:`bayeslayer.ops.bayesian_layer.scan_backward.reverse_segments` with
    :func:`~bayeslayer.ops.bayesian_layer.scan_backward.element_transition`.
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
    elem, NB, scr = woodbury_launch(S, lay.element_segments, N, Hf, D, 5, dt, dev)
    scan_reverse_kernel[(N, Hf)](
        Pbar, P_starts.to(dt).contiguous(), A.to(dt).contiguous(), J.to(dt).contiguous(), elem, lay.seq_first_seg,
        lay.seq_n_seg, scr, fail, H=Hf, D=D, NB=NB, PREC="ieee", num_warps=4,
    )
    return Pbar, fail != 0


# ---------------------------------------------------------------------------------------------------
# B2 / B4: replay a segment from its checkpoint and run the per-chunk adjoint back to its start
# ---------------------------------------------------------------------------------------------------

@triton.jit
def _mix(X, RS, x, g, rows, cols, C: tl.constexpr, DIAG: tl.constexpr, PREC: tl.constexpr):
    """``out_i = Σ_{j≤i} X_ij Φ_iΦ_j⁻¹ x_j`` for a ``[C, BK]`` tile x: ``(X ⊙ R) x`` with scalar decay (R the
    C×C ratio, read from RS), the per-channel column loop :func:`.kernels_triton.decay_mix` with diagonal decay
    (g ``[C, BK]``)."""
    if DIAG:
        out = decay_mix(X, x, g, rows, cols, C)
    else:
        out = tl.dot(X * tl.load(RS + rows[:, None] * C + cols[None, :]), x, input_precision=PREC)
    return out


@triton.jit
def _mix_t(X, RS, x, g, rows, cols, C: tl.constexpr, DIAG: tl.constexpr, PREC: tl.constexpr):
    """``out_j = Σ_{i≥j} X_ij Φ_iΦ_j⁻¹ x_i`` (the transpose of :func:`_mix`): ``(X ⊙ R)ᵀ x`` with scalar decay,
    a loop over the C rows with diagonal decay (every exponent ≤ 0 where it is used)."""
    if DIAG:
        out = tl.zeros(x.shape, dtype=x.dtype)
        for i in range(C):
            xi = row_of(x, rows, i)
            gi = row_of(g, rows, i)
            Xi = tl.where(cols <= i, row_of(X, rows, i), 0.0)  # X_ij over j ≤ i
            out += Xi[:, None] * tl.exp(tl.minimum(gi[None, :] - g, 0.0)) * xi[None, :]
    else:
        out = tl.dot(tl.trans(X * tl.load(RS + rows[:, None] * C + cols[None, :])), x, input_precision=PREC)
    return out


@triton.jit
def _scores(a, x, RS, g, rows, cols, C: tl.constexpr, DIAG: tl.constexpr, PREC: tl.constexpr):
    """``[i, j] = Σ_d a_id Φ_iΦ_j⁻¹ x_jd`` for ``i ≥ j``, else 0 (``[C, BK]`` tiles a, x) -> ``[C, C]``."""
    if DIAG:
        out = decay_scores(a, x, g, rows, cols, C)
    else:
        out = tl.load(RS + rows[:, None] * C + cols[None, :]) * tl.dot(a, tl.trans(x), input_precision=PREC)
    return out


@triton.jit
def _decay_block(PG, PB, pc, rows, od, g, b, gend, bC, C: tl.constexpr, D: tl.constexpr, DIAG: tl.constexpr):
    """The decay terms of the key channels ``od`` of one chunk: ``(g, Φ, Φ_CΦ⁻¹, b, Φ_C, b_C)``.

    Diagonal decay: ``[C, BK]`` tiles (``[BK]`` for the chunk-end ones) from the prep buffers PG, PB (row
    ``pc`` = chunk·H + head; padded key channels read 0).  Scalar decay: the chunk's ``[C]`` vectors g, b and
    scalars ``gend``, ``bC`` as ``[C, 1]`` columns that broadcast over the channels (``b_C`` only on ``od < D``).
    """
    if DIAG:
        g_a = prep_tile(PG, pc, rows, od, C, D, PG.dtype.element_ty)
        b_a = prep_tile(PB, pc, rows, od, C, D, PB.dtype.element_ty)
        ge = row_of(g_a, rows, C - 1)  # padding rows are no-op tokens: row C − 1 is the chunk end
        gam_a = tl.exp(g_a)
        end_a = tl.exp(ge[None, :] - g_a)
        gC_a = tl.exp(ge)
        bC_a = row_of(b_a, rows, C - 1)
    else:
        g_a = g[:, None]
        b_a = b[:, None]
        gam_a = tl.exp(g_a)
        end_a = tl.exp(gend - g_a)
        gC_a = tl.exp(gend) + tl.zeros(od.shape, dtype=g.dtype)
        bC_a = tl.where(od < D, bC, 0.0)
    return g_a, gam_a, end_a, b_a, gC_a, bC_a


@triton.jit
def _blk(base, oi, oj, N: tl.constexpr):
    """Pointers of the ``[BK, BK]`` block at rows ``oi``, columns ``oj`` of a row-major ``[N, N]`` buffer."""
    return base + oi[:, None] * N + oj[None, :]


@triton.jit
def _cols(base, rows, oj, N: tl.constexpr):
    """Pointers of columns ``oj`` of a row-major ``[C, N]`` per-program scratch."""
    return base + rows[:, None] * N + oj[None, :]


@triton.jit
def _pad_copy(SRC, DST, offs_k, D: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr):
    """A row-major ``[D, D]`` matrix into a ``[BD, BD]`` scratch, zeros in the padding, in the scratch's dtype."""
    for a in range(0, BD, BK):
        od = a + offs_k
        for bb in range(0, BD, BK):
            ob = bb + offs_k
            blk = tl.load(SRC + od[:, None] * D + ob[None, :], mask=(od[:, None] < D) & (ob[None, :] < D), other=0.0)
            tl.store(_blk(DST, od, ob, BD), blk.to(DST.dtype.element_ty))


@triton.jit
def _chunk_factor(K, Q, R2, PG, PB, PBASE, RS, pc, tok, valid, i_h, Pc, YS, US, X_base, LI_base, DV_base,
                  g, b, gend, bC, rows, cols, offs_k,
                  H: tl.constexpr, D: tl.constexpr, C: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr,
                  DIAG: tl.constexpr, VAR: tl.constexpr, want_gq, PREC: tl.constexpr):
    """One chunk from its start covariance (``Pc``, ``[BD, BD]``), as the forward's covariance kernel computes it,
    keeping what the adjoint reads: ``Y = K̃P`` → YS, ``S = base + YK̃ᵀ`` factored ``L diag(d) Lᵀ`` by
    :func:`..utils.ldl_triton.ldl_blocked` (pivots clamped at r²; L, L⁻¹, d in the LDLᵀ scratch), ``U = Φ ⊙ (L⁻¹Y) +
    mix(L⁻¹, Bk)`` → US, all in BK-column blocks.  Returns ``(failed pivots, Gq)`` with ``Gq_ti = q_tᵀΦ_tΦ_i⁻¹u_i``
    (``i ≤ t``; VAR and ``want_gq`` only, else zeros).  The base of S: from PBASE (diagonal decay, the prep
    kernel's), or formed from ``KKᵀ`` and the ratio in RS (scalar decay)."""
    dt = Pc.dtype.element_ty
    low = rows[:, None] >= cols[None, :]
    eye = rows[:, None] == cols[None, :]
    S = tl.zeros([C, C], dtype=dt)
    KK = tl.zeros([C, C], dtype=dt)
    for a in range(0, BD, BK):
        od = a + offs_k
        k_a = load_tile(K, tok, valid, od, i_h, H, D).to(dt)
        _g, gam_a, _e, _b, _gC, _bC = _decay_block(PG, PB, pc, rows, od, g, b, gend, bC, C, D, DIAG)
        Y_a = tl.zeros([C, BK], dtype=dt)
        for bb in range(0, BD, BK):
            ob = bb + offs_k
            _g2, gam_b, _e2, _b2, _gC2, _bC2 = _decay_block(PG, PB, pc, rows, ob, g, b, gend, bC, C, D, DIAG)
            k_b = load_tile(K, tok, valid, ob, i_h, H, D).to(dt)
            Y_a += tl.dot(gam_b * k_b, tl.load(_blk(Pc, ob, od, BD)), input_precision=PREC)
        S += tl.dot(Y_a, tl.trans(gam_a * k_a), input_precision=PREC)
        if not DIAG:
            KK += tl.dot(k_a, tl.trans(k_a), input_precision=PREC)
        tl.store(_cols(YS, rows, od, BD), Y_a)
    r2c = tl.load(R2 + tok * H + i_h, mask=valid, other=1.0).to(dt)
    if DIAG:
        S += tl.load(PBASE + (pc * C + rows[:, None]) * C + cols[None, :])
    else:
        Nl = tl.where(low, KK * tl.load(RS + rows[:, None] * C + cols[None, :]) * b[None, :], 0.0)
        S += Nl + tl.trans(Nl) - tl.where(eye, Nl, 0.0) + tl.where(eye, r2c[:, None], 0.0)
    tl.store(X_base + rows[:, None] * C + cols[None, :], S)
    tl.store(DV_base + rows, r2c)
    tl.debug_barrier()
    fail = ldl_blocked(X_base, LI_base, DV_base, C // 16, 16, PREC)
    Li = tl.load(LI_base + rows[:, None] * C + cols[None, :])
    Gq = tl.zeros([C, C], dtype=dt)
    for a in range(0, BD, BK):
        od = a + offs_k
        g_a, gam_a, _e, b_a, _gC, _bC = _decay_block(PG, PB, pc, rows, od, g, b, gend, bC, C, D, DIAG)
        k_a = load_tile(K, tok, valid, od, i_h, H, D).to(dt)
        U_a = gam_a * tl.dot(Li, tl.load(_cols(YS, rows, od, BD)), input_precision=PREC)
        U_a += _mix(Li, RS, b_a * k_a, g_a, rows, cols, C, DIAG, PREC)
        tl.store(_cols(US, rows, od, BD), U_a)
        if VAR:
            if want_gq:
                q_a = load_tile(Q, tok, valid, od, i_h, H, D).to(dt)
                Gq += _scores(q_a, U_a, RS, g_a, rows, cols, C, DIAG, PREC)
    tl.debug_barrier()
    return fail, Gq


@triton.jit
def _chunk_next(Pc, Pn, US, DV_base, PG, PB, pc, g, b, gend, bC, rows, offs_k,
                D: tl.constexpr, C: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, DIAG: tl.constexpr,
                PREC: tl.constexpr):
    """The chunk's end covariance ``sym(Φ_C P Φ_C) + B_C − Ueᵀ diag(β) Ue`` (``Ue = Φ_CΦ⁻¹ ⊙ U``) from Pc into Pn
    (both ``[BD, BD]``; lower blocks computed, each written with its transpose: exactly symmetric)."""
    beta = 1.0 / tl.load(DV_base + rows)
    eyeK = offs_k[:, None] == offs_k[None, :]
    for a in range(0, BD, BK):
        od = a + offs_k
        _g, _gam, end_a, _b, gC_a, bC_a = _decay_block(PG, PB, pc, rows, od, g, b, gend, bC, C, D, DIAG)
        Ua = beta[:, None] * end_a * tl.load(_cols(US, rows, od, BD))
        for bb in range(0, a + BK, BK):
            ob = bb + offs_k
            _g2, _gam2, end_b, _b2, gC_b, _bC2 = _decay_block(PG, PB, pc, rows, ob, g, b, gend, bC, C, D, DIAG)
            Ub = end_b * tl.load(_cols(US, rows, ob, BD))
            Ps = 0.5 * (tl.load(_blk(Pc, od, ob, BD)) + tl.trans(tl.load(_blk(Pc, ob, od, BD))))
            new = gC_a[:, None] * Ps * gC_b[None, :] - tl.dot(tl.trans(Ua), Ub, input_precision=PREC)
            new += tl.where(eyeK & (a == bb), bC_a[:, None], 0.0)
            new = tl.where(a == bb, 0.5 * (new + tl.trans(new)), new)
            tl.store(_blk(Pn, od, ob, BD), new)
            tl.store(_blk(Pn, ob, od, BD), tl.trans(new))
    tl.debug_barrier()


@triton.jit(do_not_specialize=["NS"])
def scan_segment_adjoint_kernel(
    Q, K, V, R2, ELL2, LA, PG, PB, PBASE, chunk_first,
    DW, DBETA, DLINV, DVAR, DKW, DVU, DG,
    cu_seg, PST, PEND, PSCR, WS, LDLSCR, DPST, FAIL,
    GQ, GK, GV, GR2, GELL2, GLA,
    H: tl.constexpr,
    D: tl.constexpr,
    MV: tl.constexpr,
    C: tl.constexpr,
    BD: tl.constexpr,
    BK: tl.constexpr,
    BM: tl.constexpr,
    BV: tl.constexpr,
    NS,
    DIAG: tl.constexpr,
    VAR: tl.constexpr,
    INPUTS: tl.constexpr,
    REPLAY: tl.constexpr,
    PREC: tl.constexpr,
):
    """B2/B4 for one (segment, head): replay the segment's chunks from ``P_s``, then the per-chunk adjoint back.

    Forward (REPLAY): from PST ``[S, H, D, D]`` (the checkpoint), each chunk's start ``P`` into PSCR
    ``[S, H, NS, BD, BD]`` (the next one computed from it, :func:`_chunk_next`); without REPLAY, PSCR already
    holds them (B4 reads what B2 wrote).  Reverse, per chunk from the last: :func:`_chunk_factor` again from the
    stored P, then the adjoint (twin :func:`~bayeslayer.ops.bayesian_layer.covariance.covariance_step_adjoint`
    in LDLᵀ factors — ``Lc = L diag(√d)``, ``Lc⁻¹ = diag(1/√d) L⁻¹`` — and
    :func:`~bayeslayer.ops.bayesian_layer.scan_backward.terms_adjoint`) in passes over BK-column blocks of the key dim,
    the D×D adjoint ``P̄`` in a per-program ping-pong buffer:

    * A1: ``UeP̄`` (``P̄`` symmetrised), ``P̄_start = Φ_C P̄ Φ_C + q̃ᵀ diag(v̄ar) q̃``, ``Ū``, ``β̄``, ``L̄⁻¹``
      (every term a sum over key blocks) and, with INPUTS and VAR, ``q̄`` (GQ) and the variance's share of the
      decay adjoint; then the C×C Cholesky adjoint → ``S̄``;
    * A2: ``Ȳ = L⁻ᵀ(Φ ⊙ Ū) + S̄K̃`` and ``P̄_start += K̃ᵀȲ``;
    * A3 (INPUTS, B4): ``k̄, r̄², ℓ̄², ∂/∂log α`` at the segment's real tokens (GK ``[NT, H, D]``, GV
      ``[NT, H, MV]`` (from the value blocks after A1), GR2, GELL2 ``[NT, H]``, GLA ``[NT, H, Da]``), every decay
      term's adjoint collected per channel as row and column sums of the ratio adjoint, then the reverse cumsum.

    Starts from PEND ``[S, H, D, D]`` (the adjoint arriving at the segment end); DPST ``[S, H, D, D]`` receives the
    symmetrised adjoint of ``P_s``.  Packed inputs ``[NT, H, ·]`` (LA ``[NT, H]``: the scalar log-decay; diagonal
    decay reads the prep kernel's PG, PB ``[NC, H, C, D]`` and PBASE ``[NC, H, C, C]`` instead, segment ``i``'s
    first chunk at ``chunk_first[i]``), output adjoints (DW, DKW ``[NT, H, D]``, DBETA, DVAR ``[NT, H]``, DG
    ``[NT, H, Da]``, DLINV ``[NT, H, C]``, DVU ``[NT, H, MV]``; DVAR read only with VAR); segment ``i`` is tokens
    ``cu_seg[i] .. cu_seg[i+1]-1``, ragged chunks padded with the exact no-op tokens.  WS ``[S, H, 5·C·BD +
    2·BD² + 3·C²]`` per-program scratch (Y, U, Ū, Ȳ, the decay adjoint of A1, the two P̄ buffers, and the C×C
    operands the block loops read: the ratio, Ḡq, S̄), LDLSCR
    ``[S, H, 2C² + C]``, FAIL ``[S, H]`` int32 (pivots that were not positive).  Scalar decay: every C×C-weighted
    product is a ``tl.dot`` with the ratio R; diagonal decay: those are CUDA-core loops over the C rows/columns
    (:func:`_mix`, :func:`_mix_t`, :func:`_scores`), the D×D and L⁻¹ products ``tl.dot``.  Arithmetic in PST's
    dtype; no ``[BD, BD]`` or ``[C, BD]`` register tile: P, P̄ and the ``[C, D]`` operands live in the scratch and
    are read block by block.
    """
    i_s = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    bos = tl.load(cu_seg + i_s).to(tl.int64)
    eos = tl.load(cu_seg + i_s + 1).to(tl.int64)
    n_chunks = tl.cdiv(eos - bos, C)
    dt = PST.dtype.element_ty
    rows = tl.arange(0, C)
    cols = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    low = rows[:, None] >= cols[None, :]
    eye = rows[:, None] == cols[None, :]
    eyeK = offs_k[:, None] == offs_k[None, :]
    last = rows == C - 1
    pCC = rows[:, None] * C + cols[None, :]
    prog = i_s * H + i_h
    X_base = LDLSCR + prog * (2 * C * C + C)
    LI_base = X_base + C * C
    DV_base = LI_base + C * C
    P_scr = PSCR + prog * NS * BD * BD
    YS = WS + prog * (5 * C * BD + 2 * BD * BD + 3 * C * C)
    US = YS + C * BD
    DUS = US + C * BD
    DYS = DUS + C * BD
    DGS = DYS + C * BD  # A1's part of the per-channel decay adjoint (diagonal decay)
    GB = DGS + C * BD  # two [BD, BD] adjoint buffers
    RS = GB + 2 * BD * BD  # C×C operands read inside the block loops: the ratio (scalar decay), Ḡq, S̄
    GQS = RS + C * C
    SBS = GQS + C * C
    pc0 = 0
    if DIAG:
        pc0 = tl.load(chunk_first + i_s).to(tl.int64)
    fail = tl.sum(tl.zeros([C], dtype=tl.int32), axis=0)
    zero_c = tl.zeros([C], dtype=dt)
    zero_s = tl.sum(zero_c, axis=0)
    n_rep = 0
    if REPLAY:  # else PSCR holds the chunk states of an earlier replay from the same checkpoints (B2 for B4)
        n_rep = tl.maximum(n_chunks - 1, 0)  # the last chunk's end state is the next checkpoint: not needed here
        _pad_copy(PST + prog * D * D, P_scr, offs_k, D, BD, BK)
    _pad_copy(PEND + prog * D * D, GB, offs_k, D, BD, BK)  # the adjoint arriving at the segment end
    tl.debug_barrier()
    # one loop, one inlined chunk factorisation: the replay's steps (forward), then the adjoint's (reverse)
    for it in range(n_rep + n_chunks):
        fwd = it < n_rep
        i_r = it - n_rep
        i_c = tl.where(fwd, it, n_chunks - 1 - i_r)
        Pc = P_scr + i_c * BD * BD
        tok = bos + i_c * C + rows
        valid = tok < eos
        pc = (pc0 + i_c) * H + i_h
        ell2c = tl.load(ELL2 + tok * H + i_h, mask=valid, other=0.0).to(dt)
        g, b, gend, bC = zero_c, zero_c, zero_s, zero_s
        if not DIAG:
            lac = tl.load(LA + tok * H + i_h, mask=valid, other=0.0).to(dt)
            g = tl.cumsum(lac, axis=0)
            gend = tl.sum(lac, axis=0)
            R = tl.where(low, tl.exp(tl.minimum(g[:, None] - g[None, :], 0.0)), 0.0)
            b = tl.sum(R * R * ell2c[None, :], axis=1)
            bC = tl.sum(tl.where(last, b, 0.0), axis=0)
            tl.store(RS + pCC, R)
            tl.debug_barrier()  # R is read back (by other threads) in the chunk's factorisation and adjoint
        f2, Gq = _chunk_factor(K, Q, R2, PG, PB, PBASE, RS, pc, tok, valid, i_h, Pc, YS, US, X_base, LI_base,
                               DV_base, g, b, gend, bC, rows, cols, offs_k, H, D, C, BD, BK, DIAG, VAR, ~fwd, PREC)
        fail += f2
        if fwd:
            _chunk_next(Pc, Pc + BD * BD, US, DV_base, PG, PB, pc, g, b, gend, bC, rows, offs_k, D, C, BD, BK, DIAG,
                        PREC)
        else:
            Gin = GB + (i_r % 2) * BD * BD
            Gout = GB + ((i_r + 1) % 2) * BD * BD
            d = tl.load(DV_base + rows)
            beta = 1.0 / d
            dbeta_c = tl.load(DBETA + tok * H + i_h, mask=valid, other=0.0).to(dt)
            dLi = tl.load(DLINV + (tok[:, None] * H + i_h) * C + cols[None, :], mask=valid[:, None],
                          other=0.0).to(dt)
            dvar = zero_c
            if VAR:
                dvar = tl.load(DVAR + tok * H + i_h, mask=valid, other=0.0).to(dt)
                tl.store(GQS + pCC, -2.0 * dvar[:, None] * beta[None, :] * Gq)
                dbeta_c -= tl.sum(dvar[:, None] * Gq * Gq, axis=0)
            dGsum = zero_c  # scalar decay: the adjoint of g summed over channels
            tl.debug_barrier()
            # ---- A1: P' = sym(Φ_C Pᵀ Φ_C + B_C − Ueᵀ diag(β) Ue); U, W = βU, the variance, L⁻¹'s uses ----
            for a in range(0, BD, BK):
                od = a + offs_k
                g_a, gam_a, end_a, b_a, gC_a, _bC = _decay_block(PG, PB, pc, rows, od, g, b, gend, bC, C, D, DIAG)
                pk, mk = tile_at(tok, valid, od, i_h, H, D)
                U_a = tl.load(_cols(US, rows, od, BD))
                dW_a = tl.load(DW + pk, mask=mk, other=0.0).to(dt)
                UeG = tl.zeros([C, BK], dtype=dt)
                dgC_a = tl.zeros([BK], dtype=dt)
                if VAR:
                    q_a = tl.load(Q + pk, mask=mk, other=0.0).to(dt)
                    qt_a = gam_a * q_a
                    dqt = tl.zeros([C, BK], dtype=dt)
                for bb in range(0, BD, BK):
                    ob = bb + offs_k
                    _g2, gam_b, end_b, _b2, gC_b, _bC2 = _decay_block(PG, PB, pc, rows, ob, g, b, gend, bC, C, D,
                                                                      DIAG)
                    Gs = 0.5 * (tl.load(_blk(Gin, ob, od, BD)) + tl.trans(tl.load(_blk(Gin, od, ob, BD))))
                    UeG += tl.dot(end_b * tl.load(_cols(US, rows, ob, BD)), Gs, input_precision=PREC)
                    dPb = gC_b[:, None] * Gs * gC_a[None, :]
                    if VAR:
                        qt_b = gam_b * load_tile(Q, tok, valid, ob, i_h, H, D).to(dt)
                        dPb += tl.dot(tl.trans(qt_b * dvar[:, None]), qt_a, input_precision=PREC)
                    tl.store(_blk(Gout, ob, od, BD), dPb)
                    if INPUTS:
                        Pboth = tl.load(_blk(Pc, ob, od, BD)) + tl.trans(tl.load(_blk(Pc, od, ob, BD)))
                        dgC_a += tl.sum(Gs * Pboth * gC_b[:, None], axis=0)
                        if VAR:  # q̃ᵀ(P + Pᵀ), for q̄
                            dqt += tl.dot(qt_b, Pboth, input_precision=PREC)
                Ue_a = end_a * U_a
                dUe = -2.0 * beta[:, None] * UeG
                dbeta_c += tl.sum(dW_a * U_a - UeG * Ue_a, axis=1)
                dU_a = end_a * dUe + beta[:, None] * dW_a
                if VAR:
                    # the variance 1 + q̃ᵀPq̃ + qᵀBq − Σ_i β_i Gq_ti², Gq_ti = q_tᵀΦ_tΦ_i⁻¹u_i
                    mTq = _mix_t(tl.load(GQS + pCC), RS, q_a, g_a, rows, cols, C, DIAG, PREC)
                    dU_a += mTq
                    if INPUTS:  # q̄ and the variance's share of the decay adjoint (B is A3's, with b̄)
                        dqt = dvar[:, None] * dqt
                        dqd = _mix(tl.load(GQS + pCC), RS, U_a, g_a, rows, cols, C, DIAG, PREC)
                        dq = gam_a * dqt + 2.0 * dvar[:, None] * b_a * q_a + dqd
                        tl.store(GQ + pk, dq.to(GQ.dtype.element_ty), mask=mk)
                        dGvar = (gam_a * dqt + dqd) * q_a - U_a * mTq
                tl.store(_cols(DUS, rows, od, BD), dU_a)
                k_a = tl.load(K + pk, mask=mk, other=0.0).to(dt)
                dLi += _scores(dU_a, b_a * k_a, RS, g_a, rows, cols, C, DIAG, PREC)
                dLi += tl.dot(gam_a * dU_a, tl.trans(tl.load(_cols(YS, rows, od, BD))), input_precision=PREC)
                dLi += tl.dot(tl.load(DKW + pk, mask=mk, other=0.0).to(dt), tl.trans(gam_a * k_a),
                              input_precision=PREC)
                if INPUTS:
                    te = dUe * U_a * end_a
                    dG1 = tl.where(last[:, None], (tl.sum(te, axis=0) + dgC_a * gC_a)[None, :], 0.0) - te
                    if VAR:
                        dG1 += dGvar
                    if DIAG:
                        tl.store(_cols(DGS, rows, od, BD), dG1)
                    else:
                        dGsum += tl.sum(dG1, axis=1)
            for vb in range(0, BM, BV):
                ov = vb + offs_v
                pv = (tok[:, None] * H + i_h) * MV + ov[None, :]
                mv = valid[:, None] & (ov[None, :] < MV)
                dvu_v = tl.load(DVU + pv, mask=mv, other=0.0).to(dt)
                dLi += tl.dot(dvu_v, tl.trans(tl.load(V + pv, mask=mv, other=0.0).to(dt)), input_precision=PREC)
                if INPUTS:
                    dv = tl.dot(tl.trans(tl.load(LI_base + pCC)), dvu_v, input_precision=PREC)
                    tl.store(GV + pv, dv.to(GV.dtype.element_ty), mask=mv)
            # ---- L⁻¹ = Lu⁻¹: dLu = −L⁻ᵀ dL⁻¹ L⁻ᵀ (strictly lower); Lc = Lu diag(√d), β = 1/d; Cholesky adjoint ----
            LiT = tl.trans(tl.load(LI_base + pCC))
            dLu = -tl.where(low & ~eye, tl.dot(tl.dot(LiT, dLi, input_precision=PREC), LiT, input_precision=PREC),
                            0.0)
            dc = tl.sqrt(d)
            Lc = tl.where(low, tl.load(X_base + pCC), 0.0) * dc[None, :]
            ddc = -tl.sum(dLu * Lc, axis=0) / d - 2.0 * dbeta_c / (d * dc)
            dLc = dLu / dc[None, :] + tl.where(eye, ddc[None, :], 0.0)
            Phi = tl.where(low, tl.dot(tl.trans(Lc), dLc, input_precision=PREC), 0.0)
            Phi = Phi - 0.5 * tl.where(eye, Phi, 0.0)
            LcI = tl.trans(LiT) / dc[:, None]
            Sb = tl.dot(tl.dot(tl.trans(LcI), Phi, input_precision=PREC), LcI, input_precision=PREC)
            tl.store(SBS + pCC, 0.5 * (Sb + tl.trans(Sb)))
            tl.debug_barrier()
            # ---- A2: S = base + Y K̃ᵀ, Y = K̃ P:  Ȳ = L⁻ᵀ(Φ ⊙ Ū) + S̄ K̃,  P̄ += K̃ᵀ Ȳ ----
            for a in range(0, BD, BK):
                od = a + offs_k
                _g, gam_a, _e, _b, _gC, _bC = _decay_block(PG, PB, pc, rows, od, g, b, gend, bC, C, D, DIAG)
                kt_a = gam_a * load_tile(K, tok, valid, od, i_h, H, D).to(dt)
                dY_a = tl.dot(tl.trans(tl.load(LI_base + pCC)), gam_a * tl.load(_cols(DUS, rows, od, BD)),
                              input_precision=PREC)
                dY_a += tl.dot(tl.load(SBS + pCC), kt_a, input_precision=PREC)
                tl.store(_cols(DYS, rows, od, BD), dY_a)
                for bb in range(0, BD, BK):
                    ob = bb + offs_k
                    _g2, gam_b, _e2, _b2, _gC2, _bC2 = _decay_block(PG, PB, pc, rows, ob, g, b, gend, bC, C, D,
                                                                    DIAG)
                    kt_b = gam_b * load_tile(K, tok, valid, ob, i_h, H, D).to(dt)
                    p = _blk(Gout, ob, od, BD)
                    tl.store(p, tl.load(p) + tl.dot(tl.trans(kt_b), dY_a, input_precision=PREC))
            tl.debug_barrier()
            if INPUTS:
                # ---- A3: the inputs' gradients (twin: terms_adjoint), every decay term per channel ----
                dell2 = zero_c
                for a in range(0, BD, BK):
                    od = a + offs_k
                    g_a, gam_a, _e, b_a, _gC, _bC = _decay_block(PG, PB, pc, rows, od, g, b, gend, bC, C, D, DIAG)
                    pk, mk = tile_at(tok, valid, od, i_h, H, D)
                    k_a = tl.load(K + pk, mask=mk, other=0.0).to(dt)
                    Y_a = tl.load(_cols(YS, rows, od, BD))
                    dU_a = tl.load(_cols(DUS, rows, od, BD))
                    NBk_a = b_a * k_a
                    dkt = tl.dot(tl.trans(tl.load(LI_base + pCC)), tl.load(DKW + pk, mask=mk, other=0.0).to(dt),
                                 input_precision=PREC)
                    dkt += tl.dot(tl.load(SBS + pCC), Y_a, input_precision=PREC)
                    for bb in range(0, BD, BK):
                        ob = bb + offs_k
                        dkt += tl.dot(tl.load(_cols(DYS, rows, ob, BD)), tl.trans(tl.load(_blk(Pc, od, ob, BD))),
                                      input_precision=PREC)
                    # the mix of U: U = Φ ⊙ (L⁻¹Y) + mix(L⁻¹, Bk)
                    dNBk = _mix_t(tl.load(LI_base + pCC), RS, dU_a, g_a, rows, cols, C, DIAG, PREC)
                    rs = dU_a * _mix(tl.load(LI_base + pCC), RS, NBk_a, g_a, rows, cols, C, DIAG, PREC)
                    # the base of S: sym(N) + diag(r²), N_ij = k_iᵀ ρ_ij b_j k_j
                    Sb = tl.load(SBS + pCC)
                    dNl = Sb + tl.trans(Sb) - tl.where(eye, Sb, 0.0)
                    dNBk += _mix_t(dNl, RS, k_a, g_a, rows, cols, C, DIAG, PREC)
                    mNl = _mix(dNl, RS, NBk_a, g_a, rows, cols, C, DIAG, PREC)
                    rs += k_a * mNl
                    cs = NBk_a * dNBk
                    dk = gam_a * dkt + b_a * dNBk + mNl
                    dbC_a = tl.sum(tl.where(eyeK, tl.load(_blk(Gin, od, od, BD)), 0.0), axis=1)
                    db = dNBk * k_a + tl.where(last[:, None], dbC_a[None, :], 0.0)
                    dgam = dU_a * tl.dot(tl.load(LI_base + pCC), Y_a, input_precision=PREC) + dkt * k_a
                    if VAR:
                        q_a = tl.load(Q + pk, mask=mk, other=0.0).to(dt)
                        db += dvar[:, None] * q_a * q_a
                    # B = Σ_l ℓ_l² ρ_jl²: Tb_l = Σ_{j≥l} b̄_j ρ_jl², ℓ̄²_l = Σ over channels of Tb_l
                    if DIAG:
                        Tb = _mix_t(tl.where(low, 1.0, 0.0).to(dt), RS, db, 2.0 * g_a, rows, cols, C, DIAG, PREC)
                    else:
                        R = tl.load(RS + pCC)
                        Tb = tl.dot(tl.trans(R * R), db, input_precision=PREC)
                    dell2 += tl.sum(Tb, axis=1)
                    rs += 2.0 * db * b_a
                    cs += 2.0 * ell2c[:, None] * Tb
                    dG_a = dgam * gam_a + rs - cs
                    if DIAG:
                        dG_a += tl.load(_cols(DGS, rows, od, BD)) + tl.load(DG + pk, mask=mk, other=0.0).to(dt)
                        dla = tl.sum(dG_a, axis=0)[None, :] - tl.cumsum(dG_a, axis=0) + dG_a
                        tl.store(GLA + pk, dla.to(GLA.dtype.element_ty), mask=mk)
                    else:
                        dGsum += tl.sum(dG_a, axis=1)
                    tl.store(GK + pk, dk.to(GK.dtype.element_ty), mask=mk)
                if not DIAG:
                    dGsum += tl.load(DG + tok * H + i_h, mask=valid, other=0.0).to(dt)
                    dla = tl.sum(dGsum, axis=0) - tl.cumsum(dGsum, axis=0) + dGsum
                    tl.store(GLA + tok * H + i_h, dla.to(GLA.dtype.element_ty), mask=valid)
                dr2 = tl.sum(tl.where(eye, tl.load(SBS + pCC), 0.0), axis=1)
                tl.store(GR2 + tok * H + i_h, dr2.to(GR2.dtype.element_ty), mask=valid)
                tl.store(GELL2 + tok * H + i_h, dell2.to(GELL2.dtype.element_ty), mask=valid)
            tl.debug_barrier()
    # the adjoint of P_s, symmetrised
    Gf = GB + (n_chunks % 2) * BD * BD
    for a in range(0, BD, BK):
        od = a + offs_k
        for bb in range(0, BD, BK):
            ob = bb + offs_k
            blk = 0.5 * (tl.load(_blk(Gf, od, ob, BD)) + tl.trans(tl.load(_blk(Gf, ob, od, BD))))
            tl.store(DPST + prog * D * D + od[:, None] * D + ob[None, :], blk.to(DPST.dtype.element_ty),
                     mask=(od[:, None] < D) & (ob[None, :] < D))
    tl.store(FAIL + prog, fail)


ADJOINT_NAMES = ("w", "beta", "linv", "variance", "kw", "vu", "g")  # as scan_backward.GRAD_NAMES


def chunk_state_scratch(lay: sc.ScanLayout, Hf: int, D: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The per-chunk start states of every segment's replay, ``[S, H', n_s, BD, BD]`` (``BD`` = D padded)."""
    BD = max(16, next_pow2(D))
    return torch.empty(lay.n_segments, Hf, lay.n_s, BD, BD, dtype=dtype, device=device)


def segment_adjoint_tiles(D: int, MV: int, C: int) -> dict:
    """The launch constants of :func:`scan_segment_adjoint_kernel` for key dim D, value dim MV, chunk C:
    ``BD``, ``BM`` (D, MV padded to a power of two ≥ 16), ``BK``, ``BV`` (the key and value column blocks),
    ``num_warps`` (8 from C = 32: compiled for sm_90 at C = 32, D = 64, B2/B4 spill 0–160 bytes per thread with
    8 warps, 48–640 with 4).  One place for the wrapper and the compile check (``benchmarks/gpu.py
    --compile-only``)."""
    for name, x in (("D", D), ("MV", MV), ("C", C)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be a positive int, got {x!r}")
    return dict(BD=max(16, next_pow2(D)), BM=max(16, next_pow2(MV)), BK=16, BV=16, num_warps=8 if C >= 32 else 4)


def segment_adjoint_triton(lay: sc.ScanLayout, q, k, v, r2, ell2, log_alpha, adjoints: dict,
                           P_starts: torch.Tensor, P_end_bar: torch.Tensor, *, inputs: bool,
                           chunk_states: torch.Tensor | None = None, replay: bool = True, prep=None):
    """B2 (``inputs=False``) or B4 (``inputs=True``) as one launch of :func:`scan_segment_adjoint_kernel`.

    Packed inputs as the forward's (q, k ``[NT, H', D]``, v ``[NT, H', m]``, r2, ell2 ``[NT, H']``, log_alpha
    ``[NT, H', Da]``, Da = 1 scalar, D diagonal); ``adjoints``: the output adjoints keyed by :data:`ADJOINT_NAMES`
    (packed like the outputs: w, kw ``[NT, H', D]``, beta, variance ``[NT, H']``, linv ``[NT, H', C]``, vu
    ``[NT, H', m]``, g ``[NT, H', Da]``), None or missing for zero (a missing variance adjoint skips the
    variance's terms); ``P_starts``, ``P_end_bar`` ``[S, H', D, D]``.  Returns ``(dP_start [S, H', D, D], grads,
    failed [S, H'])``: the symmetrised adjoint of every segment's start state, and with ``inputs`` a dict of
    packed gradients (``q, k, v, r2, ell2, la``; ``la`` ``[NT, H', Da]``), else None.  ``chunk_states``
    (:func:`chunk_state_scratch`): where the replay keeps each chunk's start P (allocated here when None);
    ``replay=False`` skips the replay and reads them from ``chunk_states`` as an earlier call from the same
    ``P_starts`` wrote them (B4 after B2).  ``prep``: with diagonal decay, the prep kernel's buffers for ``lay``
    in k's dtype (:func:`bayeslayer.ops.bayesian_layer.scan_triton.prep_triton`; computed here when None) — the kernel
    reads the per-channel g, b and the base of S from them instead of forming them in its serial chunk loop.
    Twin: :func:`bayeslayer.ops.bayesian_layer.scan_backward.segment_adjoint`.  Arithmetic in k's dtype.
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
    want_var = adjoints.get("variance") is not None
    adj = {}
    for name in ADJOINT_NAMES:
        x = adjoints.get(name)
        if x is None:
            x = torch.zeros(shapes[name], dtype=dt, device=dev) if name != "variance" else r2
        check_shaped(f"adjoints[{name!r}]", x, shapes[name], dt)
        adj[name] = x.contiguous()
    tiles = segment_adjoint_tiles(D, MV, C)
    BD = tiles["BD"]
    dP_start = torch.zeros(S, Hf, D, D, dtype=dt, device=dev)
    fail = torch.zeros(S, Hf, dtype=torch.int32, device=dev)
    grads = None
    if inputs:
        grads = dict(q=torch.zeros_like(q), k=torch.zeros_like(k), v=torch.zeros_like(v), r2=torch.zeros_like(r2),
                     ell2=torch.zeros_like(ell2), la=torch.zeros(NT, Hf, Da, dtype=dt, device=dev))
    if NT == 0:
        return sym(P_end_bar), grads, fail != 0
    if diag:
        if prep is None:
            prep = prep_triton(lay, q, k, r2, ell2, log_alpha, dtype=dt, want_var=False)
        if not isinstance(prep, Prep) or prep.base.dtype != dt or prep.g.shape[-1] != D \
                or prep.seg_first.numel() != S:
            raise ValueError(f"prep must be prep_triton's buffers for this layout in {dt} with diagonal decay")
        pg, pb, pbase, first = prep.g, prep.b, prep.base, prep.seg_first
    else:
        pg = pb = pbase = k  # not read with scalar decay
        first = lay.seq_first_seg
    cu_seg = segment_offsets(lay, NT)
    if chunk_states is None:
        if not replay:
            raise ValueError("replay=False needs the chunk_states of an earlier replay")
        chunk_states = chunk_state_scratch(lay, Hf, D, dt, dev)
    check_shaped("chunk_states", chunk_states, (S, Hf, lay.n_s, BD, BD), dt)
    ws = torch.empty(S, Hf, 5 * C * BD + 2 * BD * BD + 3 * C * C, dtype=dt, device=dev)
    ldl = torch.empty(S, Hf, 2 * C * C + C, dtype=dt, device=dev)
    g = grads if inputs else dict(q=dP_start, k=dP_start, v=dP_start, r2=dP_start, ell2=dP_start, la=dP_start)
    scan_segment_adjoint_kernel[(S, Hf)](
        q.contiguous(), k.contiguous(), v.contiguous(), r2.contiguous(), ell2.contiguous(),
        log_alpha.contiguous(), pg, pb, pbase, first, adj["w"], adj["beta"], adj["linv"], adj["variance"],
        adj["kw"], adj["vu"], adj["g"], cu_seg, P_starts.contiguous(), P_end_bar.contiguous(), chunk_states, ws, ldl,
        dP_start, fail, g["q"], g["k"], g["v"], g["r2"], g["ell2"], g["la"],
        H=Hf, D=D, MV=MV, C=C, NS=lay.n_s, DIAG=diag, VAR=want_var, INPUTS=inputs, REPLAY=replay, PREC="ieee",
        **tiles,
    )
    return dP_start, grads, fail != 0


# ---------------------------------------------------------------------------------------------------
# the whole covariance-pass backward: B2, Phase A's elements, B3, B4
# ---------------------------------------------------------------------------------------------------

def covariance_scan_backward_triton(q, k, v, r2, ell2, log_alpha, P0, cu: list[int], C: int, *, segment_chunks: int,
                                    P_starts: torch.Tensor, dw=None, dbeta=None, dlinv=None, dvariance=None, dkw=None,
                                    dvu=None, dg=None, dP=None, elements=None):
    """Gradients of :func:`bayeslayer.ops.bayesian_layer.scan.covariance_scan`'s inputs on Triton (scalar or diagonal
    decay).

    Arguments as :func:`bayeslayer.ops.bayesian_layer.scan_backward.covariance_scan_backward` (packed ``[NT, H', ...]``
    inputs, ``P0 [N, H', D, D]``, the forward's checkpoints ``P_starts [S, H', D, D]``, output adjoints
    None for zero, ``elements = (A, C, J)`` of ``lay.element_segments`` if the forward kept them).
    Launches, whatever T: B2 (:func:`segment_adjoint_triton`), Phase A's elements when not given
    (:func:`bayeslayer.ops.bayesian_layer.scan_triton.phase_a_triton`, two kernels, float64), B3
    (:func:`reverse_segments_triton`, float64), B4; no host loop over chunks or segments, no host sync.
    Returns ``(ScanGrads, failed [N, H'])``: a factorisation that was not positive definite sets its
    sequence's device-side flag (never checked here).
    """
    from . import scan_backward as sbw

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
    prep = None
    if log_alpha.shape[-1] > 1 and NT > 0:  # diagonal decay: the per-channel P-free terms, once for B2 and B4
        prep = prep_triton(lay, q, k, r2, ell2, log_alpha, dtype=k.dtype, want_var=False)
    G, _, f2 = segment_adjoint_triton(lay, q, k, v, r2, ell2, log_alpha, adj, P_starts, end_bar, inputs=False,
                                      chunk_states=states, prep=prep)
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
                                              chunk_states=states, replay=False, prep=prep)
    failed = f3.clone()
    sc.mark_failed(failed, lay.seg_seq, f2 | f4)
    sc.mark_failed(failed, lay.seg_seq[segs], f_a)
    grads = sbw.ScanGrads(q=gr["q"], k=gr["k"], v=gr["v"], r2=gr["r2"], ell2=gr["ell2"], log_alpha=gr["la"],
                          P0=dP_start[lay.seq_first_seg])
    return grads, failed
