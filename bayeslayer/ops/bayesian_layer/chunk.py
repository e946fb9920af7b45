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
from .covariance import covariance_prework, covariance_step
from .dynamics import ChunkDynamics, bmm_add, unbind_chunks, unit_lower_inverse
from .prepare import FilterInputs, FilterOutput, prepare_inputs
from .write_models import WriteModel, get_write_model


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
    whole block at once; the loop over chunks runs :func:`~bayeslayer.ops.bayesian_layer.covariance.covariance_step`
    (the P-dependent matmuls and the C×C Cholesky).
    """
    P0_max = torch.diagonal(P.detach(), dim1=-2, dim2=-1).amax()  # for the error message only
    b, kt, NBk, base, BC = covariance_prework(dyn, k, r2, ell2)
    if q is not None:
        qt = dyn.adj(q)
        qBq = dyn.noise_quad(ell2, q, b)
    ws, variances, infos = [], [], []
    kt, base, NBk, BC = unbind_chunks(kt, base, NBk, BC)
    if q is not None:
        q, qt, qBq = unbind_chunks(q, qt, qBq)
    for i, d in enumerate(dyn.unbind()):
        st = covariance_step(d, kt[i], NBk[i], base[i], BC[i], P, q=q[i] if q is not None else None,
                             qt=qt[i] if q is not None else None, qBq=qBq[i] if q is not None else None)
        P = st["P"]
        infos.append(st["info"])
        ws.append(st["W"])
        if q is not None:
            variances.append(st["var"])
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
    w_end_, decay_ = unbind_chunks(w_end, decay)
    if erase:
        Vp_, Kp_ = unbind_chunks(Vp, Kp)
    else:
        v_ = v.unbind(0)
    states, Es = [], []
    for i in range(q.shape[0]):
        states.append(M)
        if erase:
            E = bmm_add(Vp_[i], Kp_[i], M, alpha=-1.0)
            Es.append(E)
        else:
            E = v_[i]
        M = bmm_add(dyns[i].end_rows(M) if decay is None else M * decay_[i], w_end_[i], E)
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
    A write model with a filter of its own (:attr:`~bayeslayer.ops.WriteModel.own_filter`, e.g.
    :class:`~bayeslayer.ops.bayesian_layer.lowrank.LowRankWrite`) runs that filter's chunked path.
    """
    C = check_chunk_size(chunk_size)
    write = get_write_model(write)
    if write.own_filter:  # e.g. the low-rank covariance (lowrank.py): a filter of its own
        return write.chunk(q, k, v, r2=r2, ell2=ell2, lam=lam, gain=gain, alpha=alpha, theta=theta, p0=p0,
                           initial_state=initial_state, output_final_state=output_final_state,
                           return_variance=return_variance, chunk_size=C, cu_seqlens=cu_seqlens)
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
