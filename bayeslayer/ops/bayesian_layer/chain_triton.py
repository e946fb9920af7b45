"""The covariance chain on chip: one program per (sequence, head·group) for the whole sequence (docs/theory.md §5.2).

:func:`chain_forward_kernel` is shaped like flash-linear-attention's ``chunk_gated_delta_rule_fwd_h``: a program
loads its initial covariance ``P`` (``D×D``; float64 for float64 inputs and fp32 ones up to D = 64, fp32
otherwise: :func:`default_precision`) once, keeps it in registers while it walks every chunk of its sequence in
order, and writes only what the mean pass reads — nothing goes through global scratch inside the chunk loop and no
barrier is needed.  Per chunk of ``C`` tokens (``g`` the
chunk-local cumulative log-decay, ``γ = e^g``, ``ρ_ij = e^{g_i − g_j}`` for ``i ≥ j``, ``b_j = Σ_{l≤j} ℓ_l² ρ_jl²``
the process noise accrued in the chunk, ``K̃ = γ ⊙ K``)::

    Y  = K̃ P                                       S = Y K̃ᵀ + sym(N) + diag(r²),  N_ij = k_iᵀ ρ_ij b_j k_j (i ≥ j)
    S  = L diag(d) Lᵀ                              left-looking, blocked on BLK×BLK pivots (BLK = min(C, 32)):
                                                   each diagonal block eliminated in registers (pivots clamped
                                                   at r²; two per step at D ≤ 64, :func:`_ldl_block`), panels
                                                   and Schur updates by tl.dot; M = L⁻¹ by rows
    kw = M K̃,  U = γ ⊙ (kw P) + (M ⊙ ρ)(b ⊙ K),  vu = M V,  W = β ⊙ U (β = 1/d)           → HBM, once
    P ← sym(Φ_C P Φ_C + diag(b_C) − Ueᵀ diag(β) Ue),  Ue_i = Φ_CΦ_i⁻¹ u_i

(and, when asked, the predictive variance ``1 + q̃ᵀPq̃ + qᵀB q − Σ_{i≤t} β_i (q_tᵀΦ_tΦ_i⁻¹u_i)²``).  ``W``, ``kw``,
``vu`` and ``g`` are exactly what the mean pass on flash-linear-attention's gated-delta-rule kernels reads
(:mod:`.mean_pass_fla`, docs/theory.md §6.4), written in the dtype it is handed them in.
:func:`chain_backward_kernel` is its adjoint, walking the chunks in reverse with the adjoint of ``P`` on chip; it
reads what the forward kept of each chunk (``P`` at its start, the factors ``M`` and ``d``, and ``W``, ``kw`` where
they are in the working dtype) instead of forming it again.

Every ``C×·`` quantity is held as ``C/BLK`` row blocks and every ``C×C`` one as its lower ``BLK×BLK`` blocks
(Triton tuples, indexed at compile time), so that the factorisation needs no slicing of register tiles.  Every
product is a ``tl.dot`` in the precision ``PREC`` names (:func:`_dot`, :func:`_dotx`): ``"tf32x3"`` (three TF32
tensor-core products of the split operands, fp32 accumulation), ``"bf16x3"`` (the same with bf16 halves), or
``"ieee"`` (fp32 on CUDA cores; float64 work always runs it, on the float64 tensor cores of sm_80+).  The splits are
written out here rather than left to ``tl.dot``'s own ``input_precision`` so that Triton's interpreter, which
ignores that argument, computes exactly the rounded operands a GPU multiplies; an operand the high part holds
exactly (bf16 inputs) skips its low part's products.

Diagonal decay: every ``ρ`` becomes per channel.  Between two different blocks ``I > J`` the contraction
``Σ_d a_id e^{g_id − g_jd} x_jd`` is a ``tl.dot`` of ``a ⊙ e^{g_I − ĝ}`` and ``x ⊙ e^{ĝ − g_J}`` with ``ĝ`` the
cumulative decay at the end of block J (both exponents ≤ 0: no overflow for any decay, as in GLA's secondary
split); inside a block it is a loop over the block's tokens (every exponent ≤ 0).

Padding — the ragged tail of a sequence, and ``D``, ``m`` up to a power of two — is an exact no-op by the masked
load values ``k = q = v = 0``, ``log α = 0``, ``ℓ² = 0``, ``r² = 1``.  A pivot that is not positive or not finite
(the inputs are too extreme for the working precision) is counted into a device-side ``[N, H']`` flag and makes
the rest of its program's outputs NaN; nothing reads it on the host during the call (see :func:`chain_forward`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .kernels_triton import col_of, row_of
from .scan_backward import ScanGrads
from .triton_support import CHAIN_MAX_HEAD_DIM

# ---------------------------------------------------------------------------------------------------
# products and small helpers
# ---------------------------------------------------------------------------------------------------

@triton.jit
def _tf32(x):
    """``x`` rounded to TF32 (10-bit mantissa, round half away from zero), kept as fp32."""
    i = x.to(tl.int32, bitcast=True)
    return ((i + 0x1000) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, PREC: tl.constexpr, INTERP: tl.constexpr):
    """``a @ b`` with fp32 (or float64) accumulation, every product in the precision ``PREC`` names.

    ``"tf32x3"``: ``a = a_h + a_l`` and ``b = b_h + b_l`` split into TF32 parts, ``a_l b_h + a_h b_l + a_h b_h`` on
    TF32 tensor cores (the ``a_l b_l`` term is below fp32's rounding).  ``"bf16x3"``: the same with bf16 parts (bf16
    tensor cores; under the interpreter, whose bf16 ``tl.dot`` is not usable, the bf16 values multiply in fp32,
    exactly).  ``"ieee"``: one product in the operands' own precision.
    """
    if PREC == "tf32x3":
        ah = _tf32(a)
        bh = _tf32(b)
        al = _tf32(a - ah)
        bl = _tf32(b - bh)
        acc = tl.dot(al, bh, input_precision="tf32")
        acc = tl.dot(ah, bl, acc, input_precision="tf32")
        acc = tl.dot(ah, bh, acc, input_precision="tf32")
    elif PREC == "bf16x3":
        ah = a.to(tl.bfloat16)
        bh = b.to(tl.bfloat16)
        al = (a - ah.to(tl.float32)).to(tl.bfloat16)
        bl = (b - bh.to(tl.float32)).to(tl.bfloat16)
        if INTERP:
            acc = tl.dot(al.to(tl.float32), bh.to(tl.float32), input_precision="ieee")
            acc = tl.dot(ah.to(tl.float32), bl.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(ah.to(tl.float32), bh.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(al, bh, out_dtype=tl.float32)
            acc = tl.dot(ah, bl, acc, out_dtype=tl.float32)
            acc = tl.dot(ah, bh, acc, out_dtype=tl.float32)
    else:
        acc = tl.dot(a, b, input_precision=PREC)
    return acc


@triton.jit
def _split(x, PREC: tl.constexpr):
    """The high and low parts of ``x`` for a split-precision product (TF32 or bf16 parts)."""
    if PREC == "tf32x3":
        h = _tf32(x)
        lo = _tf32(x - h)
    else:
        h = x.to(tl.bfloat16)
        lo = (x - h.to(tl.float32)).to(tl.bfloat16)
    return h, lo


@triton.jit
def _mm(a, b, acc, PREC: tl.constexpr, INTERP: tl.constexpr):
    """One tensor-core product of split parts, accumulated in fp32."""
    if PREC == "tf32x3":
        acc = tl.dot(a, b, acc, input_precision="tf32")
    elif INTERP:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, out_dtype=tl.float32)
    return acc


@triton.jit
def _dotx(a, b, AX: tl.constexpr, BX: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr):
    """:func:`_dot` knowing that ``a`` (``AX``) or ``b`` (``BX``) holds values the high part represents exactly
    (bf16 inputs, or fp16 inputs with TF32 parts): their low part is zero, so its products are skipped — two
    products instead of three, one when both are exact."""
    if PREC == "ieee" or PREC == "tf32":
        acc = _dot(a, b, PREC, INTERP)
    elif AX and BX:
        ah, al = _split(a, PREC)
        bh, bl = _split(b, PREC)
        acc = _mm(ah, bh, tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32), PREC, INTERP)
    elif AX:
        ah, al = _split(a, PREC)
        bh, bl = _split(b, PREC)
        acc = _mm(ah, bl, tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32), PREC, INTERP)
        acc = _mm(ah, bh, acc, PREC, INTERP)
    elif BX:
        ah, al = _split(a, PREC)
        bh, bl = _split(b, PREC)
        acc = _mm(al, bh, tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32), PREC, INTERP)
        acc = _mm(ah, bh, acc, PREC, INTERP)
    else:
        acc = _dot(a, b, PREC, INTERP)
    return acc


@triton.jit
def _set(t, i: tl.constexpr, x):
    """The tuple ``t`` with element ``i`` replaced by ``x``."""
    out = ()
    for j in tl.static_range(len(t)):
        if j == i:
            out = out + (x,)
        else:
            out = out + (t[j],)
    return out


@triton.jit
def _row(x, j, r):
    """Row ``j`` of a ``[BLK, N]`` tile -> ``[N]``."""
    return row_of(x, r, j)


@triton.jit
def _colv(x, j, r):
    """Column ``j`` of a ``[BLK, BLK]`` tile -> ``[BLK]``."""
    return col_of(x, r, j)


@triton.jit
def _rs(f, DIAG: tl.constexpr):
    """A per-token decay factor shaped to scale ``[BLK, N]`` rows: ``[BLK]`` (scalar decay) or ``[BLK, N]``."""
    if DIAG:
        out = f
    else:
        out = f[:, None]
    return out


@triton.jit
def _lin(a1, x1, a2, x2):
    """Composition of ``b ↦ a1 b + x1`` then ``b ↦ a2 b + x2`` (for ``tl.associative_scan``)."""
    return a1 * a2, x1 * a2 + x2


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _add5(a0, a1, a2, a3, a4, b0, b1, b2, b3, b4):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4


@triton.jit
def _sum2(a0, a1, axis: tl.constexpr, INTERP: tl.constexpr):
    """``tl.sum`` of two tensors along ``axis``: one reduction compiled (one exchange between warps for both),
    separate sums in the interpreter (where a reduction by a combine function is slow).  Every sum here picks one
    element out of zeros, so both are exact and equal."""
    if INTERP:
        out = tl.sum(a0, axis=axis), tl.sum(a1, axis=axis)
    else:
        out = tl.reduce((a0, a1), axis, _add2)
    return out


@triton.jit
def _sum4(a0, a1, a2, a3, axis: tl.constexpr, INTERP: tl.constexpr):
    """:func:`_sum2` of four tensors."""
    if INTERP:
        out = tl.sum(a0, axis=axis), tl.sum(a1, axis=axis), tl.sum(a2, axis=axis), tl.sum(a3, axis=axis)
    else:
        out = tl.reduce((a0, a1, a2, a3), axis, _add4)
    return out


@triton.jit
def _sum5(a0, a1, a2, a3, a4, INTERP: tl.constexpr):
    """:func:`_sum2` of five vectors, to scalars."""
    if INTERP:
        out = tl.sum(a0, axis=0), tl.sum(a1, axis=0), tl.sum(a2, axis=0), tl.sum(a3, axis=0), tl.sum(a4, axis=0)
    else:
        out = tl.reduce((a0, a1, a2, a3, a4), 0, _add5)
    return out


@triton.jit
def _at(x, i, r):
    """``x`` masked to its element ``i`` (summed, it is that element)."""
    return tl.where(r == i, x, 0.0)


@triton.jit
def _ldl_block(A, floor, r, PAIRS: tl.constexpr, INTERP: tl.constexpr):
    """``A = L diag(d) Lᵀ`` of a diagonal block in registers (only its lower triangle is read), pivots clamped
    from below at ``floor``.  Returns ``(L unit lower, L⁻¹, d, failed pivots)``; a raw pivot ≤ 0 or NaN fails.

    One pivot per step reads a column of the trailing block, a reduction across warps (a tile's columns are spread
    over them) and a change of its layout for the row side of the update: about six barriers per pivot.  ``PAIRS``:
    two pivots per step.  The block is first mirrored from its lower triangle (the products that form it leave the
    upper one a rounding apart; :func:`_factor` then forms only the lower one), which makes it exactly symmetric,
    and every update keeps it so, computed the same way for an element and its mirror image: ``A −= (x ⊗ x) / d``.
    Its rows are then its columns, and a step reads the two columns in one reduction across warps and the same two
    as rows, with two rows of ``L⁻¹``, within each warp; it eliminates the 2×2 pivot block on scalars (one
    reciprocal per pivot) and updates the trailing block and ``L⁻¹`` by rank-2 products.  (Reading the rows of the
    block as formed, without the mirroring, pairs a column with a row a rounding apart: with bf16 inputs in the
    stress regime its errors were larger than the one-pivot step's on most draws, on some several times,
    ``benchmarks/chain_precision.py``.)  Above D = 64 the kernel runs at the register limit and, compiled with
    Triton 3.6, the pair's extra live vectors spill more than they save: one pivot per step there."""
    dt = A.dtype
    eye = r[:, None] == r[None, :]
    Lk = tl.where(eye, 1.0, 0.0).to(dt)
    Li = tl.where(eye, 1.0, 0.0).to(dt)
    d = tl.zeros(r.shape, dtype=dt)
    fail = tl.sum(tl.zeros(r.shape, dtype=tl.int32), axis=0)
    if PAIRS:
        A = tl.where(r[:, None] >= r[None, :], A, tl.trans(A))
        for jb in range(0, A.shape[0], 2):
            # columns jb, jb+1 (indexed by row), the same as rows (indexed by column), two rows of L⁻¹
            v0, v1 = _sum2(tl.where(r[None, :] == jb, A, 0.0), tl.where(r[None, :] == jb + 1, A, 0.0), 1, INTERP)
            h0, h1, q0, q1 = _sum4(tl.where(r[:, None] == jb, A, 0.0), tl.where(r[:, None] == jb + 1, A, 0.0),
                                   tl.where(r[:, None] == jb, Li, 0.0), tl.where(r[:, None] == jb + 1, Li, 0.0), 0,
                                   INTERP)
            s00, s10, s11, f0, f1 = _sum5(_at(v0, jb, r), _at(v0, jb + 1, r), _at(v1, jb + 1, r), _at(floor, jb, r),
                                          _at(floor, jb + 1, r), INTERP)
            fail += ((s00 <= 0.0) | (s00 != s00)).to(tl.int32)
            d0 = tl.maximum(s00, f0)
            i0 = 1.0 / d0
            l0 = v0 * i0
            c10 = s10 * i0
            raw = s11 - c10 * s10
            fail += ((raw <= 0.0) | (raw != raw)).to(tl.int32)
            d1 = tl.maximum(raw, f1)
            i1 = 1.0 / d1
            # column jb+1 after pivot jb, and the same as a row
            w1 = v1 - l0 * s10
            g1 = h1 - (h0 * i0) * s10
            l1 = w1 * i1
            A = A - (v0[:, None] * h0[None, :]) * i0 - (w1[:, None] * g1[None, :]) * i1
            l0 = tl.where(r > jb, l0, 0.0)
            l1 = tl.where(r > jb + 1, l1, 0.0)
            Li = Li - l0[:, None] * q0[None, :] - l1[:, None] * (q1 - c10 * q0)[None, :]
            Lk = Lk + tl.where(r[None, :] == jb, l0[:, None], 0.0) + tl.where(r[None, :] == jb + 1, l1[:, None], 0.0)
            d = tl.where(r == jb, d0, tl.where(r == jb + 1, d1, d))
    else:
        for j in range(A.shape[0]):
            colj = tl.sum(tl.where(r[None, :] == j, A, 0.0), axis=1)
            raw = tl.sum(tl.where(r == j, colj, 0.0), axis=0)
            fj = tl.sum(tl.where(r == j, floor, 0.0), axis=0)
            fail += ((raw <= 0.0) | (raw != raw)).to(tl.int32)
            djj = tl.maximum(raw, fj)
            lj = tl.where(r > j, colj / djj, 0.0)
            # the trailing block stays symmetric, so row j of it is column j
            A = A - lj[:, None] * colj[None, :]
            Li = Li - lj[:, None] * tl.sum(tl.where(r[:, None] == j, Li, 0.0), axis=0)[None, :]
            Lk = Lk + tl.where(r[None, :] == j, lj[:, None], 0.0)
            d = tl.where(r == j, djj, d)
    return Lk, Li, d, fail


