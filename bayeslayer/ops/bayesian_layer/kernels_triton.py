"""Triton kernels of the chunked Bayesian Layer (docs/theory.md §5, §6) and its decode step.

The chunked forward is two kernels, each chunk-sequential inside a program:
:func:`bl_chunk_cov_kernel` (one program per (sequence, head); the covariance
pass, writing the write keys ``w = β u`` and the final ``P``) and
:func:`bl_chunk_mean_kernel` (one program per (value block, sequence, head); the
WY/UT mean pass, writing the outputs and the final ``M``).  The state never
leaves its program between chunks (it lives in the output state buffers, which
double as the working state).  Per chunk of ``C`` tokens,
with ``g`` the cumulative log-decay inside the chunk (a ``[C]`` vector for scalar
decay, a ``[C, D]`` tile for diagonal decay), ``γ = exp(g)``, ``ρ_ij = exp(g_i − g_j)``
(``i ≥ j``) and ``b_j = Σ_{l≤j} ℓ_l² ρ_jl²`` the process noise accrued in the chunk::

    Y   = (γ ⊙ K) P_0                                   D×D products, tiled BK×BK
    S   = Y (γ ⊙ K)ᵀ + sym(N) + diag(r²),  N_ij = k_iᵀ ρ_ij b_j k_j   (i ≥ j)
    S   = L diag(d) Lᵀ   (blocked in 16×16 tiles, ldl.py; pivots ≥ r²; β = 1/d, L⁻¹ alongside)
    U   = γ ⊙ (L⁻¹ Y) + (L⁻¹ ⊙ ρ ⊙ b) K                 write keys w = β ⊙ U
    P_C = γ_C² P_0 + b_C I − Ueᵀ diag(β) Ue,  Ue_i = (γ_C/γ_i) u_i
    E   = (I + T)⁻¹ (V − (γ ⊙ K) M_0) = L⁻¹ (V − (γ ⊙ K) M_0),  T_ij = k_iᵀ ρ_ij w_j  (i > j)
    O   = (γ ⊙ Q) M_0 + A E,              A_ti = q_tᵀ ρ_ti w_i  (i ≤ t)
    M_C = γ_C M_0 + ((γ_C/γ) ⊙ W)ᵀ E

The segment scan (``scan.py``) first runs :func:`bl_chunk_prep_kernel`, one program per (chunk,
head): it forms the P-free terms (``g``, ``b``, ``sym(N) + diag(r²)``, ``qᵀBq``) that the covariance
kernel, launched with ``PREP``, then reads instead of forming them in its serial chunk loop.

For diagonal decay every ``ρ`` product is per channel; those C×C contractions
are done as a loop over the ``C`` columns on register tiles (exact, no ``Γ⁻¹`` is
ever formed, but not tensor-core shaped); scalar decay uses ``tl.dot`` throughout.
All arithmetic runs in the dtype of the state buffers (fp32, or fp64 for fp64
inputs); products use IEEE fp32 (no TF32: the covariance pass is a Kalman filter
and TF32's 10-bit mantissa visibly perturbs ``β``).

Padding (the tail of a sequence, or ``D``/``m`` up to a power of two) is an exact
no-op by the choice of the masked-load fill values: ``k = q = v = 0``,
``log α = 0``, ``ℓ² = 0``, ``r² = 1``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..utils.ldl_triton import ldl_blocked


@triton.jit
def row_of(x, rows, j):
    """Row ``j`` of a register tile ``x [C, N]`` -> ``[N]``."""
    return tl.sum(tl.where(rows[:, None] == j, x, 0.0), axis=0)


@triton.jit
def col_of(x, cols, j):
    """Column ``j`` of a register tile ``x [C, C]`` -> ``[C]``."""
    return tl.sum(tl.where(cols[None, :] == j, x, 0.0), axis=1)


@triton.jit
def decay_scores(a, x, g, rows, cols, C: tl.constexpr):
    """``[i, j] = Σ_d a_id exp(g_id − g_jd) x_jd`` for ``i ≥ j``, else 0 (per-channel decay).

    a, x, g: ``[C, BK]`` register tiles.  A loop over the C columns keeps every
    exponent ≤ 0 where it is used, so nothing overflows however strong the decay.
    """
    out = tl.zeros([C, C], dtype=a.dtype)
    for j in range(C):
        xj = row_of(x, rows, j)
        gj = row_of(g, rows, j)
        colj = tl.sum(a * tl.exp(tl.minimum(g - gj[None, :], 0.0)) * xj[None, :], axis=1)
        colj = tl.where(rows >= j, colj, 0.0)
        out = tl.where(cols[None, :] == j, colj[:, None], out)
    return out


@triton.jit
def decay_mix(L, x, g, rows, cols, C: tl.constexpr):
    """``out_i = Σ_{j≤i} L_ij exp(g_i − g_j) ⊙ x_j`` (per channel); L ``[C, C]``, x, g ``[C, BK]``."""
    out = tl.zeros(x.shape, dtype=x.dtype)
    for j in range(C):
        xj = row_of(x, rows, j)
        gj = row_of(g, rows, j)
        lj = tl.where(rows >= j, col_of(L, cols, j), 0.0)
        out += lj[:, None] * tl.exp(tl.minimum(g - gj[None, :], 0.0)) * xj[None, :]
    return out


@triton.jit
def _decay_noise(ell2, g, rows, C: tl.constexpr):
    """``b_jd = Σ_{l≤j} ℓ_l² exp(2(g_jd − g_ld))`` -> ``[C, BK]`` (diagonal decay)."""
    b = tl.zeros(g.shape, dtype=g.dtype)
    for l in range(C):  # noqa: E741 - l is the elimination's summation index
        gl = row_of(g, rows, l)
        el = tl.sum(tl.where(rows == l, ell2, 0.0), axis=0)
        b += tl.where(rows[:, None] >= l, el * tl.exp(2.0 * tl.minimum(g - gl[None, :], 0.0)), 0.0)
    return b


@triton.jit
def tile_at(tok, valid, od, i_h, H: tl.constexpr, D: tl.constexpr):
    """Offsets and mask of the ``[C, BK]`` tile ``x[tok, i_h, od]`` of a ``[NT, H, D]`` tensor ``x``: rows
    ``tok`` (real where ``valid``), columns ``od`` (real below ``D``)."""
    return (tok[:, None] * H + i_h) * D + od[None, :], valid[:, None] & (od[None, :] < D)


@triton.jit
def load_tile(x, tok, valid, od, i_h, H: tl.constexpr, D: tl.constexpr):
    """``x[tok, i_h, od]`` of a ``[NT, H, D]`` tensor as a ``[C, BK]`` tile, zero outside."""
    mask = valid[:, None] & (od[None, :] < D)
    return tl.load(x + (tok[:, None] * H + i_h) * D + od[None, :], mask=mask, other=0.0)


@triton.jit
def _load_g(la, tok, valid, offs_d, i_h, H: tl.constexpr, D: tl.constexpr):
    """Cumulative log-decay tile ``[C, BK]`` of the chunk (diagonal decay)."""
    p = la + (tok[:, None] * H + i_h) * D + offs_d[None, :]
    x = tl.load(p, mask=valid[:, None] & (offs_d[None, :] < D), other=0.0)
    return tl.cumsum(x, axis=0)


@triton.jit
def prep_tile(X, pc, rows, od, C: tl.constexpr, D: tl.constexpr, DT: tl.constexpr):
    """Columns ``od`` of chunk ``pc``'s ``[C, D]`` prep tile (``[NC·H, C, D]`` buffer) -> ``[C, BK]`` in ``DT``,
    0 outside."""
    return tl.load(X + (pc * C + rows[:, None]) * D + od[None, :], mask=od[None, :] < D, other=0.0).to(DT)


@triton.jit
def bl_chunk_prep_kernel(
    q, k, r2, ell2, la, chunk_bos, chunk_eos, PG, PB, PBASE, PQN,
    H: tl.constexpr,
    D: tl.constexpr,
    C: tl.constexpr,
    BD: tl.constexpr,
    BK: tl.constexpr,
    DIAG: tl.constexpr,
    RETURN_VAR: tl.constexpr,
    PREC: tl.constexpr,
):
    """Prep (docs/theory.md §6.7, F1): the P-free terms of one (chunk ``i_c``, head), parallel over chunks.

    What :func:`bl_chunk_cov_kernel` otherwise forms inside its serial chunk loop (its twin:
    ``ops/bayesian_layer/scan.py::prep_reference``, built on ``chunk_prep``)::

        g_i  = Σ_{t≤i} log α_t                        PG   [NC, H, C, Da]  (Da = D diagonal, else 1)
        b_j  = Σ_{l≤j} ℓ_l² ρ_jl²                      PB   [NC, H, C, Da]  (b_{C−1} = the chunk-end noise)
        base = sym(N) + diag(r²),  N_ij = k_iᵀ ρ_ij b_j k_j (i ≥ j)     PBASE [NC, H, C, C]  (S − K̃P₀K̃ᵀ)
        qᵀ B_i q_i = Σ_d b_id q_id²                     PQN  [NC, H, C]  (RETURN_VAR only)

    Chunk ``i_c`` is tokens ``chunk_bos[i_c] .. chunk_eos[i_c] − 1`` (at most C) of packed
    ``[NT, H, ·]`` inputs (q, k ``[NT, H, D]``, r2, ell2 ``[NT, H]``, la ``[NT, H, D]`` DIAG or ``[NT, H]``);
    rows past the chunk's end are the exact no-op padding (k = q = 0, log α = 0, ℓ² = 0, r² = 1), written
    too, so that row C − 1 of g and b is the chunk end.  Arithmetic in PBASE's dtype.  For diagonal decay
    ``b`` and ``N`` are the CUDA-core C×C loops (``_decay_noise``, ``decay_scores``): here they run once
    per chunk in parallel instead of inside the covariance kernel's serial chunk loop.
    """
    i_c = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    bos = tl.load(chunk_bos + i_c).to(tl.int64)
    eos = tl.load(chunk_eos + i_c).to(tl.int64)
    rows = tl.arange(0, C)
    cols = tl.arange(0, C)
    low = rows[:, None] >= cols[None, :]
    eye = rows[:, None] == cols[None, :]
    offs_k = tl.arange(0, BK)
    dt = PBASE.dtype.element_ty
    pc = i_c * H + i_h
    tok = bos + rows
    valid = tok < eos
    r2c = tl.load(r2 + tok * H + i_h, mask=valid, other=1.0).to(dt)
    l2c = tl.load(ell2 + tok * H + i_h, mask=valid, other=0.0).to(dt)
    qnoise = tl.zeros([C], dtype=dt)
    if DIAG:
        Nl = tl.zeros([C, C], dtype=dt)
        for kb in range(0, BD, BK):
            od = kb + offs_k
            md = valid[:, None] & (od[None, :] < D)
            k_o = load_tile(k, tok, valid, od, i_h, H, D).to(dt)
            g_o = tl.cumsum(tl.load(la + (tok[:, None] * H + i_h) * D + od[None, :], mask=md, other=0.0).to(dt),
                            axis=0)
            b_o = _decay_noise(l2c, g_o, rows, C)
            Nl += decay_scores(k_o, b_o * k_o, g_o, rows, cols, C)
            p_t = (pc * C + rows[:, None]) * D + od[None, :]
            tl.store(PG + p_t, g_o, mask=od[None, :] < D)
            tl.store(PB + p_t, b_o, mask=od[None, :] < D)
            if RETURN_VAR:
                q_o = load_tile(q, tok, valid, od, i_h, H, D).to(dt)
                qnoise += tl.sum(b_o * q_o * q_o, axis=1)
    else:
        lac = tl.load(la + tok * H + i_h, mask=valid, other=0.0).to(dt)
        g = tl.cumsum(lac, axis=0)
        ratio = tl.where(low, tl.exp(tl.minimum(g[:, None] - g[None, :], 0.0)), 0.0)
        b = tl.sum(ratio * ratio * l2c[None, :], axis=1)
        tl.store(PG + pc * C + rows, g)
        tl.store(PB + pc * C + rows, b)
        KK = tl.zeros([C, C], dtype=dt)
        for kb in range(0, BD, BK):
            od = kb + offs_k
            k_o = load_tile(k, tok, valid, od, i_h, H, D).to(dt)
            KK += tl.dot(k_o, tl.trans(k_o), input_precision=PREC)
            if RETURN_VAR:
                q_o = load_tile(q, tok, valid, od, i_h, H, D).to(dt)
                qnoise += b * tl.sum(q_o * q_o, axis=1)
        Nl = tl.where(low, KK * ratio * b[None, :], 0.0)
    base = Nl + tl.trans(Nl) - tl.where(eye, Nl, 0.0) + tl.where(eye, r2c[:, None], 0.0)
    tl.store(PBASE + (pc * C + rows[:, None]) * C + cols[None, :], base)
    if RETURN_VAR:
        tl.store(PQN + pc * C + rows, qnoise)


@triton.jit
def bl_chunk_cov_kernel(
    q, k, r2, ell2, la, cu_seqlens, P, W, LINV, Yscr, Uscr, VAR, LDLscr, FAIL,
    H: tl.constexpr,
    D: tl.constexpr,
    C: tl.constexpr,
    BD: tl.constexpr,
    BK: tl.constexpr,
    DIAG: tl.constexpr,
    HAS_ALPHA: tl.constexpr,
    RETURN_VAR: tl.constexpr,
    PREC: tl.constexpr,
    PG=None,
    PB=None,
    PBASE=None,
    PQN=None,
    chunk_first=None,
    PREP: tl.constexpr = False,
):
    """Covariance pass for one (sequence ``i_n``, head ``i_h``): write keys ``w_t = β_t u_t`` and ``P``.

    Layouts (contiguous): q, k, W ``[NT, H, D]``; LINV ``[NT, H, C]`` (row ``t`` of the chunk's
    ``L⁻¹`` at token ``t``; only rows of real tokens are written); r2, ell2, VAR ``[NT, H]``; la
    ``[NT, H, D]`` (DIAG) or ``[NT, H]``; P ``[N, H, D, D]`` holds ``P_0`` on entry and
    the final covariance on exit; Yscr, Uscr ``[N, H, C, BD]`` are per-program
    scratch (``Y`` and ``U`` of the current chunk).  LDLscr ``[N, H, 2C² + C]`` is the
    blocked LDLᵀ's scratch (``S``/``L``, ``L⁻¹``, pivots; :func:`..utils.ldl_triton.ldl_blocked`); FAIL ``[N, H]``
    int32 receives the number of pivots that were not positive (a device-side flag: 0 when all is well).

    With PREP, the P-free terms come from :func:`bl_chunk_prep_kernel` (run before, parallel over
    chunks) instead of being formed here: g, b from PG, PB, the base of S from PBASE, ``qᵀBq`` from PQN
    (RETURN_VAR), read in their own dtype and cast to P's (Phase A's float64 kernel reads the compute-dtype prep
    of Phase C: no T-sized float64 buffer), sequence ``i_n``'s chunk ``i_c`` being the prep's chunk
    ``chunk_first[i_n] + i_c``.  For
    diagonal decay that takes ``_decay_noise`` (twice) and ``decay_scores`` for ``N`` out of the serial
    loop; what stays are the P-dependent ``decay_mix`` and (with the variance) ``decay_scores`` of ``QU``.
    """
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    n_chunks = tl.cdiv(eos - bos, C)
    NBC: tl.constexpr = C // 16  # 16×16 blocks of the LDLᵀ (ldl.BLOCK)
    X_base = LDLscr + (i_n * H + i_h) * (2 * C * C + C)
    LI_base = X_base + C * C
    DV_base = LI_base + C * C
    fails = tl.sum(tl.zeros([C], dtype=tl.int32), axis=0)

    rows = tl.arange(0, C)
    cols = tl.arange(0, C)
    low = rows[:, None] >= cols[None, :]
    eye = rows[:, None] == cols[None, :]
    offs_k = tl.arange(0, BK)
    dt = P.dtype.element_ty

    P_base = P + (i_n * H + i_h) * D * D
    Y_base = Yscr + (i_n * H + i_h) * C * BD
    U_base = Uscr + (i_n * H + i_h) * C * BD

    if PREP:
        pc0 = tl.load(chunk_first + i_n).to(tl.int64)
    for i_c in range(n_chunks):
        if PREP:
            pc = (pc0 + i_c) * H + i_h  # this chunk's row of the prep buffers
        tok = bos + i_c * C + rows
        valid = tok < eos
        r2c = tl.load(r2 + tok * H + i_h, mask=valid, other=1.0).to(dt)
        l2c = tl.load(ell2 + tok * H + i_h, mask=valid, other=0.0).to(dt)
        if not DIAG:
            if PREP:
                g = tl.load(PG + pc * C + rows).to(dt)  # the prep may be in a narrower dtype (Phase A reads fp32)
                b = tl.load(PB + pc * C + rows).to(dt)  # [C]
                g_end = tl.sum(tl.where(rows == C - 1, g, 0.0), axis=0)  # padding rows keep g constant
                b_end = tl.sum(tl.where(rows == C - 1, b, 0.0), axis=0)
                ratio = tl.where(low, tl.exp(tl.minimum(g[:, None] - g[None, :], 0.0)), 0.0)
            else:
                if HAS_ALPHA:
                    lac = tl.load(la + tok * H + i_h, mask=valid, other=0.0).to(dt)
                else:
                    lac = tl.zeros([C], dtype=dt)
                g = tl.cumsum(lac, axis=0)
                g_end = tl.sum(lac, axis=0)
                ratio = tl.where(low, tl.exp(tl.minimum(g[:, None] - g[None, :], 0.0)), 0.0)
                b = tl.sum(ratio * ratio * l2c[None, :], axis=1)  # [C]
                b_end = tl.sum(tl.exp(2.0 * (g_end - g)) * l2c, axis=0)
            gam = tl.exp(g)
            endf = tl.exp(g_end - g)

        # ---- covariance pass: Y = K̃ P_0, S = Y K̃ᵀ + N, and q̃ᵀ P_0 q̃ for the variance ----
        S = tl.zeros([C, C], dtype=dt)
        KK = tl.zeros([C, C], dtype=dt)
        qPq = tl.zeros([C], dtype=dt)
        qnoise = tl.zeros([C], dtype=dt)
        for kb in range(0, BD, BK):
            od = kb + offs_k
            md = od < D
            k_o = load_tile(k, tok, valid, od, i_h, H, D).to(dt)
            if DIAG:
                if PREP:
                    g_o = prep_tile(PG, pc, rows, od, C, D, dt)
                else:
                    g_o = _load_g(la, tok, valid, od, i_h, H, D)
                kt_o = tl.exp(g_o) * k_o
            else:
                kt_o = gam[:, None] * k_o
            Yb = tl.zeros([C, BK], dtype=dt)
            if RETURN_VAR:
                q_o = load_tile(q, tok, valid, od, i_h, H, D).to(dt)
                Yq = tl.zeros([C, BK], dtype=dt)
            for kb2 in range(0, BD, BK):
                od2 = kb2 + offs_k
                md2 = od2 < D
                k_i = load_tile(k, tok, valid, od2, i_h, H, D).to(dt)
                P_blk = tl.load(P_base + od2[:, None] * D + od[None, :], mask=md2[:, None] & md[None, :],
                                other=0.0)
                if DIAG:
                    if PREP:
                        gam_i = tl.exp(prep_tile(PG, pc, rows, od2, C, D, dt))
                    else:
                        gam_i = tl.exp(_load_g(la, tok, valid, od2, i_h, H, D))
                else:
                    gam_i = gam[:, None]
                Yb += tl.dot(gam_i * k_i, P_blk, input_precision=PREC)
                if RETURN_VAR:
                    q_i = load_tile(q, tok, valid, od2, i_h, H, D).to(dt)
                    Yq += tl.dot(gam_i * q_i, P_blk, input_precision=PREC)
            S += tl.dot(Yb, tl.trans(kt_o), input_precision=PREC)
            tl.store(Y_base + rows[:, None] * BD + od[None, :], Yb)
            if not PREP:
                if DIAG:
                    b_o = _decay_noise(l2c, g_o, rows, C)
                    KK += decay_scores(k_o, b_o * k_o, g_o, rows, cols, C)
                else:
                    KK += tl.dot(k_o, tl.trans(k_o), input_precision=PREC)
            if RETURN_VAR:
                if DIAG:
                    qPq += tl.sum(Yq * tl.exp(g_o) * q_o, axis=1)
                    if not PREP:
                        qnoise += tl.sum(b_o * q_o * q_o, axis=1)
                else:
                    qPq += tl.sum(Yq * gam[:, None] * q_o, axis=1)
                    if not PREP:
                        qnoise += b * tl.sum(q_o * q_o, axis=1)
        if PREP:
            S = S + tl.load(PBASE + (pc * C + rows[:, None]) * C + cols[None, :]).to(dt)  # sym(N) + diag(r²)
            if RETURN_VAR:
                qnoise = tl.load(PQN + pc * C + rows).to(dt)
        else:
            if DIAG:
                Nl = KK  # already ρ- and b-weighted, lower incl. diagonal
            else:
                Nl = tl.where(low, KK * ratio * b[None, :], 0.0)
            S = S + Nl + tl.trans(Nl) - tl.where(eye, Nl, 0.0) + tl.where(eye, r2c[:, None], 0.0)
        S = 0.5 * (S + tl.trans(S))

        # ---- S = L diag(d) Lᵀ blocked in 16×16 tiles with tl.dot Schur updates, L⁻¹ alongside;
        # pivots clamped at r² (the innovation variance is never below the observation noise) ----
        tl.store(X_base + rows[:, None] * C + cols[None, :], S)
        tl.store(DV_base + rows, r2c)
        tl.debug_barrier()
        fails += ldl_blocked(X_base, LI_base, DV_base, NBC, 16, PREC)
        Linv = tl.load(LI_base + rows[:, None] * C + cols[None, :])
        beta = 1.0 / tl.load(DV_base + rows)
        # L is also the UT factor of the mean pass: I + T = L (T_ij = k_iᵀ ρ_ij w_j is Cov(y_i, e_j)/d_j)
        tl.store(LINV + (tok[:, None] * H + i_h) * C + cols[None, :], Linv.to(LINV.dtype.element_ty),
                 mask=valid[:, None])
        tl.debug_barrier()

        # ---- write keys U (and w = β U), and q_tᵀ ρ_ti u_i for the variance ----
        if not DIAG:
            Mix = Linv * ratio * b[None, :]
        QU = tl.zeros([C, C], dtype=dt)
        for kb in range(0, BD, BK):
            od = kb + offs_k
            md = od < D
            k_o = load_tile(k, tok, valid, od, i_h, H, D).to(dt)
            Yb = tl.load(Y_base + rows[:, None] * BD + od[None, :])
            if DIAG:
                if PREP:
                    g_o = prep_tile(PG, pc, rows, od, C, D, dt)
                    b_o = prep_tile(PB, pc, rows, od, C, D, dt)
                else:
                    g_o = _load_g(la, tok, valid, od, i_h, H, D)
                    b_o = _decay_noise(l2c, g_o, rows, C)
                Ub = tl.exp(g_o) * tl.dot(Linv, Yb, input_precision=PREC)
                Ub += decay_mix(Linv, b_o * k_o, g_o, rows, cols, C)
            else:
                Ub = gam[:, None] * tl.dot(Linv, Yb, input_precision=PREC)
                Ub += tl.dot(Mix, k_o, input_precision=PREC)
            tl.store(U_base + rows[:, None] * BD + od[None, :], Ub)
            tl.store(W + (tok[:, None] * H + i_h) * D + od[None, :], (beta[:, None] * Ub).to(W.dtype.element_ty),
                     mask=valid[:, None] & md[None, :])
            if RETURN_VAR:
                q_o = load_tile(q, tok, valid, od, i_h, H, D).to(dt)
                if DIAG:
                    QU += decay_scores(q_o, Ub, g_o, rows, cols, C)
                else:
                    QU += tl.dot(q_o, tl.trans(Ub), input_precision=PREC)
        if RETURN_VAR:
            if not DIAG:
                QU = tl.where(low, QU * ratio, 0.0)
            var = 1.0 + qPq + qnoise - tl.sum(QU * QU * beta[None, :], axis=1)
            tl.store(VAR + tok * H + i_h, var.to(VAR.dtype.element_ty), mask=valid)
        tl.debug_barrier()

        # ---- P_C = Φ_C P_0 Φ_Cᵀ + B_C − Ueᵀ diag(β) Ue (Y already holds everything P_0 was needed for) ----
        for kb in range(0, BD, BK):
            od = kb + offs_k
            md = od < D
            U1 = tl.load(U_base + rows[:, None] * BD + od[None, :])
            if DIAG:
                if PREP:
                    g1 = prep_tile(PG, pc, rows, od, C, D, dt)
                    b1_end = row_of(prep_tile(PB, pc, rows, od, C, D, dt), rows, C - 1)
                else:
                    g1 = _load_g(la, tok, valid, od, i_h, H, D)
                g1_end = row_of(g1, rows, C - 1)
                U1 = tl.exp(g1_end[None, :] - g1) * U1
                if not PREP:
                    b1_end = tl.sum(l2c[:, None] * tl.exp(2.0 * (g1_end[None, :] - g1)), axis=0)
            else:
                U1 = endf[:, None] * U1
            U1 = beta[:, None] * U1
            for kb2 in range(0, BD, BK):
                od2 = kb2 + offs_k
                md2 = od2 < D
                U2 = tl.load(U_base + rows[:, None] * BD + od2[None, :])
                p_P = P_base + od[:, None] * D + od2[None, :]
                m_P = md[:, None] & md2[None, :]
                P_blk = tl.load(p_P, mask=m_P, other=0.0)
                diag = od[:, None] == od2[None, :]
                if DIAG:
                    if PREP:
                        g2 = prep_tile(PG, pc, rows, od2, C, D, dt)
                    else:
                        g2 = _load_g(la, tok, valid, od2, i_h, H, D)
                    g2_end = row_of(g2, rows, C - 1)
                    U2 = tl.exp(g2_end[None, :] - g2) * U2
                    P_new = tl.exp(g1_end[:, None] + g2_end[None, :]) * P_blk
                    P_new += tl.where(diag, b1_end[:, None], 0.0)
                else:
                    U2 = endf[:, None] * U2
                    P_new = tl.exp(2.0 * g_end) * P_blk + tl.where(diag, b_end, 0.0)
                P_new -= tl.dot(tl.trans(U1), U2, input_precision=PREC)
                tl.store(p_P, P_new, mask=m_P)

        tl.debug_barrier()
    tl.store(FAIL + i_n * H + i_h, fails)


@triton.jit
def bl_chunk_mean_kernel(
    q, k, v, W, LINV, la, cu_seqlens, M, O,
    H: tl.constexpr,
    D: tl.constexpr,
    MV: tl.constexpr,
    C: tl.constexpr,
    BD: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DIAG: tl.constexpr,
    HAS_ALPHA: tl.constexpr,
    PREC: tl.constexpr,
):
    """Mean pass for value columns ``[i_v·BV, (i_v+1)·BV)`` of one (sequence, head): outputs and ``M``.

    A generalised delta rule with erase key ``k`` and write key ``w`` (from
    :func:`bl_chunk_cov_kernel`), in WY/UT form per chunk; the UT transform ``(I + T)⁻¹`` is the
    ``L⁻¹`` the covariance kernel stored in LINV (the same matrix: ``T_ij = k_iᵀ ρ_ij w_j`` is the
    strictly lower part of the unit factor of ``S = L diag(d) Lᵀ``), so no C×C elimination here.  Value blocks are
    independent, so they run as separate programs (the C×C work is repeated per
    block, as in flash-linear-attention's state pass).  v, O ``[NT, H, MV]``;
    M ``[N, H, D, MV]`` holds ``M_0`` on entry and the final mean on exit.
    """
    i_v = tl.program_id(0).to(tl.int64)
    i_n = tl.program_id(1).to(tl.int64)
    i_h = tl.program_id(2).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    n_chunks = tl.cdiv(eos - bos, C)
    rows = tl.arange(0, C)
    cols = tl.arange(0, C)
    low = rows[:, None] >= cols[None, :]
    offs_k = tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    mv = ov < MV
    dt = M.dtype.element_ty
    M_base = M + (i_n * H + i_h) * D * MV

    for i_c in range(n_chunks):
        tok = bos + i_c * C + rows
        valid = tok < eos
        if not DIAG:
            if HAS_ALPHA:
                lac = tl.load(la + tok * H + i_h, mask=valid, other=0.0).to(dt)
            else:
                lac = tl.zeros([C], dtype=dt)
            g = tl.cumsum(lac, axis=0)
            g_end = tl.sum(lac, axis=0)
            ratio = tl.where(low, tl.exp(tl.minimum(g[:, None] - g[None, :], 0.0)), 0.0)
            gam = tl.exp(g)
            endf = tl.exp(g_end - g)
        QW = tl.zeros([C, C], dtype=dt)
        for kb in range(0, BD, BK):
            od = kb + offs_k
            q_o = load_tile(q, tok, valid, od, i_h, H, D).to(dt)
            w_o = load_tile(W, tok, valid, od, i_h, H, D).to(dt)
            if DIAG:
                g_o = _load_g(la, tok, valid, od, i_h, H, D)
                QW += decay_scores(q_o, w_o, g_o, rows, cols, C)
            else:
                QW += tl.dot(q_o, tl.trans(w_o), input_precision=PREC)
        if DIAG:
            Aq = QW
        else:
            Aq = tl.where(low, QW * ratio, 0.0)
        # (I + T)⁻¹ = L⁻¹ of the covariance pass's LDLᵀ of the same chunk (padding rows load as 0:
        # their V − K̃M rows are 0, and no real row depends on a later one)
        Ainv = tl.load(LINV + (tok[:, None] * H + i_h) * C + cols[None, :], mask=valid[:, None], other=0.0).to(dt)

        v_c = tl.load(v + (tok[:, None] * H + i_h) * MV + ov[None, :], mask=valid[:, None] & mv[None, :],
                      other=0.0).to(dt)
        KM = tl.zeros([C, BV], dtype=dt)
        QM = tl.zeros([C, BV], dtype=dt)
        for kb in range(0, BD, BK):
            od = kb + offs_k
            md = od < D
            k_o = load_tile(k, tok, valid, od, i_h, H, D).to(dt)
            q_o = load_tile(q, tok, valid, od, i_h, H, D).to(dt)
            M_blk = tl.load(M_base + od[:, None] * MV + ov[None, :], mask=md[:, None] & mv[None, :], other=0.0)
            if DIAG:
                gam_o = tl.exp(_load_g(la, tok, valid, od, i_h, H, D))
            else:
                gam_o = gam[:, None]
            KM += tl.dot(gam_o * k_o, M_blk, input_precision=PREC)
            QM += tl.dot(gam_o * q_o, M_blk, input_precision=PREC)
        E = tl.dot(Ainv, v_c - KM, input_precision=PREC)
        o = QM + tl.dot(Aq, E, input_precision=PREC)
        tl.store(O + (tok[:, None] * H + i_h) * MV + ov[None, :], o.to(O.dtype.element_ty),
                 mask=valid[:, None] & mv[None, :])
        tl.debug_barrier()
        for kb in range(0, BD, BK):
            od = kb + offs_k
            md = od < D
            w_o = load_tile(W, tok, valid, od, i_h, H, D).to(dt)
            p_M = M_base + od[:, None] * MV + ov[None, :]
            m_M = md[:, None] & mv[None, :]
            M_blk = tl.load(p_M, mask=m_M, other=0.0)
            if DIAG:
                g_o = _load_g(la, tok, valid, od, i_h, H, D)
                g_end_o = row_of(g_o, rows, C - 1)
                w_o = tl.exp(g_end_o[None, :] - g_o) * w_o
                M_new = tl.exp(g_end_o)[:, None] * M_blk
            else:
                w_o = endf[:, None] * w_o
                M_new = tl.exp(g_end) * M_blk
            M_new += tl.dot(tl.trans(w_o), E, input_precision=PREC)
            tl.store(p_M, M_new, mask=m_M)
        tl.debug_barrier()


@triton.jit
def bl_step_kernel(
    q, k, v, r2, ell2, la, P_in, M_in, P_out, M_out, Uscr, O, VAR,
    H: tl.constexpr, D: tl.constexpr, MV: tl.constexpr,
    BD: tl.constexpr, BK: tl.constexpr, BMV: tl.constexpr, BV: tl.constexpr,
    DIAG: tl.constexpr, HAS_ALPHA: tl.constexpr,
):
    """q, k ``[B, H, D]``; v, O ``[B, H, MV]``; r2, ell2, VAR ``[B, H]``; la ``[B, H, D or 1]``;
    P ``[B, H, D, D]``; M ``[B, H, D, MV]``; Uscr ``[B, H, BD]`` (scratch for u)."""
    i_bh = tl.program_id(0).to(tl.int64)
    dt = P_out.dtype.element_ty
    offs = tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    Pi = P_in + i_bh * D * D
    Po = P_out + i_bh * D * D
    Mi = M_in + i_bh * D * MV
    Mo = M_out + i_bh * D * MV
    U = Uscr + i_bh * BD
    r2b = tl.load(r2 + i_bh).to(dt)
    l2b = tl.load(ell2 + i_bh).to(dt)
    if HAS_ALPHA and not DIAG:
        a_s = tl.exp(tl.load(la + i_bh).to(dt))

    # u = P̄ k, one BK-row block at a time; kᵀ u accumulates alongside
    ku = tl.sum(tl.zeros([BK], dtype=dt), axis=0)
    for rb in range(0, BD, BK):
        r_o = rb + offs
        mr = r_o < D
        if DIAG:
            a_r = tl.exp(tl.load(la + i_bh * D + r_o, mask=mr, other=0.0).to(dt))
        u_r = tl.zeros([BK], dtype=dt)
        for cb in range(0, BD, BK):
            c_o = cb + offs
            mc = c_o < D
            P_blk = tl.load(Pi + r_o[:, None] * D + c_o[None, :], mask=mr[:, None] & mc[None, :], other=0.0)
            if DIAG:
                a_c = tl.exp(tl.load(la + i_bh * D + c_o, mask=mc, other=0.0).to(dt))
                P_blk = a_r[:, None] * P_blk * a_c[None, :]
            elif HAS_ALPHA:
                P_blk = a_s * a_s * P_blk
            P_blk += tl.where(r_o[:, None] == c_o[None, :], l2b, 0.0)
            k_c = tl.load(k + i_bh * D + c_o, mask=mc, other=0.0).to(dt)
            u_r += tl.sum(P_blk * k_c[None, :], axis=1)
        k_r = tl.load(k + i_bh * D + r_o, mask=mr, other=0.0).to(dt)
        ku += tl.sum(k_r * u_r, axis=0)
        tl.store(U + r_o, u_r)
    beta = 1.0 / (r2b + ku)
    tl.debug_barrier()

    # P = P̄ − β u uᵀ, and qᵀ P q for the variance
    qPq = tl.sum(tl.zeros([BK], dtype=dt), axis=0)
    for rb in range(0, BD, BK):
        r_o = rb + offs
        mr = r_o < D
        u_r = tl.load(U + r_o)
        q_r = tl.load(q + i_bh * D + r_o, mask=mr, other=0.0).to(dt)
        if DIAG:
            a_r = tl.exp(tl.load(la + i_bh * D + r_o, mask=mr, other=0.0).to(dt))
        for cb in range(0, BD, BK):
            c_o = cb + offs
            mc = c_o < D
            m_P = mr[:, None] & mc[None, :]
            P_blk = tl.load(Pi + r_o[:, None] * D + c_o[None, :], mask=m_P, other=0.0)
            if DIAG:
                a_c = tl.exp(tl.load(la + i_bh * D + c_o, mask=mc, other=0.0).to(dt))
                P_blk = a_r[:, None] * P_blk * a_c[None, :]
            elif HAS_ALPHA:
                P_blk = a_s * a_s * P_blk
            u_c = tl.load(U + c_o)
            P_blk += tl.where(r_o[:, None] == c_o[None, :], l2b, 0.0) - beta * u_r[:, None] * u_c[None, :]
            tl.store(Po + r_o[:, None] * D + c_o[None, :], P_blk, mask=m_P)
            q_c = tl.load(q + i_bh * D + c_o, mask=mc, other=0.0).to(dt)
            qPq += tl.sum(tl.sum(q_r[:, None] * P_blk * q_c[None, :], axis=1), axis=0)
    tl.store(VAR + i_bh, (1.0 + qPq).to(VAR.dtype.element_ty))

    # M = A M + β u eᵀ with e = v − (A M)ᵀ k; o = Mᵀ q
    for vb in range(0, BMV, BV):
        v_o = vb + offs_v
        mv = v_o < MV
        e = tl.load(v + i_bh * MV + v_o, mask=mv, other=0.0).to(dt)
        for rb in range(0, BD, BK):
            r_o = rb + offs
            mr = r_o < D
            M_blk = tl.load(Mi + r_o[:, None] * MV + v_o[None, :], mask=mr[:, None] & mv[None, :], other=0.0)
            k_r = tl.load(k + i_bh * D + r_o, mask=mr, other=0.0).to(dt)
            if DIAG:
                k_r = k_r * tl.exp(tl.load(la + i_bh * D + r_o, mask=mr, other=0.0).to(dt))
            elif HAS_ALPHA:
                k_r = k_r * a_s
            e -= tl.sum(M_blk * k_r[:, None], axis=0)
        o = tl.zeros([BV], dtype=dt)
        for rb in range(0, BD, BK):
            r_o = rb + offs
            mr = r_o < D
            m_M = mr[:, None] & mv[None, :]
            M_blk = tl.load(Mi + r_o[:, None] * MV + v_o[None, :], mask=m_M, other=0.0)
            if DIAG:
                M_blk = tl.exp(tl.load(la + i_bh * D + r_o, mask=mr, other=0.0).to(dt))[:, None] * M_blk
            elif HAS_ALPHA:
                M_blk = a_s * M_blk
            M_blk += beta * tl.load(U + r_o)[:, None] * e[None, :]
            tl.store(Mo + r_o[:, None] * MV + v_o[None, :], M_blk, mask=m_M)
            q_r = tl.load(q + i_bh * D + r_o, mask=mr, other=0.0).to(dt)
            o += tl.sum(M_blk * q_r[:, None], axis=0)
        tl.store(O + i_bh * MV + v_o, o.to(O.dtype.element_ty), mask=mv)
