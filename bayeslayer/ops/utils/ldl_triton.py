"""Blocked LDLᵀ of a small symmetric positive-definite matrix, in 16×16 tiles (Triton).

:func:`ldl_blocked` factors ``X = L diag(d) Lᵀ`` in place and builds ``L⁻¹`` alongside, for the
per-chunk ``C×C`` matrix ``S`` of the covariance pass (docs/theory.md §6.7) and for
the ``D×D`` factorisations of Phase B.  It replaces the C-step elimination over a whole ``C×C``
register tile: only the ``BLK×BLK`` diagonal blocks are eliminated row by row (``BLK`` = 16
dependent steps each); the panel below a diagonal block and the trailing Schur complement are
``tl.dot`` products of 16×16 tiles, and ``L⁻¹`` is assembled block-row by block-row
(``(L⁻¹)_ij = −(L⁻¹)_ii Σ_{j≤k<i} L_ik (L⁻¹)_kj``), also with ``tl.dot``::

    for each diagonal block k:
        eliminate X_kk in registers: unit lower L_kk, pivots d_k (clamped), L_kk⁻¹
        panel      L_ik = X_ik L_kk⁻ᵀ D_k⁻¹                    i > k    (tl.dot)
        Schur      X_ij −= (L_ik D_k) L_jkᵀ                     k < j ≤ i (tl.dot)
    L⁻¹ by block rows                                                     (tl.dot)

Pivots are clamped from below: ``d_j = max(raw_j, floor_j)`` with the floors given in ``DV`` on
entry (the chunk step passes ``r²``: the innovation variance is never below the observation
noise, so in exact arithmetic the clamp is a no-op, and in floating point it keeps β ≤ 1/r²).
A raw pivot that is not positive or not finite counts as a failure (returned, so that the
caller can set its device-side flag): the factorisation is then meaningless and the forward
raises once, after the whole pass.  The clamped elimination is the exact ``LDLᵀ`` of
``X + diag(δ)`` (δ ≥ 0 the clamp's additions), the same whether blocked or not; its plain
PyTorch twin is :func:`bayeslayer.ops.bayesian_layer.scan.ldl_clamped`.

Layout: ``X``, ``LI`` row-major ``[BN, BN]`` (``BN = NB·BLK``) in global scratch of the calling
program, ``DV`` ``[BN]``.  Only the lower blocks of ``X`` are read (the diagonal blocks are
symmetrised from their lower triangle); on exit the lower blocks of ``X`` hold ``L`` (unit
diagonal, zeros above it inside diagonal blocks; upper blocks untouched), ``LI`` holds ``L⁻¹``
in full (upper blocks zero) and ``DV`` the clamped pivots.  The caller puts a barrier
(``tl.debug_barrier``) between writing ``X``/``DV`` and calling this, and between this and
reading the results; inside, every stage ends with one.
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 16  # tile of the blocked factorisation: the smallest tl.dot shape


@triton.jit
def ldl_blocked(X, LI, DV, NB: tl.constexpr, BLK: tl.constexpr, PREC: tl.constexpr):
    """Factor ``X`` in place (see the module docstring).  Returns the number of failed pivots (int32)."""
    BN: tl.constexpr = NB * BLK
    r = tl.arange(0, BLK)
    eye = r[:, None] == r[None, :]
    low = r[:, None] >= r[None, :]
    dt = X.dtype.element_ty
    fail = tl.sum(tl.zeros([BLK], dtype=tl.int32), axis=0)
    for kb in range(NB):
        o = kb * BLK
        blk = X + (o + r[:, None]) * BN + (o + r[None, :])
        A = tl.load(blk)
        A = tl.where(low, A, tl.trans(A))
        fl = tl.load(DV + o + r)
        Lk = tl.where(eye, 1.0, 0.0).to(dt)
        Li = tl.where(eye, 1.0, 0.0).to(dt)
        d = tl.zeros([BLK], dtype=dt)
        for j in range(BLK):
            colj = tl.sum(tl.where(r[None, :] == j, A, 0.0), axis=1)
            raw = tl.sum(tl.where(r == j, colj, 0.0), axis=0)
            fj = tl.sum(tl.where(r == j, fl, 0.0), axis=0)
            fail += ((raw <= 0.0) | (raw != raw)).to(tl.int32)
            djj = tl.maximum(raw, fj)
            lj = tl.where(r > j, colj / djj, 0.0)
            rowj = tl.sum(tl.where(r[:, None] == j, A, 0.0), axis=0)
            A = A - lj[:, None] * rowj[None, :]
            Li = Li - lj[:, None] * tl.sum(tl.where(r[:, None] == j, Li, 0.0), axis=0)[None, :]
            Lk = Lk + tl.where(r[None, :] == j, lj[:, None], 0.0)
            d = tl.where(r == j, djj, d)
        tl.store(blk, Lk)
        tl.store(LI + (o + r[:, None]) * BN + (o + r[None, :]), Li)
        tl.store(DV + o + r, d)
        for jb in range(kb + 1, NB):  # the upper blocks of L⁻¹ are zero
            tl.store(LI + (o + r[:, None]) * BN + (jb * BLK + r[None, :]), tl.zeros([BLK, BLK], dtype=dt))
        tl.debug_barrier()
        # panel: L_ik = X_ik L_kk⁻ᵀ D_k⁻¹
        for ib in range(kb + 1, NB):
            p = X + (ib * BLK + r[:, None]) * BN + (o + r[None, :])
            Wik = tl.dot(tl.load(p), tl.trans(Li), input_precision=PREC)
            tl.store(p, Wik / d[None, :])
        tl.debug_barrier()
        # trailing Schur complement, lower blocks only: X_ij −= (L_ik D_k) L_jkᵀ
        for ib in range(kb + 1, NB):
            Wi = tl.load(X + (ib * BLK + r[:, None]) * BN + (o + r[None, :])) * d[None, :]
            for jb in range(kb + 1, ib + 1):
                Lj = tl.load(X + (jb * BLK + r[:, None]) * BN + (o + r[None, :]))
                p = X + (ib * BLK + r[:, None]) * BN + (jb * BLK + r[None, :])
                tl.store(p, tl.load(p) - tl.dot(Wi, tl.trans(Lj), input_precision=PREC))
        tl.debug_barrier()
    # L⁻¹ below the diagonal blocks, one block row at a time (row ib needs rows < ib)
    for ib in range(1, NB):
        Lii = tl.load(LI + (ib * BLK + r[:, None]) * BN + (ib * BLK + r[None, :]))
        for jb in range(0, ib):
            acc = tl.zeros([BLK, BLK], dtype=dt)
            for kk in range(jb, ib):
                Lik = tl.load(X + (ib * BLK + r[:, None]) * BN + (kk * BLK + r[None, :]))
                Ikj = tl.load(LI + (kk * BLK + r[:, None]) * BN + (jb * BLK + r[None, :]))
                acc += tl.dot(Lik, Ikj, input_precision=PREC)
            tl.store(LI + (ib * BLK + r[:, None]) * BN + (jb * BLK + r[None, :]),
                     -tl.dot(Lii, acc, input_precision=PREC))
        tl.debug_barrier()
    return fail


@triton.jit
def ldl_kernel(S, FLOOR, X, LI, DV, FAIL, N: tl.constexpr, NB: tl.constexpr, BLK: tl.constexpr,
               PREC: tl.constexpr):
    """One program per matrix: ``S [n, N, N]`` (symmetric; padded to ``BN = NB·BLK`` with identity),
    floors ``FLOOR [n, N]`` -> ``X``'s lower blocks ``L``, ``LI = L⁻¹``, ``DV = d`` (each ``[n, BN(, BN)]``),
    ``FAIL [n]`` the failed pivots.  The test harness of :func:`ldl_blocked` (tests/ops/test_scan_ldl.py)."""
    i = tl.program_id(0).to(tl.int64)
    BN: tl.constexpr = NB * BLK
    r = tl.arange(0, BN)
    m = (r[:, None] < N) & (r[None, :] < N)
    s = tl.load(S + i * N * N + r[:, None] * N + r[None, :], mask=m, other=0.0)
    s = tl.where((r[:, None] == r[None, :]) & (r[:, None] >= N), 1.0, s)
    Xb = X + i * BN * BN
    tl.store(Xb + r[:, None] * BN + r[None, :], s)
    tl.store(DV + i * BN + r, tl.load(FLOOR + i * N + r, mask=r < N, other=1.0))
    tl.debug_barrier()
    fail = ldl_blocked(Xb, LI + i * BN * BN, DV + i * BN, NB, BLK, PREC)
    tl.store(FAIL + i, fail)