# ---------------------------------------------------------------------------------------------------
# decay-weighted contractions between two token blocks I ≥ J (scalar or per-channel decay)
# ---------------------------------------------------------------------------------------------------

@triton.jit
def _ratio(gI, gJ, SAME: tl.constexpr, r):
    """Scalar decay: ``ρ_ij = e^{g_i − g_j}`` between blocks I ≥ J (``[BLK, BLK]``; zero above the diagonal when
    ``SAME``; every exponent ≤ 0)."""
    rho = tl.exp(tl.minimum(gI[:, None] - gJ[None, :], 0.0))
    if SAME:
        rho = tl.where(r[:, None] >= r[None, :], rho, 0.0)
    return rho


@triton.jit
def _scores(a, x, gI, gJ, glJ, SAME: tl.constexpr, DIAG: tl.constexpr, AX: tl.constexpr, XX: tl.constexpr,
            PREC: tl.constexpr, INTERP: tl.constexpr, r):
    """``[i, j] = Σ_d a_id ρ_ij,d x_jd`` for ``i`` in block I, ``j`` in block J (zero for ``j > i`` when ``SAME``).

    ``a`` ``[BLK, N]`` rows of block I, ``x`` rows of block J; ``gI``, ``gJ`` their cumulative log-decays
    (``[BLK]`` scalar, ``[BLK, N]`` diagonal), ``glJ`` the last row of ``gJ`` (diagonal decay only); ``AX``, ``XX``:
    whether ``a``, ``x`` are exact in the products' high parts (:func:`_dotx`)."""
    if DIAG:
        if SAME:
            out = tl.zeros([a.shape[0], x.shape[0]], dtype=a.dtype)
            for j in range(x.shape[0]):
                xj = _row(x, j, r)
                gj = _row(gJ, j, r)
                col = tl.sum(a * tl.exp(tl.minimum(gI - gj[None, :], 0.0)) * xj[None, :], axis=1)
                out = tl.where((r[None, :] == j) & (r[:, None] >= j), col[:, None], out)
        else:
            out = _dot(a * tl.exp(gI - glJ[None, :]), tl.trans(x * tl.exp(glJ[None, :] - gJ)), PREC, INTERP)
    else:
        out = _dotx(a, tl.trans(x), AX, XX, PREC, INTERP) * _ratio(gI, gJ, SAME, r)
    return out


@triton.jit
def _scores_b(a, k, bJ, gI, gJ, glJ, SAME: tl.constexpr, DIAG: tl.constexpr, AX: tl.constexpr, KX: tl.constexpr,
              PREC: tl.constexpr, INTERP: tl.constexpr, r):
    """:func:`_scores` of ``a`` with ``b ⊙ k`` (``bJ`` the noise of block J's tokens): the noise scales the
    columns, so the keys enter the product as they are (exact when ``KX``)."""
    if DIAG:
        out = _scores(a, bJ * k, gI, gJ, glJ, SAME, DIAG, False, False, PREC, INTERP, r)
    else:
        out = _dotx(a, tl.trans(k), AX, KX, PREC, INTERP) * (_ratio(gI, gJ, SAME, r) * bJ[None, :])
    return out


@triton.jit
def _mix(Mb, x, gI, gJ, glJ, SAME: tl.constexpr, DIAG: tl.constexpr, XX: tl.constexpr, PREC: tl.constexpr,
         INTERP: tl.constexpr, r):
    """``out_i = Σ_j M_ij ρ_ij ⊙ x_j`` (``i`` in block I, ``j`` in block J; ``Mb`` the ``[BLK, BLK]`` block,
    lower triangular when ``SAME``) -> ``[BLK, N]``."""
    if DIAG:
        if SAME:
            out = tl.zeros(x.shape, dtype=x.dtype)
            for j in range(x.shape[0]):
                xj = _row(x, j, r)
                gj = _row(gJ, j, r)
                mj = _colv(Mb, j, r)
                out += tl.where(r[:, None] >= j, mj[:, None] * tl.exp(tl.minimum(gI - gj[None, :], 0.0))
                                * xj[None, :], 0.0)
        else:
            out = tl.exp(gI - glJ[None, :]) * _dot(Mb, x * tl.exp(glJ[None, :] - gJ), PREC, INTERP)
    else:
        out = _dotx(Mb * _ratio(gI, gJ, SAME, r), x, False, XX, PREC, INTERP)
    return out


@triton.jit
def _mix_b(Mb, k, bJ, gI, gJ, glJ, SAME: tl.constexpr, DIAG: tl.constexpr, KX: tl.constexpr, PREC: tl.constexpr,
           INTERP: tl.constexpr, r):
    """:func:`_mix` of ``b ⊙ k`` (the noise scales ``M``'s columns; the keys enter as they are)."""
    if DIAG:
        out = _mix(Mb, bJ * k, gI, gJ, glJ, SAME, DIAG, False, PREC, INTERP, r)
    else:
        out = _dotx(Mb * _ratio(gI, gJ, SAME, r) * bJ[None, :], k, False, KX, PREC, INTERP)
    return out


@triton.jit
def _mix_t(Mb, x, gI, gJ, glJ, SAME: tl.constexpr, DIAG: tl.constexpr, XX: tl.constexpr, PREC: tl.constexpr,
           INTERP: tl.constexpr, r):
    """``out_j = Σ_i M_ij ρ_ij ⊙ x_i`` (the transpose of :func:`_mix`: ``x`` rows of block I, result rows of
    block J) -> ``[BLK, N]``."""
    if DIAG:
        if SAME:
            out = tl.zeros(x.shape, dtype=x.dtype)
            for i in range(x.shape[0]):
                xi = _row(x, i, r)
                gi = _row(gI, i, r)
                mi = _row(Mb, i, r)
                out += tl.where(r[:, None] <= i, mi[:, None] * tl.exp(tl.minimum(gi[None, :] - gJ, 0.0))
                                * xi[None, :], 0.0)
        else:
            out = tl.exp(glJ[None, :] - gJ) * _dot(tl.trans(Mb), x * tl.exp(gI - glJ[None, :]), PREC, INTERP)
    else:
        out = _dotx(tl.trans(Mb * _ratio(gI, gJ, SAME, r)), x, False, XX, PREC, INTERP)
    return out


# products with K̃ = γ ⊙ K: with scalar decay γ scales rows, so the keys enter the products as they are (exact
# in the high part when KX) and γ is applied to the smaller operand or the result
@triton.jit
def _kt_p(k, g, P, DIAG: tl.constexpr, KX: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr):
    """``K̃ P`` for one row block -> ``[BLK, BD]``."""
    if DIAG:
        out = _dot(tl.exp(g) * k, P, PREC, INTERP)
    else:
        out = tl.exp(g)[:, None] * _dotx(k, P, KX, False, PREC, INTERP)
    return out


@triton.jit
def _x_ktt(x, k, g, DIAG: tl.constexpr, KX: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr):
    """``x K̃ᵀ`` (``K̃`` one row block) -> ``[rows of x, BLK]``."""
    if DIAG:
        out = _dot(x, tl.trans(tl.exp(g) * k), PREC, INTERP)
    else:
        out = _dotx(x, tl.trans(k), False, KX, PREC, INTERP) * tl.exp(g)[None, :]
    return out


@triton.jit
def _m_kt(Mb, k, g, DIAG: tl.constexpr, KX: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr):
    """``Mb K̃`` (``K̃`` one row block; ``Mb`` ``[rows, BLK]``) -> ``[rows, BD]``."""
    if DIAG:
        out = _dot(Mb, tl.exp(g) * k, PREC, INTERP)
    else:
        out = _dotx(Mb * tl.exp(g)[None, :], k, False, KX, PREC, INTERP)
    return out


@triton.jit
def _ktt_x(k, g, x, DIAG: tl.constexpr, KX: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr):
    """``K̃ᵀ x`` (``K̃`` one row block, ``x`` ``[BLK, N]``) -> ``[BD, N]``."""
    if DIAG:
        out = _dot(tl.trans(tl.exp(g) * k), x, PREC, INTERP)
    else:
        out = _dotx(tl.trans(k), tl.exp(g)[:, None] * x, KX, False, PREC, INTERP)
    return out


# ---------------------------------------------------------------------------------------------------
# one chunk
# ---------------------------------------------------------------------------------------------------

@triton.jit
def _load_rows(X, tok, valid, i_h, cols, H: tl.constexpr, N: tl.constexpr, other, dt):
    """Rows ``tok`` of a packed ``[NT, H, N]`` tensor at head ``i_h``, columns ``cols`` -> ``[BLK, len(cols)]``."""
    return tl.load(X + (tok[:, None] * H + i_h) * N + cols[None, :], mask=valid[:, None] & (cols[None, :] < N),
                   other=other).to(dt)


@triton.jit
def _chunk_inputs(R2, ELL2, LA, t0, eos, i_h, r, od, H: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
                  DIAG: tl.constexpr, dt):
    """The chunk's per-token noise and decay terms, as tuples of ``NB`` row blocks (no-op tokens past ``eos``):
    ``tok, valid, r2, ell2, g`` (cumulative log-decay), ``gl`` (its last row), ``b`` (the process noise accrued
    since the chunk start) and the chunk-end ``g_end``, ``b_end``.  The keys, values and queries are loaded where
    they are used (:func:`_rows_of`): re-reading them costs loads, holding them costs registers."""
    toks = ()
    vals = ()
    r2s = ()
    l2s = ()
    gs = ()
    gls = ()
    bs = ()
    if DIAG:
        gc = tl.zeros(od.shape, dtype=dt)
        bc = tl.zeros(od.shape, dtype=dt)
    else:
        gc = tl.sum(tl.zeros(r.shape, dtype=dt), axis=0)
        bc = tl.sum(tl.zeros(r.shape, dtype=dt), axis=0)
    BLK: tl.constexpr = r.shape[0]
    for I in tl.static_range(NB):
        tok = t0 + I * BLK + r
        valid = tok < eos
        r2 = tl.load(R2 + tok * H + i_h, mask=valid, other=1.0).to(dt)
        l2 = tl.load(ELL2 + tok * H + i_h, mask=valid, other=0.0).to(dt)
        if DIAG:
            la = _load_rows(LA, tok, valid, i_h, od, H, D, 0.0, dt)
            g = tl.cumsum(la, axis=0) + gc[None, :]
            a2, x2 = tl.associative_scan((tl.exp(2.0 * la), l2[:, None] + tl.zeros(la.shape, dtype=dt)), 0, _lin)
            b = x2 + a2 * bc[None, :]
            gc = _row(g, BLK - 1, r)
            bc = _row(b, BLK - 1, r)
        else:
            la = tl.load(LA + tok * H + i_h, mask=valid, other=0.0).to(dt)
            g = tl.cumsum(la, axis=0) + gc
            a2, x2 = tl.associative_scan((tl.exp(2.0 * la), l2), 0, _lin)
            b = x2 + a2 * bc
            gc = tl.sum(tl.where(r == BLK - 1, g, 0.0), axis=0)
            bc = tl.sum(tl.where(r == BLK - 1, b, 0.0), axis=0)
        toks = toks + (tok,)
        vals = vals + (valid,)
        r2s = r2s + (r2,)
        l2s = l2s + (l2,)
        gs = gs + (g,)
        gls = gls + (gc,)
        bs = bs + (b,)
    return toks, vals, r2s, l2s, gs, gls, bs, gc, bc


@triton.jit
def _rows_of(X, toks, vals, i_h, cols, H: tl.constexpr, N: tl.constexpr, NB: tl.constexpr, dt):
    """Rows of a packed ``[NT, H, N]`` input for the chunk's ``NB`` row blocks, freshly loaded."""
    xs = ()
    for I in tl.static_range(NB):
        xs = xs + (_load_rows(X, toks[I], vals[I], i_h, cols, H, N, 0.0, dt),)
    return xs


@triton.jit
def _factor(ks, P, r2s, gs, gls, bs, r, NB: tl.constexpr, DIAG: tl.constexpr, KX: tl.constexpr, PREC: tl.constexpr,
            INTERP: tl.constexpr):
    """``S = K̃PK̃ᵀ + sym(N) + diag(r²)`` factored ``L diag(d) Lᵀ`` on ``BLK × BLK`` pivots, left-looking (block row by
    block row); ``Y = K̃P`` is formed one row block at a time.

    Returns ``(M, d, failed pivots, Y)``: ``M = L⁻¹`` as a flat tuple of its lower blocks (block ``(I, J)``,
    ``J ≤ I``, at ``I(I+1)/2 + J``; written out at every index, since Triton 3.6 does not carry a jit function's
    constant result into a tuple index), ``d`` a tuple of pivot vectors (clamped at r²), the failed pivots and the
    row blocks of ``Y`` (:func:`_my` reads them).  ``L`` itself is not kept: everything
    downstream reads ``M``."""
    eye = r[:, None] == r[None, :]
    strict = r[:, None] > r[None, :]
    PAIRS: tl.constexpr = P.shape[0] <= 64  # the diagonal blocks' LDLᵀ two pivots per step (_ldl_block)
    Lt = ()
    Mt = ()
    ds = ()
    ys = ()
    fail = tl.sum(tl.zeros(r.shape, dtype=tl.int32), axis=0)
    for I in tl.static_range(NB):
        y = _kt_p(ks[I], gs[I], P, DIAG, KX, PREC, INTERP)
        ys = ys + (y,)
        for J in tl.static_range(I + 1):
            sb = _scores_b(ks[I], ks[J], bs[J], gs[I], gs[J], gls[J], I == J, DIAG, KX, KX, PREC, INTERP, r)
            if I == J:
                ns = tl.where(strict, sb, 0.0)
                if PAIRS:  # its lower triangle: _ldl_block mirrors the block once it is formed
                    sb = ns + tl.where(eye, sb + r2s[I][:, None], 0.0)
                else:
                    sb = ns + tl.trans(ns) + tl.where(eye, sb + r2s[I][:, None], 0.0)
            sb += _x_ktt(y, ks[J], gs[J], DIAG, KX, PREC, INTERP)
            for m in tl.static_range(J):
                sb -= _dot(Lt[I * (I + 1) // 2 + m] * ds[m][None, :], tl.trans(Lt[J * (J + 1) // 2 + m]), PREC, INTERP)
            if J < I:
                Lt = Lt + (_dot(sb, tl.trans(Mt[J * (J + 1) // 2 + J]), PREC, INTERP) / ds[J][None, :],)
            else:
                Lkk, Likk, dk, f = _ldl_block(sb, r2s[I], r, PAIRS, INTERP)
                fail += f
                Lt = Lt + (Lkk,)
                ds = ds + (dk,)
        # row I of M = L⁻¹: M_IJ = −M_II Σ_{J≤m<I} L_Im M_mJ
        for J in tl.static_range(I):
            acc = _dot(Lt[I * (I + 1) // 2 + J], Mt[J * (J + 1) // 2 + J], PREC, INTERP)
            for m in tl.static_range(J + 1, I):
                acc += _dot(Lt[I * (I + 1) // 2 + m], Mt[m * (m + 1) // 2 + J], PREC, INTERP)
            Mt = Mt + (-_dot(Likk, acc, PREC, INTERP),)
        Mt = Mt + (Likk,)
    return Mt, ds, fail, ys


@triton.jit
def _factors_at(FCK, row, i_h, H: tl.constexpr, C: tl.constexpr):
    """Where a chunk's factors lie in FCK ``[·, H, C, C + 1]``: ``M = L⁻¹`` in the first ``C`` columns, ``d`` in the
    last."""
    return FCK + (row * H + i_h) * (C * (C + 1))


@triton.jit
def _save_factors(F, Mt, ds, poison, r, NB: tl.constexpr, C: tl.constexpr):
    """Store the lower blocks of ``M`` and the pivots ``d`` (NaN from a failed pivot on: ``poison``) at ``F``."""
    BLK: tl.constexpr = r.shape[0]
    for I in tl.static_range(NB):
        ri = r + I * BLK
        for J in tl.static_range(I + 1):
            rj = r + J * BLK
            tl.store(F + ri[:, None] * (C + 1) + rj[None, :], Mt[I * (I + 1) // 2 + J])
        tl.store(F + ri * (C + 1) + C, ds[I] * poison)


@triton.jit
def _load_factors(F, r, NB: tl.constexpr, C: tl.constexpr, dt):
    """What :func:`_save_factors` stored: ``(M`` lower blocks as :func:`_factor` returns them, ``d``, the pivots
    the forward found failed ``)``."""
    BLK: tl.constexpr = r.shape[0]
    Mt = ()
    ds = ()
    fail = tl.sum(tl.zeros(r.shape, dtype=tl.int32), axis=0)
    for I in tl.static_range(NB):
        ri = r + I * BLK
        for J in tl.static_range(I + 1):
            rj = r + J * BLK
            Mt = Mt + (tl.load(F + ri[:, None] * (C + 1) + rj[None, :]).to(dt),)
        d = tl.load(F + ri * (C + 1) + C).to(dt)
        fail += tl.sum((d != d).to(tl.int32), axis=0)
        ds = ds + (d,)
    return Mt, ds, fail


@triton.jit
def _factor_adjoint(Mb, Mt, ds, betas, bbars, r, NB: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr):
    """The adjoint of ``S = L diag(d) Lᵀ`` given those of ``M = L⁻¹`` (``M̄``, lower blocks) and of ``β = 1/d``
    (``β̄``): ``S̄ = sym(Mᵀ Ψ M)`` with ``Ψ = stril(−M̄ Mᵀ) diag(d)⁻¹ + diag(−β² β̄)`` (lower blocks of ``S̄``)."""
    eye = r[:, None] == r[None, :]
    strict = r[:, None] > r[None, :]
    Ps = ()
    for I in tl.static_range(NB):
        for J in tl.static_range(I + 1):
            x = _dot(Mb[I * (I + 1) // 2 + 0], tl.trans(Mt[J * (J + 1) // 2 + 0]), PREC, INTERP)
            for K2 in tl.static_range(1, J + 1):
                x += _dot(Mb[I * (I + 1) // 2 + K2], tl.trans(Mt[J * (J + 1) // 2 + K2]), PREC, INTERP)
            x = -x / ds[J][None, :]
            if I == J:
                dbar = -betas[I] * betas[I] * bbars[I]
                x = tl.where(strict, x, tl.where(eye, dbar[:, None], 0.0))
            Ps = Ps + (x,)
    Ts = ()
    for A in tl.static_range(NB):
        for J in tl.static_range(A + 1):
            x = _dot(Ps[A * (A + 1) // 2 + J], Mt[J * (J + 1) // 2 + J], PREC, INTERP)
            for B2 in tl.static_range(J + 1, A + 1):
                x += _dot(Ps[A * (A + 1) // 2 + B2], Mt[B2 * (B2 + 1) // 2 + J], PREC, INTERP)
            Ts = Ts + (x,)
    Sb = ()
    for I in tl.static_range(NB):
        for J in tl.static_range(I + 1):
            # R_IJ = Σ_{A ≥ I} M_AIᵀ T_AJ and R_JI = Σ_{A ≥ I} M_AJᵀ T_AI (I ≥ J); S̄_IJ = (R_IJ + R_JIᵀ) / 2
            rij = _dot(tl.trans(Mt[I * (I + 1) // 2 + I]), Ts[I * (I + 1) // 2 + J], PREC, INTERP)
            rji = _dot(tl.trans(Mt[I * (I + 1) // 2 + J]), Ts[I * (I + 1) // 2 + I], PREC, INTERP)
            for A in tl.static_range(I + 1, NB):
                rij += _dot(tl.trans(Mt[A * (A + 1) // 2 + I]), Ts[A * (A + 1) // 2 + J], PREC, INTERP)
                rji += _dot(tl.trans(Mt[A * (A + 1) // 2 + J]), Ts[A * (A + 1) // 2 + I], PREC, INTERP)
            Sb = Sb + (0.5 * (rij + tl.trans(rji)),)
    return Sb


@triton.jit
def _my(Mt, ys, I: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr):
    """Row block ``I`` of ``Z = M Y = kw P`` from the row blocks of ``Y = K̃P`` that :func:`_factor` formed: products
    over the chunk's tokens (``BLK``) instead of over the key dim, whose ``BLK × BD`` operand every warp of a
    ``mma.sync`` product holds in registers: at D = 128 the forward spills less this way."""
    z = _dot(Mt[I * (I + 1) // 2 + 0], ys[0], PREC, INTERP)
    for J in tl.static_range(1, I + 1):
        z += _dot(Mt[I * (I + 1) // 2 + J], ys[J], PREC, INTERP)
    return z


@triton.jit
def chain_forward_kernel(
    Q, K, V, R2, ELL2, LA, CU, CKO, P0,
    W, KW, VU, GOUT, VAR, PT, PCK, FCK, FAIL,
    H: tl.constexpr,
    D: tl.constexpr,
    MV: tl.constexpr,
    BD: tl.constexpr,
    BMV: tl.constexpr,
    C: tl.constexpr,
    DIAG: tl.constexpr,
    WANT_VAR: tl.constexpr,
    SAVE_P: tl.constexpr,
    KX: tl.constexpr,
    PREC: tl.constexpr,
    INTERP: tl.constexpr,
):
    """The covariance chain of one (sequence ``program_id(0)``, head ``program_id(1)``), P on chip throughout.

    Packed inputs (``NT`` tokens, ``H`` folded heads): Q, K ``[NT, H, D]``, V ``[NT, H, MV]``, R2, ELL2 ``[NT, H]``,
    LA ``[NT, H]`` (scalar decay) or ``[NT, H, D]`` (``DIAG``), in any float dtype (cast on load; ``KX``: q, k, v
    are exact in the products' high parts, :func:`_dotx`); CU ``[N + 1]`` sequence offsets; CKO ``[N]`` the first
    per-chunk checkpoint row of each sequence; P0 ``[N, H, D, D]`` (the working dtype: fp32 or float64).  Writes
    W, KW ``[NT, H, D]``, VU ``[NT, H, MV]`` (their dtype), GOUT ``[NT, H, 1 or D]`` (chunk-local cumulative
    log-decay), VAR ``[NT, H]`` (``WANT_VAR``), PT ``[N, H, D, D]`` (the final covariance), PCK ``[·, H, D, D]``
    the covariance at the start of every chunk and FCK ``[·, H, C, C + 1]`` the chunk's factors ``M = L⁻¹`` and ``d``
    (``SAVE_P``: the backward's checkpoints; ``d`` NaN from a failed pivot on), FAIL ``[N, H]`` int32
    (pivots that were not positive; from the first one on, the program's outputs are NaN).
    """
    BLK: tl.constexpr = 32 if C > 32 else C
    NB: tl.constexpr = C // BLK
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    dt = P0.dtype.element_ty
    bos = tl.load(CU + i_n).to(tl.int64)
    eos = tl.load(CU + i_n + 1).to(tl.int64)
    n_chunks = tl.cdiv(eos - bos, C)
    ck0 = tl.load(CKO + i_n).to(tl.int64)
    r = tl.arange(0, BLK)
    od = tl.arange(0, BD)
    ov = tl.arange(0, BMV)
    pmask = (od[:, None] < D) & (od[None, :] < D)
    eyeD = (od[:, None] == od[None, :]) & (od[:, None] < D)
    P = tl.load(P0 + (i_n * H + i_h) * D * D + od[:, None] * D + od[None, :], mask=pmask, other=0.0).to(dt)
    fail = tl.sum(tl.zeros(r.shape, dtype=tl.int32), axis=0)
    for c in range(n_chunks):
        if SAVE_P:
            tl.store(PCK + ((ck0 + c) * H + i_h) * D * D + od[:, None] * D + od[None, :], P, mask=pmask)
        toks, vals, r2s, l2s, gs, gls, bs, g_end, b_end = _chunk_inputs(
            R2, ELL2, LA, bos + c * C, eos, i_h, r, od, H, D, NB, DIAG, dt)
        Mt, ds, f, ys = _factor(_rows_of(K, toks, vals, i_h, od, H, D, NB, dt), P, r2s, gs, gls, bs, r, NB, DIAG, KX,
                            PREC, INTERP)
        fail += f
        # a failed pivot poisons the chain: from its chunk on, every output of this (sequence, head) is NaN
        poison = tl.where(fail > 0, float("nan"), 1.0)
        # the end update's P-free part; the rank-C downdate is added row block by row block
        if DIAG:
            gC = tl.exp(g_end)
            Pn = P * gC[:, None] * gC[None, :] + tl.where(eyeD, b_end[:, None], 0.0)
        else:
            Pn = P * tl.exp(2.0 * g_end) + tl.where(eyeD, b_end, 0.0)
        ks = _rows_of(K, toks, vals, i_h, od, H, D, NB, dt)
        vs = _rows_of(V, toks, vals, i_h, ov, H, MV, NB, dt)
        us = ()
        betas = ()
        for I in tl.static_range(NB):
            # kw = M K̃, U = γ ⊙ (kw P) + mix(M, bK), vu = M V; at D > 64 kw P is formed as M Y (:func:`_my`),
            # which spills less there; at D ≤ 64 the product over D compiles without spilling and is kept
            kw = _m_kt(Mt[I * (I + 1) // 2 + 0], ks[0], gs[0], DIAG, KX, PREC, INTERP)
            vu = _dotx(Mt[I * (I + 1) // 2 + 0], vs[0], False, KX, PREC, INTERP)
            mx = _mix_b(Mt[I * (I + 1) // 2 + 0], ks[0], bs[0], gs[I], gs[0], gls[0], I == 0, DIAG, KX, PREC, INTERP, r)
            for J in tl.static_range(1, I + 1):
                mij = Mt[I * (I + 1) // 2 + J]
                kw += _m_kt(mij, ks[J], gs[J], DIAG, KX, PREC, INTERP)
                vu += _dotx(mij, vs[J], False, KX, PREC, INTERP)
                mx += _mix_b(mij, ks[J], bs[J], gs[I], gs[J], gls[J], I == J, DIAG, KX, PREC, INTERP, r)
            if BD > 64:
                z = _my(Mt, ys, I, PREC, INTERP)
            else:
                z = _dot(kw, P, PREC, INTERP)
            u = (tl.exp(_rs(gs[I], DIAG)) * z + mx) * poison
            beta = 1.0 / ds[I]
            tok = toks[I]
            valid = vals[I]
            pk = (tok[:, None] * H + i_h) * D + od[None, :]
            mk = valid[:, None] & (od[None, :] < D)
            tl.store(W + pk, (beta[:, None] * u).to(W.dtype.element_ty), mask=mk)
            tl.store(KW + pk, kw.to(KW.dtype.element_ty), mask=mk)
            tl.store(VU + (tok[:, None] * H + i_h) * MV + ov[None, :], vu.to(VU.dtype.element_ty),
                     mask=valid[:, None] & (ov[None, :] < MV))
            if DIAG:
                tl.store(GOUT + pk, gs[I].to(GOUT.dtype.element_ty), mask=mk)
                ue = tl.exp(g_end[None, :] - gs[I]) * u
            else:
                tl.store(GOUT + tok * H + i_h, gs[I].to(GOUT.dtype.element_ty), mask=valid)
                ue = tl.exp(g_end - gs[I])[:, None] * u
            Pn -= _dot(tl.trans(ue * beta[:, None]), ue, PREC, INTERP)
            us = us + (u,)
            betas = betas + (beta,)
            if WANT_VAR:
                q = _load_rows(Q, tok, valid, i_h, od, H, D, 0.0, dt)
                qq = q * q
                if DIAG:
                    qt = tl.exp(gs[I]) * q
                    v = 1.0 + tl.sum(_dot(qt, P, PREC, INTERP) * qt, axis=1) + tl.sum(bs[I] * qq, axis=1)
                else:
                    v = (1.0 + tl.exp(2.0 * gs[I]) * tl.sum(_dotx(q, P, KX, False, PREC, INTERP) * q, axis=1)
                         + bs[I] * tl.sum(qq, axis=1))
                for J in tl.static_range(I + 1):
                    gq = _scores(q, us[J], gs[I], gs[J], gls[J], I == J, DIAG, KX, False, PREC, INTERP, r)
                    v -= tl.sum(gq * gq * betas[J][None, :], axis=1)
                tl.store(VAR + tok * H + i_h, v.to(VAR.dtype.element_ty), mask=valid)
        if SAVE_P:
            _save_factors(_factors_at(FCK, ck0 + c, i_h, H, C), Mt, ds, poison, r, NB, C)
        P = 0.5 * (Pn + tl.trans(Pn)) * poison
    tl.store(PT + (i_n * H + i_h) * D * D + od[:, None] * D + od[None, :], P, mask=pmask)
    tl.store(FAIL + i_n * H + i_h, fail)


@triton.jit
def _chs(x, DIAG: tl.constexpr):
    """A ``[BLK, N]`` per-channel contribution to the adjoint of the log-decay: itself (diagonal decay) or its
    channel sum (scalar decay)."""
    if DIAG:
        out = x
    else:
        out = tl.sum(x, axis=1)
    return out


@triton.jit
def _add(t, i: tl.constexpr, x):
    """The tuple ``t`` with ``x`` added to element ``i``."""
    return _set(t, i, t[i] + x)


@triton.jit
def _noise_adj(db, gI, gJ, glJ, SAME: tl.constexpr, DIAG: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr,
               r):
    """``Σ_{i in I, i ≥ j} ρ_ij² ⊙ b̄_i`` for ``j`` in block J: the adjoint of ``b_i = Σ_{j≤i} ℓ_j² ρ_ij²`` with
    respect to ``ℓ_j²`` (before the channel sum); ``b̄`` ``[BLK]`` (scalar decay) or ``[BLK, N]``."""
    if DIAG:
        if SAME:
            ones = tl.where(r[:, None] >= r[None, :], 1.0, 0.0).to(db.dtype)
        else:
            ones = tl.zeros([r.shape[0], r.shape[0]], dtype=db.dtype) + 1.0
        out = _mix_t(ones, db, 2.0 * gI, 2.0 * gJ, 2.0 * glJ, SAME, DIAG, False, PREC, INTERP, r)
    else:
        out = tl.sum(_ratio(2.0 * gI, 2.0 * gJ, SAME, r) * db[:, None], axis=0)
    return out


@triton.jit
def chain_backward_kernel(
    Q, K, V, R2, ELL2, LA, CU, CKO, PCK, FCK, W, KW,
    DW, DKW, DVU, DVAR, DPT,
    DQ, DK, DV, DR2, DELL2, DLA, DP0, FAIL,
    H: tl.constexpr,
    D: tl.constexpr,
    MV: tl.constexpr,
    BD: tl.constexpr,
    BMV: tl.constexpr,
    C: tl.constexpr,
    DIAG: tl.constexpr,
    WANT_VAR: tl.constexpr,
    HAS_DPT: tl.constexpr,
    READ_WKW: tl.constexpr,
    KX: tl.constexpr,
    PREC: tl.constexpr,
    INTERP: tl.constexpr,
):
    """The reverse chain of one (sequence, head): the adjoint of :func:`chain_forward_kernel`, ``dP`` on chip.

    Walks the sequence's chunks last to first.  Each chunk is replayed from its checkpoints (PCK, the covariance
    the forward held at the chunk's start, and FCK, the factors ``M = L⁻¹`` and ``d`` of its ``S``, so that the
    factorisation is not repeated; with ``READ_WKW`` also W and KW, the forward's ``W = βU`` and ``kw`` in the
    working dtype, so that ``U = W / β`` and ``kw`` are read instead of formed) and differentiated in registers: the
    adjoints of the chunk's outputs
    (DW, DKW ``[NT, H, D]``, DVU ``[NT, H, MV]``, DVAR ``[NT, H]`` with ``WANT_VAR``: what the mean pass's backward
    and the caller hand back) and of its end covariance (carried, ``DPT`` ``[N, H, D, D]`` at the sequence end when
    ``HAS_DPT``) give the adjoint of its start covariance and the gradients of its tokens' inputs, written once:
    DQ (the variance's part; ``WANT_VAR``), DK ``[NT, H, D]``, DV ``[NT, H, MV]``, DR2, DELL2 ``[NT, H]``, DLA
    ``[NT, H, 1 or D]`` (the covariance pass's and the substitution's part of the log-decay's gradient), and at
    the sequence start DP0 ``[N, H, D, D]`` (symmetrised).  Arguments otherwise as the forward's.

    Per chunk, with ``Ḡ = sym(dP_end)``, ``M = L⁻¹`` and ``U = γ ⊙ (kw P) + mix(M, bK)``::

        dP  = Φ_C Ḡ Φ_C + kwᵀ dZ + K̃ᵀ S̄ K̃ (+ Q̃ᵀ diag(dvar) Q̃),   dUe = −2 diag(β) Ue Ḡ,   β̄ = −rowsum(Ue Ḡ ⊙ Ue) + …
        d(kw) += dZ P (dZ = γ ⊙ dU),   M̄ = tril(dU ⊙ρ (bK)ᵀ + d(kw) K̃ᵀ + dvu Vᵀ),   d̄ = −β² β̄
        Ψ   = stril(−M̄ Mᵀ) diag(d)⁻¹ + diag(d̄),   S̄ = sym(Mᵀ Ψ M)          (the adjoint of S = L diag(d) Lᵀ)
        dK̃ += Mᵀ d(kw) + 2 S̄ K̃ P,   dr² = diag S̄,   dN = 2 S̄ − diag S̄  (lower)

    and the decay's adjoint collected per token (``dG``) and reverse-summed within the chunk.
    """
    BLK: tl.constexpr = 32 if C > 32 else C
    NB: tl.constexpr = C // BLK
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    dt = PCK.dtype.element_ty
    bos = tl.load(CU + i_n).to(tl.int64)
    eos = tl.load(CU + i_n + 1).to(tl.int64)
    n_chunks = tl.cdiv(eos - bos, C)
    ck0 = tl.load(CKO + i_n).to(tl.int64)
    r = tl.arange(0, BLK)
    od = tl.arange(0, BD)
    ov = tl.arange(0, BMV)
    eye = r[:, None] == r[None, :]
    low = r[:, None] >= r[None, :]
    strict = r[:, None] > r[None, :]
    eyeD = (od[:, None] == od[None, :]) & (od[:, None] < D)
    pmask = (od[:, None] < D) & (od[None, :] < D)
    if HAS_DPT:
        dP = tl.load(DPT + (i_n * H + i_h) * D * D + od[:, None] * D + od[None, :], mask=pmask, other=0.0).to(dt)
    else:
        dP = tl.zeros([BD, BD], dtype=dt)
    fail = tl.sum(tl.zeros(r.shape, dtype=tl.int32), axis=0)
    for cc in range(n_chunks):
        c = n_chunks - 1 - cc
        P = tl.load(PCK + ((ck0 + c) * H + i_h) * D * D + od[:, None] * D + od[None, :], mask=pmask, other=0.0)
        P = P.to(dt)
        toks, vals, r2s, l2s, gs, gls, bs, g_end, b_end = _chunk_inputs(
            R2, ELL2, LA, bos + c * C, eos, i_h, r, od, H, D, NB, DIAG, dt)
        # ---- the chunk's factors as the forward stored them (M = L⁻¹, d); replay kw = M K̃, U ----
        Mt, ds, f = _load_factors(_factors_at(FCK, ck0 + c, i_h, H, C), r, NB, C, dt)
        fail += f
        poison = tl.where(fail > 0, float("nan"), 1.0)
        kws = ()
        us = ()
        betas = ()
        if READ_WKW:
            # U = W / β as the forward wrote it (W = βU, one rounding of the working dtype); kw is read where used
            for I in tl.static_range(NB):
                us = us + (_load_rows(W, toks[I], vals[I], i_h, od, H, D, 0.0, dt) * ds[I][:, None],)
                betas = betas + (1.0 / ds[I],)
        else:
            ks = _rows_of(K, toks, vals, i_h, od, H, D, NB, dt)
            for I in tl.static_range(NB):
                kw = _m_kt(Mt[I * (I + 1) // 2 + 0], ks[0], gs[0], DIAG, KX, PREC, INTERP)
                mx = _mix_b(Mt[I * (I + 1) // 2 + 0], ks[0], bs[0], gs[I], gs[0], gls[0], I == 0, DIAG, KX, PREC,
                            INTERP, r)
                for J in tl.static_range(1, I + 1):
                    mij = Mt[I * (I + 1) // 2 + J]
                    kw += _m_kt(mij, ks[J], gs[J], DIAG, KX, PREC, INTERP)
                    mx += _mix_b(mij, ks[J], bs[J], gs[I], gs[J], gls[J], I == J, DIAG, KX, PREC, INTERP, r)
                kws = kws + (kw,)
                us = us + (tl.exp(_rs(gs[I], DIAG)) * _dot(kw, P, PREC, INTERP) + mx,)
                betas = betas + (1.0 / ds[I],)
        # ---- the adjoint of P' = sym(Φ_C P Φ_C + diag(b_C) − Ueᵀ diag(β) Ue) ----
        Gs = 0.5 * (dP + tl.trans(dP)) * poison
        if DIAG:
            gC = tl.exp(g_end)
            dgl = 2.0 * gC * tl.sum(Gs * P * gC[None, :], axis=1)
            dbC = tl.sum(tl.where(eyeD, Gs, 0.0), axis=1)
        else:
            gC2 = tl.exp(2.0 * g_end)
            dgl = 2.0 * gC2 * tl.sum(tl.sum(Gs * P, axis=1), axis=0)
            dbC = tl.sum(tl.sum(tl.where(eyeD, Gs, 0.0), axis=1), axis=0)
        dUs = ()
        bbars = ()
        dGs = ()
        for I in tl.static_range(NB):
            if DIAG:
                end = tl.exp(g_end[None, :] - gs[I])
            else:
                end = tl.exp(g_end - gs[I])[:, None]
            ue = end * us[I]
            ueg = _dot(ue, Gs, PREC, INTERP)
            bbar = -tl.sum(ueg * ue, axis=1)
            due = -2.0 * betas[I][:, None] * ueg
            x = due * ue
            dgl += tl.sum(_chs(x, DIAG), axis=0)
            pk = (toks[I][:, None] * H + i_h) * D + od[None, :]
            mk = vals[I][:, None] & (od[None, :] < D)
            dw = tl.load(DW + pk, mask=mk, other=0.0).to(dt)
            bbar += tl.sum(dw * us[I], axis=1)
            dUs = dUs + (end * due + betas[I][:, None] * dw,)
            bbars = bbars + (bbar,)
            dGs = dGs + (-_chs(x, DIAG),)
        if DIAG:
            dPs = Gs * gC[:, None] * gC[None, :]
        else:
            dPs = Gs * gC2
        # ---- the variance 1 + q̃ᵀPq̃ + qᵀBq − Σ_{i≤t} β_i (q_tᵀΦ_tΦ_i⁻¹u_i)² ----
        dqs = ()
        if WANT_VAR:
            dvars = ()
            for I in tl.static_range(NB):
                dvars = dvars + (tl.load(DVAR + toks[I] * H + i_h, mask=vals[I], other=0.0).to(dt),)
            qs = _rows_of(Q, toks, vals, i_h, od, H, D, NB, dt)
            for I in tl.static_range(NB):
                dv_ = dvars[I]
                gam = tl.exp(_rs(gs[I], DIAG))
                # q̃ᵀPq̃: dP += Q̃ᵀ diag(dvar) Q̃, dq̃ = 2 dvar P q̃
                dPs += _ktt_x(qs[I], gs[I], gam * qs[I] * dv_[:, None], DIAG, KX, PREC, INTERP)
                dqt = 2.0 * dv_[:, None] * _kt_p(qs[I], gs[I], P, DIAG, KX, PREC, INTERP)
                dq = gam * dqt
                dG = _chs(dqt * gam * qs[I], DIAG)
                for J in tl.static_range(I + 1):
                    gq = _scores(qs[I], us[J], gs[I], gs[J], gls[J], I == J, DIAG, KX, False, PREC, INTERP, r)
                    bbars = _add(bbars, J, -tl.sum(dv_[:, None] * gq * gq, axis=0))
                    dgq = -2.0 * dv_[:, None] * betas[J][None, :] * gq
                    xq = _mix(dgq, us[J], gs[I], gs[J], gls[J], I == J, DIAG, False, PREC, INTERP, r)
                    xu = _mix_t(dgq, qs[I], gs[I], gs[J], gls[J], I == J, DIAG, KX, PREC, INTERP, r)
                    dq += xq
                    dUs = _add(dUs, J, xu)
                    dG += _chs(qs[I] * xq, DIAG)
                    dGs = _add(dGs, J, -_chs(us[J] * xu, DIAG))
                # qᵀBq
                dq += 2.0 * dv_[:, None] * _rs(bs[I], DIAG) * qs[I]
                dqs = dqs + (dq,)
                dGs = _add(dGs, I, dG)
        # ---- U = γ ⊙ (kw P) + mix(M, bK): dP from kw P, d(kw) += dZ P; the decay through U is dU ⊙ U ----
        dkws = ()
        for I in tl.static_range(NB):
            pk = (toks[I][:, None] * H + i_h) * D + od[None, :]
            mk = vals[I][:, None] & (od[None, :] < D)
            dz = tl.exp(_rs(gs[I], DIAG)) * dUs[I]
            if READ_WKW:
                kw = _load_rows(KW, toks[I], vals[I], i_h, od, H, D, 0.0, dt)
            else:
                kw = kws[I]
            dPs += _dot(tl.trans(kw), dz, PREC, INTERP)
            dkws = dkws + (tl.load(DKW + pk, mask=mk, other=0.0).to(dt) + _dot(dz, P, PREC, INTERP),)
            dGs = _add(dGs, I, _chs(dUs[I] * us[I], DIAG))
        # ---- kw = M K̃, vu = M V, mix(M, bK): M̄, dK̃, dV, d(bK) ----
        ks = _rows_of(K, toks, vals, i_h, od, H, D, NB, dt)
        vs = _rows_of(V, toks, vals, i_h, ov, H, MV, NB, dt)
        Mb = ()
        for I in tl.static_range(NB):
            dvu = tl.load(DVU + (toks[I][:, None] * H + i_h) * MV + ov[None, :],
                          mask=vals[I][:, None] & (ov[None, :] < MV), other=0.0).to(dt)
            for J in tl.static_range(I + 1):
                m_ = _scores_b(dUs[I], ks[J], bs[J], gs[I], gs[J], gls[J], I == J, DIAG, False, KX, PREC, INTERP, r)
                m_ += _x_ktt(dkws[I], ks[J], gs[J], DIAG, KX, PREC, INTERP)
                m_ += _dotx(dvu, tl.trans(vs[J]), False, KX, PREC, INTERP)
                if I == J:
                    m_ = tl.where(low, m_, 0.0)
                Mb = Mb + (m_,)
        # dK̃ = Mᵀ d(kw) and d(bK) = mixᵀ(M, dU), folded at once into dk, the noise's adjoint db and dG
        dks = ()
        dbs = ()
        for J in tl.static_range(NB):
            dkt = tl.zeros([BLK, BD], dtype=dt)
            dvv = tl.zeros([BLK, BMV], dtype=dt)
            dnb = tl.zeros([BLK, BD], dtype=dt)
            for I in tl.static_range(J, NB):
                MtT = tl.trans(Mt[I * (I + 1) // 2 + J])
                dkt += _dot(MtT, dkws[I], PREC, INTERP)
                dvv += _dot(MtT, tl.load(DVU + (toks[I][:, None] * H + i_h) * MV + ov[None, :],
                                         mask=vals[I][:, None] & (ov[None, :] < MV), other=0.0).to(dt), PREC, INTERP)
                dnb += _mix_t(Mt[I * (I + 1) // 2 + J], dUs[I], gs[I], gs[J], gls[J], I == J, DIAG, False, PREC,
                              INTERP, r)
            tl.store(DV + (toks[J][:, None] * H + i_h) * MV + ov[None, :], dvv.to(DV.dtype.element_ty),
                     mask=vals[J][:, None] & (ov[None, :] < MV))
            gam = tl.exp(_rs(gs[J], DIAG))
            bb = _rs(bs[J], DIAG)
            dks = dks + (gam * dkt + bb * dnb,)
            dbs = dbs + (_chs(dnb * ks[J], DIAG),)
            dGs = _add(dGs, J, _chs(dkt * gam * ks[J], DIAG) - _chs(bb * ks[J] * dnb, DIAG))
        # ---- the factorisation: Ψ = stril(−M̄ Mᵀ) diag(d)⁻¹ + diag(d̄),  S̄ = sym(Mᵀ Ψ M) ----
        Sb = _factor_adjoint(Mb, Mt, ds, betas, bbars, r, NB, PREC, INTERP)
        # ---- S = K̃ P K̃ᵀ + sym(N) + diag(r²) ----
        xs = ()
        for _I in tl.static_range(NB):
            xs = xs + (tl.zeros([BLK, BD], dtype=dt),)
        for I in tl.static_range(NB):
            for J in tl.static_range(I + 1):
                sb = Sb[I * (I + 1) // 2 + J]
                if I == J:
                    tl.store(DR2 + toks[I] * H + i_h, tl.sum(tl.where(eye, sb, 0.0), axis=1).to(DR2.dtype.element_ty),
                             mask=vals[I])
                    xs = _add(xs, I, _m_kt(sb, ks[I], gs[I], DIAG, KX, PREC, INTERP))
                    dn = tl.where(strict, 2.0 * sb, tl.where(eye, sb, 0.0))
                else:
                    xs = _add(xs, I, _m_kt(sb, ks[J], gs[J], DIAG, KX, PREC, INTERP))
                    xs = _add(xs, J, _m_kt(tl.trans(sb), ks[I], gs[I], DIAG, KX, PREC, INTERP))
                    dn = 2.0 * sb
                xk = _mix_b(dn, ks[J], bs[J], gs[I], gs[J], gls[J], I == J, DIAG, KX, PREC, INTERP, r)
                xb = _mix_t(dn, ks[I], gs[I], gs[J], gls[J], I == J, DIAG, KX, PREC, INTERP, r)
                bb = _rs(bs[J], DIAG)
                dks = _add(dks, I, xk)
                dks = _add(dks, J, bb * xb)
                dbs = _add(dbs, J, _chs(xb * ks[J], DIAG))
                dGs = _add(dGs, I, _chs(ks[I] * xk, DIAG))
                dGs = _add(dGs, J, -_chs(bb * ks[J] * xb, DIAG))
        for I in tl.static_range(NB):
            # S = K̃ P K̃ᵀ: dK̃ += 2 S̄ K̃ P, dP += K̃ᵀ S̄ K̃
            gam = tl.exp(_rs(gs[I], DIAG))
            dkt = 2.0 * _dot(xs[I], P, PREC, INTERP)
            dks = _add(dks, I, gam * dkt)
            dGs = _add(dGs, I, _chs(dkt * gam * ks[I], DIAG))
            dPs += _ktt_x(ks[I], gs[I], xs[I], DIAG, KX, PREC, INTERP)
        # ---- qᵀBq and the chunk-end noise b_C; then b_j = Σ_{l≤j} ℓ_l² ρ_jl² ----
        for I in tl.static_range(NB):
            db = dbs[I]
            if WANT_VAR:
                q = _load_rows(Q, toks[I], vals[I], i_h, od, H, D, 0.0, dt)
                db += _chs(dvars[I][:, None] * q * q, DIAG)
            if I == NB - 1:
                if DIAG:
                    db = tl.where(r[:, None] == BLK - 1, db + dbC[None, :], db)
                else:
                    db = tl.where(r == BLK - 1, db + dbC, db)
            dbs = _set(dbs, I, db)
        for J in tl.static_range(NB):
            tb = tl.zeros(dbs[J].shape, dtype=dt)
            for I in tl.static_range(J, NB):
                tb += _noise_adj(dbs[I], gs[I], gs[J], gls[J], I == J, DIAG, PREC, INTERP, r)
            if DIAG:
                tl.store(DELL2 + toks[J] * H + i_h, tl.sum(tb, axis=1).to(DELL2.dtype.element_ty), mask=vals[J])
                dGs = _add(dGs, J, 2.0 * dbs[J] * bs[J] - 2.0 * l2s[J][:, None] * tb)
            else:
                tl.store(DELL2 + toks[J] * H + i_h, tb.to(DELL2.dtype.element_ty), mask=vals[J])
                dGs = _add(dGs, J, 2.0 * dbs[J] * bs[J] - 2.0 * l2s[J] * tb)
        # the chunk end's log-decay is the last row's; reverse cumulative sum within the chunk
        if DIAG:
            dGs = _add(dGs, NB - 1, tl.where(r[:, None] == BLK - 1, dgl[None, :], 0.0))
            carry = tl.zeros(od.shape, dtype=dt)
        else:
            dGs = _add(dGs, NB - 1, tl.where(r == BLK - 1, dgl, 0.0))
            carry = tl.sum(tl.zeros(r.shape, dtype=dt), axis=0)
        for I in tl.static_range(NB - 1, -1, -1):
            dG = dGs[I]
            pk = (toks[I][:, None] * H + i_h) * D + od[None, :]
            mk = vals[I][:, None] & (od[None, :] < D)
            if DIAG:
                dla = tl.cumsum(dG, axis=0, reverse=True) + carry[None, :]
                tl.store(DLA + pk, dla.to(DLA.dtype.element_ty), mask=mk)
            else:
                dla = tl.cumsum(dG, axis=0, reverse=True) + carry
                tl.store(DLA + toks[I] * H + i_h, dla.to(DLA.dtype.element_ty), mask=vals[I])
            carry += tl.sum(dG, axis=0)
            tl.store(DK + pk, dks[I].to(DK.dtype.element_ty), mask=mk)
            if WANT_VAR:
                tl.store(DQ + pk, dqs[I].to(DQ.dtype.element_ty), mask=mk)
        dP = dPs
    Gs = 0.5 * (dP + tl.trans(dP))
    tl.store(DP0 + (i_n * H + i_h) * D * D + od[:, None] * D + od[None, :], Gs.to(DP0.dtype.element_ty), mask=pmask)
    tl.store(FAIL + i_n * H + i_h, fail)


# ---------------------------------------------------------------------------------------------------
# wrappers
# ---------------------------------------------------------------------------------------------------

def _interpreting() -> bool:
    from .triton_support import interpreter_enabled

    return interpreter_enabled()


# the chain kernels' arithmetic per input dtype, chosen by measured error (benchmarks/chain_precision.py,
# docs/kernels.md "Precision"); float64 inputs always run float64 with IEEE products.  "float64": the kernels
# compute in float64 (P, the C×C factorisation, every product: IEEE, on the float64 tensor cores of sm_80+) and
# round only what they hand on (the mean pass's operands, the outputs, the gradients) to fp32 — with fp32 work
# the chunk step's error (S's factorisation and L⁻¹'s products, ill-conditioned when a chunk's keys are nearly
# dependent) is of the fp32 segment scan's order whatever the product precision.  "tf32x3", "bf16x3", "ieee":
# fp32 work, every product split into TF32 or bf16 parts on tensor cores, or one IEEE fp32 product.
# Compiled for sm_90, the float64 backward needs 256 KiB of shared memory at D = 128, more than an H100/H200 has
# (results/sass/chain64_compile_sm90_triton3.9.json): above FLOAT64_MAX_HEAD_DIM fp32 inputs keep HALF_PRECISION.
FP32_PRECISION = "float64"  # fp32 inputs with D ≤ FLOAT64_MAX_HEAD_DIM
HALF_PRECISION = "tf32x3"  # bf16 and fp16 inputs (and fp32 ones with larger D): tensor-core products of fp32 work
FLOAT64_MAX_HEAD_DIM = 64
PRECISIONS = ("float64", "tf32x3", "bf16x3", "ieee")
CHUNK_SIZES = (16, 32, 64)


class ChainLayout(NamedTuple):
    """Where the sequences of a packed call lie, as device tensors sized from shapes only (no host read).

    ``cu`` ``[N + 1]`` int64 offsets; ``chunk_first`` ``[N]`` the first per-chunk checkpoint row of each sequence;
    ``n_checkpoints`` a host upper bound of the number of chunks (``NT // C + N``: each sequence adds at most one
    ragged chunk), what the checkpoint buffer is allocated with; ``C`` the chunk size."""

    cu: torch.Tensor
    chunk_first: torch.Tensor
    n_checkpoints: int
    C: int


def chain_layout(cu_seqlens: torch.Tensor | None, B: int, T: int, C: int, device) -> ChainLayout:
    """The :class:`ChainLayout` of ``B`` sequences of ``T`` tokens, or of the packed ``cu_seqlens`` (B = 1).

    Only device-side arithmetic on ``cu_seqlens``: its values are never read on the host."""
    if C not in CHUNK_SIZES or isinstance(C, bool):
        raise ValueError(f"the chain kernels run chunk sizes {CHUNK_SIZES}, got C={C!r}")
    if cu_seqlens is None:
        n_chunks = -(-T // C)
        cu = torch.arange(B + 1, device=device, dtype=torch.int64) * T
        first = torch.arange(B, device=device, dtype=torch.int64) * n_chunks
        return ChainLayout(cu, first, B * n_chunks, C)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    N = cu.numel() - 1
    counts = torch.div(cu[1:] - cu[:-1] + (C - 1), C, rounding_mode="floor")
    first = torch.cumsum(counts, 0) - counts
    return ChainLayout(cu, first, (B * T) // C + N, C)


def _check_packed(**xs):
    ref = None
    for name, x in xs.items():
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a packed [NT, H', ·] tensor, got {getattr(x, 'shape', type(x).__name__)}")
        if ref is None:
            ref = (name, x.shape[:2], x.device)
        elif x.shape[:2] != ref[1] or x.device != ref[2]:
            raise ValueError(f"{name} must share {ref[0]}'s [NT, H'] = {tuple(ref[1])} and device, got "
                             f"{tuple(x.shape)} on {x.device}")


def default_precision(dtype: torch.dtype, D: int) -> str:
    """The chain kernels' precision (:data:`PRECISIONS`) for inputs of ``dtype`` and key dim ``D``: chosen
    statically, by dtype and shape, never by reading the data (no host sync)."""
    if dtype == torch.float64:
        return "ieee"
    return FP32_PRECISION if dtype == torch.float32 and D <= FLOAT64_MAX_HEAD_DIM else HALF_PRECISION


def kernel_arithmetic(work: torch.dtype, prec: str | None, inputs: torch.dtype, D: int) -> tuple[torch.dtype, str]:
    """``(the dtype the kernels compute in, their product precision PREC)`` for the caller's working dtype
    ``work`` (fp32 or float64), ``prec`` (None: :func:`default_precision` of the ``inputs`` dtype and ``D``)."""
    if work == torch.float64:
        return torch.float64, "ieee"
    prec = default_precision(inputs, D) if prec is None else prec
    if prec not in PRECISIONS:
        raise ValueError(f"prec must be one of {PRECISIONS}, got {prec!r}")
    if prec == "float64":
        return torch.float64, "ieee"
    return work, prec


def _exact_inputs(q, k, v, prec: str) -> bool:
    """Whether q, k, v hold values the high part of a split product represents exactly (their low part is zero,
    so the kernels skip its products): bf16 inputs (bf16 ⊂ TF32 ⊂ fp32), or fp16 with TF32 parts."""
    dts = {q.dtype, k.dtype, v.dtype}
    return dts == {torch.bfloat16} or (dts == {torch.float16} and prec == "tf32x3")


def launch_options(D: int, MV: int, C: int) -> dict:
    """The launch constants of the chain kernels for key dim ``D``, value dim ``MV``, chunk ``C``: ``BD``, ``BMV``
    (padded to a power of two ≥ 16), ``num_warps`` (8 from C = 32: the C×D tiles of a 32-token chunk take 8 warps'
    registers) and ``num_stages`` = 1 (software-pipelining the chunk loop would hold two chunks' loads: compiled
    for sm_90 it only adds registers).  One place for the wrappers and the compile check
    (``benchmarks/gpu.py --compile-only``)."""
    from .triton_support import next_pow2

    for name, x in (("D", D), ("MV", MV), ("C", C)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be a positive int, got {x!r}")
    if D > CHAIN_MAX_HEAD_DIM:
        raise ValueError(f"the chain kernels hold P on chip for key dims D = 1..{CHAIN_MAX_HEAD_DIM}, got D={D}")
    return dict(BD=max(16, next_pow2(D)), BMV=max(16, next_pow2(MV)), num_warps=8 if C >= 32 else 4, num_stages=1)


class ChainForward(NamedTuple):
    """What :func:`chain_forward` returns (packed, ``NT`` tokens, ``H'`` heads): the mean pass's inputs ``w``
    (``βU``), ``kw`` (``L⁻¹K̃``), ``vu`` (``L⁻¹V``) in ``out_dtype``, ``g`` (chunk-local cumulative log-decay, the
    working dtype), the variance (None unless asked), the final covariance ``P`` ``[N, H', D, D]``, the per-chunk
    checkpoints (None unless ``save_p``): the covariance at each chunk's start and the factors of its ``S``
    (``M = L⁻¹`` and ``d``, ``[·, H', C, C + 1]``, what the backward would otherwise factor again), and the
    device-side ``failed`` flag ``[N, H']`` (not read here)."""

    w: torch.Tensor
    kw: torch.Tensor
    vu: torch.Tensor
    g: torch.Tensor
    var: torch.Tensor | None
    P: torch.Tensor
    checkpoints: torch.Tensor | None
    factors: torch.Tensor | None
    failed: torch.Tensor


def chain_forward(q, k, v, r2, ell2, log_alpha, P0, layout: ChainLayout, *, want_var: bool, save_p: bool,
                  out_dtype: torch.dtype, prec: str | None = None) -> ChainForward:
    """One launch of :func:`chain_forward_kernel`, grid (sequences, heads).

    Packed inputs (any float dtype; the kernel casts on load): q, k ``[NT, H', D]``, v ``[NT, H', m]``, r2, ell2
    ``[NT, H']``, log_alpha ``[NT, H', 1]`` (scalar decay) or ``[NT, H', D]``; ``P0`` ``[N, H', D, D]`` in the
    working dtype (fp32, or float64 for float64 work), which the outputs but ``checkpoints`` are returned in.
    ``prec``: the arithmetic of fp32 work (:data:`PRECISIONS`; None: :func:`default_precision` of q's dtype and D;
    float64 work always runs IEEE); with ``"float64"`` the checkpoints are float64.  Reads nothing on the host.
    """
    _check_packed(q=q, k=k, v=v, log_alpha=log_alpha)
    NT, Hf, D = k.shape
    MV = v.shape[-1]
    N = layout.cu.numel() - 1
    work = P0.dtype
    if work not in (torch.float32, torch.float64):
        raise TypeError(f"P0 must be float32 or float64 (the working dtype), got {work}")
    if tuple(P0.shape) != (N, Hf, D, D):
        raise ValueError(f"P0 must be [N={N}, H'={Hf}, D={D}, D], got {tuple(P0.shape)}")
    diag = log_alpha.shape[-1] > 1
    tiles = launch_options(D, MV, layout.C)
    dev = k.device
    kdt, PREC = kernel_arithmetic(work, prec, q.dtype, D)
    w = torch.empty(NT, Hf, D, dtype=out_dtype, device=dev)
    kw = torch.empty(NT, Hf, D, dtype=out_dtype, device=dev)
    vu = torch.empty(NT, Hf, MV, dtype=out_dtype, device=dev)
    g = torch.empty(NT, Hf, D if diag else 1, dtype=work, device=dev)
    var = torch.empty(NT, Hf, dtype=work, device=dev) if want_var else g
    P = torch.empty(N, Hf, D, D, dtype=work, device=dev)
    ck = torch.empty(layout.n_checkpoints, Hf, D, D, dtype=kdt, device=dev) if save_p else P
    fck = torch.empty(layout.n_checkpoints, Hf, layout.C, layout.C + 1, dtype=kdt, device=dev) if save_p else P
    failed = torch.zeros(N, Hf, dtype=torch.int32, device=dev)
    if N > 0 and Hf > 0:
        la = log_alpha.contiguous() if diag else log_alpha[..., 0].contiguous()
        chain_forward_kernel[(N, Hf)](
            q.contiguous(), k.contiguous(), v.contiguous(), r2.contiguous(), ell2.contiguous(), la, layout.cu,
            layout.chunk_first, P0.to(kdt).contiguous(), w, kw, vu, g, var, P, ck, fck, failed,
            H=Hf, D=D, MV=MV, C=layout.C, DIAG=diag, WANT_VAR=want_var, SAVE_P=save_p,
            KX=_exact_inputs(q, k, v, PREC), PREC=PREC, INTERP=_interpreting(), **tiles,
        )
    return ChainForward(w, kw, vu, g, var if want_var else None, P, ck if save_p else None,
                        fck if save_p else None, failed != 0)


def chain_backward(q, k, v, r2, ell2, log_alpha, layout: ChainLayout, checkpoints: torch.Tensor,
                   factors: torch.Tensor | None = None, *, dw, dkw, dvu, dvar=None, dP=None, prec: str | None = None,
                   work: torch.dtype | None = None, w=None, kw=None) -> tuple[ScanGrads, torch.Tensor]:
    """One launch of :func:`chain_backward_kernel`: the adjoint of :func:`chain_forward` on the same inputs.

    ``checkpoints``, ``factors``: the forward's per-chunk covariances and factors (``save_p=True``:
    :attr:`ChainForward.checkpoints`, :attr:`ChainForward.factors`); ``w``, ``kw``: the forward's ``w`` and ``kw``
    (optional), read instead of formed again where they are in the kernels' working dtype and the inputs are not
    fp32 (``U = W/β`` adds one rounding of ``W``, which fp32 inputs' gradients show).  Adjoints of the forward's
    outputs:
    ``dw``, ``dkw`` ``[NT, H', D]``, ``dvu`` ``[NT, H', m]`` (any float dtype), ``dvar`` ``[NT, H']`` or None,
    ``dP`` ``[N, H', D, D]`` (the final covariance's) or None; ``prec`` and ``work`` (the working dtype, None: the
    checkpoints') as the forward's.  The adjoint of ``g`` (the mean pass's log-decay) is not taken here: it is the
    log-decay's gradient already and adds to the returned ``log_alpha``.

    Returns ``(ScanGrads, failed [N, H'])``, as the segment scan's backward: the gradients of the chain's inputs
    (packed, in ``work``; ``q`` None without a variance adjoint; ``P0`` symmetrised) and the device-side
    flags of the factorisations that met a pivot that was not positive."""
    _check_packed(q=q, k=k, v=v, log_alpha=log_alpha, dw=dw, dkw=dkw, dvu=dvu)
    NT, Hf, D = k.shape
    MV = v.shape[-1]
    N = layout.cu.numel() - 1
    work = checkpoints.dtype if work is None else work
    kdt, PREC = kernel_arithmetic(work, prec, q.dtype, D)
    if checkpoints.dtype != kdt:
        raise ValueError(f"checkpoints must be {kdt} for prec={prec!r}, {work} work and {q.dtype} inputs (what "
                         f"chain_forward saves), got {checkpoints.dtype}")
    if tuple(checkpoints.shape) != (layout.n_checkpoints, Hf, D, D):
        raise ValueError(f"checkpoints must be [{layout.n_checkpoints}, {Hf}, {D}, {D}], got "
                         f"{tuple(checkpoints.shape)}")
    C = layout.C
    if not isinstance(factors, torch.Tensor) or factors.dtype != kdt or tuple(factors.shape) != (
            layout.n_checkpoints, Hf, C, C + 1):
        raise ValueError(f"factors must be a {kdt} [{layout.n_checkpoints}, {Hf}, {C}, {C + 1}] tensor (what "
                         f"chain_forward saves), got {getattr(factors, 'dtype', None)} "
                         f"{tuple(getattr(factors, 'shape', ()))}")
    diag = log_alpha.shape[-1] > 1
    tiles = launch_options(D, MV, layout.C)
    dev = k.device
    want_var = dvar is not None
    out = dict(q=torch.zeros(NT, Hf, D, dtype=work, device=dev) if want_var else None,
               k=torch.zeros(NT, Hf, D, dtype=work, device=dev), v=torch.zeros(NT, Hf, MV, dtype=work, device=dev),
               r2=torch.zeros(NT, Hf, dtype=work, device=dev), ell2=torch.zeros(NT, Hf, dtype=work, device=dev),
               log_alpha=torch.zeros(NT, Hf, D if diag else 1, dtype=work, device=dev))
    dP0 = torch.zeros(N, Hf, D, D, dtype=work, device=dev)
    failed = torch.zeros(N, Hf, dtype=torch.int32, device=dev)
    if dP is not None and tuple(dP.shape) != (N, Hf, D, D):
        raise ValueError(f"dP must be [N={N}, H'={Hf}, D={D}, D], got {tuple(dP.shape)}")
    for name, x in (("w", w), ("kw", kw)):
        if x is not None and (not isinstance(x, torch.Tensor) or tuple(x.shape) != (NT, Hf, D)):
            raise ValueError(f"{name} must be the forward's [NT={NT}, H'={Hf}, D={D}] {name}, got "
                             f"{tuple(getattr(x, 'shape', ())) or type(x).__name__}")
    # read where they hold the forward's values to the working precision, but not for fp32 inputs: there the one
    # rounding of W in U = W/β shows in the gradients' error (docs/kernels.md "Precision"); below 16-bit inputs'
    # rounding and float64's, it does not
    read_wkw = (w is not None and kw is not None and w.dtype == kdt and kw.dtype == kdt
                and q.dtype != torch.float32)
    if N > 0 and Hf > 0:
        la = log_alpha.contiguous() if diag else log_alpha[..., 0].contiguous()
        chain_backward_kernel[(N, Hf)](
            q.contiguous(), k.contiguous(), v.contiguous(), r2.contiguous(), ell2.contiguous(), la, layout.cu,
            layout.chunk_first, checkpoints, factors.contiguous(), w.contiguous() if read_wkw else dw,
            kw.contiguous() if read_wkw else dkw, dw.contiguous(), dkw.contiguous(), dvu.contiguous(),
            dvar.contiguous() if want_var else r2, dP.contiguous() if dP is not None else dP0,
            out["q"] if want_var else dP0, out["k"], out["v"], out["r2"], out["ell2"], out["log_alpha"], dP0, failed,
            H=Hf, D=D, MV=MV, C=layout.C, DIAG=diag, WANT_VAR=want_var, HAS_DPT=dP is not None, READ_WKW=read_wkw,
            KX=_exact_inputs(q, k, v, PREC), PREC=PREC, INTERP=_interpreting(), **tiles,
        )
    return ScanGrads(P0=dP0, **out), failed != 0
