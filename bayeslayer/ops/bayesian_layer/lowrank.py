"""Low-rank-plus-diagonal Bayesian Layer: the key-space precision kept as ``diag(υ) + W Wᵀ``.

The dense Bayesian Layer carries a ``D×D`` covariance per head and group (docs/theory.md §2.1).  This
design keeps the *precision* (information) matrix instead, in the diagonal-plus-low-rank form
of LoFi (Chang, Duran-Martin, Shestopaloff, Jones, Murphy, arXiv:2305.19535)::

    Λ_t = P_t⁻¹ = diag(υ_t) + W_t W_tᵀ          υ_t > 0 [D],  W_t [D, r]      (D·(r + 1) floats)

Why the precision, not the covariance: a Kalman write *adds* ``k kᵀ/r²`` to the precision, so
the write is exact in this form and raises the rank by exactly one; and the BL predict step
``P̄ = A P Aᵀ + ℓ² I`` is *also* exact in it for diagonal ``A`` (identity, scalar, diagonal
dynamics), by the Woodbury identity (LoFi's predict step, here with a diagonal ``A``)::

    Z   = A² + ℓ² diag(υ)                                          (diagonal)
    ῡ   = υ / Z                                                     elementwise
    W̄   = A Z⁻¹ W L⁻ᵀ,    L Lᵀ = I_r + Wᵀ (ℓ² Z⁻¹) W                (r×r Cholesky)

so that ``diag(ῡ) + W̄ W̄ᵀ = (A Λ⁻¹ A + ℓ² I)⁻¹`` exactly.  (A covariance kept as ``diag + U Uᵀ``
cannot lower the variance along a written direction at all, and ``diag − U Uᵀ`` with the dropped
part moved into the diagonal can lose positive definiteness; the precision form has neither
problem.)  Per token, with ``P̄ = (diag(ῡ) + W̄W̄ᵀ)⁻¹`` applied by Woodbury in O(D r²)::

    u = P̄ k ;  β = 1/(r² + kᵀu) ;  M = A M + β u (v − (A M)ᵀ k)ᵀ       the BL write, unchanged
    W̃ = [W̄, k/√r²]                                                   exact posterior precision
    project W̃ (D×(r+1)) back to r columns                             the only approximation
    o = Mᵀ q ;  variance = 1 + qᵀ P q ;  gain = kᵀ β u                 P from the projected state

**The projection.**  Let ``G = W̃ᵀ diag(ῡ)⁻¹ W̃`` (the write information whitened by the diagonal)
and ``e`` its eigenvector of smallest eigenvalue.  The direction ``x = W̃ e`` is dropped:
``W ← W̃ E`` with ``E`` an orthonormal basis of ``e⊥`` (a Householder reflection), so
``W Wᵀ = W̃ W̃ᵀ − x xᵀ``.  Two rules for the dropped part (``projection=``):

``"conservative"`` (default): drop it; ``υ ← ῡ``.  Among all rank-``r`` updates of the fixed
    diagonal this is the optimal one in the Förstner/KL sense (Spantini et al., "Optimal low-rank
    approximations of Bayesian linear inverse problems", SIAM J. Sci. Comput. 2015: truncate the
    generalized eigenproblem of the data term against the prior precision).  **Guarantee: never
    overconfident** — the projected precision is ``⪯`` the unprojected one, and both the exact
    predict map and the exact update map are monotone in the Loewner order, so by induction
    ``P_approx,t ⪰ P_exact,t`` at every step: the variance of any query is ≥ the dense BL's,
    ``1/β ≥ r²`` and the gain lies in ``[0, 1)``.  ``r = D`` (or, with isotropic ``υ`` — identity
    or scalar dynamics from ``P_0 = p0 I`` — ``r ≥`` the dimension of the span of the keys) drops
    only null directions and equals dense BL exactly.  ``r = 0`` keeps no written information at
    all: ``P̄_t = diag(ῡ_t)⁻¹`` is the prior propagated by the dynamics alone, i.e. the
    covariance-reset family with ``λ_t = α_t² λ_{t−1} + ℓ_t²``, ``λ_0 = p0`` (a Delta/GDN rule whose
    reset prior follows the process noise).  A Loewner-conservative projection onto a diagonal
    cannot keep anything of a write whose key has two or more non-zero channels (a diagonal
    ``Δ ⪯ k kᵀ`` must vanish on the key's support), so no conservative ``r = 0`` can be the
    diagonal-covariance ablation.
``"lofi"``: LoFi's rule — the truncation is an SVD of ``W̃`` itself (``G = W̃ᵀW̃``) and the diagonal
    of the dropped part is moved into the diagonal, ``υ ← ῡ + x⊙x``: the diagonal of the
    precision is preserved exactly and ``Λ`` stays positive definite, but the approximation is
    *neither* above nor below the exact filter in the Loewner order (``diag(xxᵀ) − xxᵀ`` is
    indefinite).  ``r = 0`` is then the diagonal-*precision* (mean-field) filter
    ``υ ← υ/(α² + ℓ²υ) + k⊙k/r²``, ``u = k/ῡ`` — not the diagonal-covariance ablation either (that
    one keeps ``diag(P)``, this one ``diag(P⁻¹)``).

Rotation dynamics are refused: a rotation does not keep ``A diag(υ)⁻¹ Aᵀ`` diagonal.

Training: the covariance pass runs token by token (O(D r² + r³) per token, an
``(r+1)×(r+1)`` eigendecomposition among it); the mean pass given ``w_t = β_t u_t`` is the same
generalized delta rule as dense BL's and runs chunked (:func:`lowrank_chunk`, exact for this
approximation).  No chunked covariance pass exists for it: the projection after every token is
not associative.  Gradients through the eigenvector use only the gaps to the smallest
eigenvalue and are set to zero across (numerically) degenerate gaps, where the dropped
precision ``x xᵀ`` does not depend on the choice of the eigenvector.

State per head and group: ``(M [D, m], F [D, r + 1])`` with ``F[:, 0] = υ`` and ``F[:, 1:] = W``.
"""

from __future__ import annotations

import numbers

import torch

from ..utils.validation import check_chunk_size, check_tensor
from .chunk import Chunked, cat_blocks, from_chunks, mean_pass, pad_time, run_packed, to_chunks
from .covariance import sym
from .prepare import FilterInputs, FilterOutput, Prepared, prepare
from .transition import apply_transition
from .write_models import LOWRANK, WriteModel, initial_bl_state

PROJECTIONS = ("conservative", "lofi")


# -- argument checks ----------------------------------------------------------------------------------
def check_rank(rank, key_dim: int | None = None) -> int:
    """``rank`` as an int in ``[0, key_dim]``; a clear error naming ``rank`` otherwise."""
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
        raise TypeError(f"rank must be an integer (the number of low-rank precision columns), "
                        f"got {type(rank).__name__} {rank!r}")
    rank = int(rank)
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if key_dim is not None and rank > key_dim:
        raise ValueError(f"rank must be <= the key dim D = {key_dim}, got {rank}")
    return rank


def check_projection(projection) -> str:
    if projection not in PROJECTIONS:
        raise ValueError(f"projection must be one of {PROJECTIONS}, got {projection!r}")
    return projection


# -- the state ----------------------------------------------------------------------------------------
def initial_lowrank_state(batch_size: int, num_heads: int, key_dim: int, value_dim: int, *, rank: int,
                          p0: float = 1.0, groups: int = 1, dtype: torch.dtype = torch.float32,
                          device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The prior state ``(M_0 = 0, F_0)``: ``υ_0 = 1/p0``, ``W_0 = 0``.

    Returns ``M [B, H, D, m]`` and ``F [B, H, D, r + 1]`` (``[B, H, G, D, r + 1]`` when ``groups > 1``).
    """
    # validates sizes, p0 and dtype in one place
    M, _ = initial_bl_state(batch_size, num_heads, key_dim, 1, p0=p0, groups=1, dtype=dtype,
                            device=torch.device("meta"))
    for name, val in (("value_dim", value_dim), ("groups", groups)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} must be a positive integer, got {val!r}")
    if value_dim % groups != 0:
        raise ValueError(f"value_dim={value_dim} is not divisible by groups={groups}")
    rank = check_rank(rank, key_dim)
    M = torch.zeros(batch_size, num_heads, key_dim, value_dim, dtype=dtype, device=device)
    lead = (batch_size, num_heads) if groups == 1 else (batch_size, num_heads, groups)
    F = torch.zeros(*lead, key_dim, rank + 1, dtype=dtype, device=device)
    F[..., 0] = 1.0 / float(p0)
    return M, F


def lowrank_covariance(F: torch.Tensor) -> torch.Tensor:
    """The dense covariance ``P = (diag(υ) + W Wᵀ)⁻¹`` of a factor ``F [..., D, r + 1]`` (diagnostics)."""
    F = check_tensor("F", F)
    if F.dim() < 2:
        raise ValueError(f"F must be [..., D, r + 1], got shape {tuple(F.shape)}")
    ups, W = F[..., 0], F[..., 1:]
    return torch.linalg.inv(torch.diag_embed(ups) + W @ W.transpose(-1, -2))


def _check_factor(F, dims, G: int, rank: int, name: str) -> torch.Tensor:
    """``F [B, H, D, r+1]`` or ``[B, H, G, D, r+1]`` → folded ``[B, H·G, D, r+1]`` in the compute dtype."""
    F = check_tensor(f"{name}[1] (F)", F, device=dims.device)
    B, H, D = dims.B, dims.H, dims.D
    want = (B, H, D, rank + 1) if G == 1 else (B, H, G, D, rank + 1)
    if G == 1 and tuple(F.shape) == (B, H, 1, D, rank + 1):
        F = F[:, :, 0]
    if tuple(F.shape) != want:
        raise ValueError(
            f"{name}[1] (F = [υ, W]) must be {list(want)} for rank={rank} "
            f"(low-rank precision factor), got {tuple(F.shape)}"
        )
    if bool((F[..., 0] <= 0).any()):
        raise ValueError(f"{name}[1] (F): the diagonal precision υ = F[..., 0] must be > 0")
    return F.reshape(B, H * G, D, rank + 1).to(dims.cdtype)


def _prepare(q, k, v, *, rank, r2, ell2, alpha, theta, p0, initial_state, single_step):
    if theta is not None:
        raise ValueError("the low-rank design does not support rotation dynamics (theta): a rotation does "
                         "not keep A diag(υ)⁻¹ Aᵀ diagonal; use identity, scalar or diagonal alpha")
    # every shape/value check of the dense BL, with the prior built as a dense p0·I view (no copy)
    pr: Prepared = prepare(q, k, v, write="bayes", r2=r2, ell2=ell2, alpha=alpha, theta=None, p0=p0,
                           initial_state=None, single_step=single_step)
    rank = check_rank(rank, pr.dims.D)
    name = "state" if single_step else "initial_state"
    if initial_state is None:
        ups0 = 1.0 / torch.diagonal(pr.P0, dim1=-2, dim2=-1)
        F0 = torch.cat([ups0[..., None], ups0.new_zeros(*ups0.shape, rank)], -1)
        return pr, rank, F0
    if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
        raise TypeError(f"{name} must be a tuple (M, F), got {type(initial_state).__name__}")
    M, F = initial_state
    d = pr.dims
    M = check_tensor(f"{name}[0] (M)", M, device=d.device)
    if tuple(M.shape) != (d.B, d.H, d.D, d.m):
        raise ValueError(f"{name}[0] (M) must be [B, H, D, m] = {(d.B, d.H, d.D, d.m)}, got {tuple(M.shape)}")
    from .groups import fold_state_mean

    pr.M0 = fold_state_mean(M.to(d.cdtype), pr.G)
    return pr, rank, _check_factor(F, d, pr.G, rank, name)


# -- the smallest eigenvector, with a backward that ignores degenerate gaps ---------------------------------
class _SmallestEigvec(torch.autograd.Function):
    """``e``: unit eigenvector of the smallest eigenvalue of a symmetric ``G [..., n, n]``.

    ``de = Σ_{i≠0} v_i (v_iᵀ dG e)/(λ_0 − λ_i)``; terms whose gap is below ``tol·max|λ|`` are set to 0
    (there the dropped precision ``(W̃e)(W̃e)ᵀ`` does not depend on which eigenvector is picked).
    """

    generate_vmap_rule = True  # plain tensor code both ways: torch.func.vmap batches it

    @staticmethod
    def forward(G):
        lam, V = torch.linalg.eigh(G)
        return V[..., :, 0], lam, V

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, lam, V = output
        ctx.mark_non_differentiable(lam, V)
        ctx.save_for_backward(lam, V)

    @staticmethod
    def backward(ctx, ge, _glam=None, _gV=None):
        lam, V = ctx.saved_tensors
        e = V[..., :, 0]
        gap = lam[..., :1] - lam  # λ_0 − λ_i ≤ 0
        tol = (1e-6 if lam.dtype == torch.float32 else 1e-12) * lam.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        c = (V.transpose(-1, -2) @ ge[..., None])[..., 0]  # v_iᵀ ḡ
        safe = gap.abs() > tol
        safe[..., 0] = False  # i ≠ 0 only
        f = torch.where(safe, c / torch.where(safe, gap, torch.ones_like(gap)), torch.zeros_like(c))
        g = (V @ f[..., None]) @ e[..., None, :]
        return sym(g)


def _drop_one(Wt: torch.Tensor, ups_bar: torch.Tensor, projection: str):
    """Project ``W̃ [.., D, r+1]`` to ``[.., D, r]``; returns ``(W, x)`` with ``W Wᵀ = W̃W̃ᵀ − x xᵀ``."""
    n = Wt.shape[-1]
    if projection == "conservative":
        Gm = Wt.transpose(-1, -2) @ (Wt / ups_bar[..., None])
    else:
        Gm = Wt.transpose(-1, -2) @ Wt
    Gm = sym(Gm)
    e = _SmallestEigvec.apply(Gm)[0]  # [.., n]
    x = (Wt @ e[..., None])[..., 0]
    # Householder H = I − 2 w wᵀ/(wᵀw), w = e + s ê_n, maps e to −s ê_n: its first n−1 columns span e⊥
    s = torch.where(e[..., -1:] >= 0, 1.0, -1.0).to(e.dtype)
    w = torch.cat([e[..., :-1], e[..., -1:] + s], -1)
    c = 2.0 / (w * w).sum(-1, keepdim=True)  # wᵀw = 2 + 2|e_n| ≥ 2
    W = Wt[..., : n - 1] - (c * (Wt @ w[..., None])[..., 0])[..., :, None] * w[..., None, : n - 1]
    return W, x


# -- one token of the covariance pass -------------------------------------------------------------------
def _woodbury_apply(ups: torch.Tensor, W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``(diag(υ) + W Wᵀ)⁻¹ x`` for ``x [.., D]`` in O(D r²)."""
    s = x / ups
    if W.shape[-1] == 0:
        return s
    Y = W / ups[..., None]
    S = torch.eye(W.shape[-1], dtype=W.dtype, device=W.device) + W.transpose(-1, -2) @ Y
    Lc = torch.linalg.cholesky(S)
    t = torch.cholesky_solve((W.transpose(-1, -2) @ s[..., None]), Lc)[..., 0]
    return s - (Y @ t[..., None])[..., 0]


def _predict(ups, W, log_alpha_t, ell2_t, kind: str):
    """``(diag(υ) + WWᵀ)`` → ``(A (diag(υ) + WWᵀ)⁻¹ A + ℓ² I)⁻¹`` in the same form, exactly."""
    if kind == "identity":
        a = torch.ones_like(ups)
    else:
        a = torch.exp(log_alpha_t).expand_as(ups)  # [B,H,1] or [B,H,D]
    q = ell2_t[..., None]
    z = a * a + q * ups
    ups_bar = ups / z
    if W.shape[-1] == 0:
        return ups_bar, W
    X = W.transpose(-1, -2) @ (W * (q / z)[..., None])
    Lc = torch.linalg.cholesky(torch.eye(W.shape[-1], dtype=W.dtype, device=W.device) + X)
    Wz = W * (a / z)[..., None]
    # W̄ = Wz L⁻ᵀ: solve X Lᵀ = Wz
    W_bar = torch.linalg.solve_triangular(Lc.transpose(-1, -2), Wz, upper=True, left=False)
    return ups_bar, W_bar


def _cov_step(ups, W, k_t, r2_t, ell2_t, log_alpha_t, kind: str, projection: str):
    """One token: predict, the write key ``u = P̄k`` and ``β``, the exact update and the projection."""
    ups_bar, W_bar = _predict(ups, W, log_alpha_t, ell2_t, kind)
    u = _woodbury_apply(ups_bar, W_bar, k_t)
    beta = 1.0 / (r2_t[..., None] + (k_t * u).sum(-1, keepdim=True))  # [B,H,1]
    kw = k_t / torch.sqrt(r2_t)[..., None]
    if W.shape[-1] == 0:
        x, W_new = kw, W_bar
    else:
        W_new, x = _drop_one(torch.cat([W_bar, kw[..., None]], -1), ups_bar, projection)
    ups_new = ups_bar + x * x if projection == "lofi" else ups_bar
    return u, beta, ups_new, W_new


def _variance(ups, W, q_t):
    return 1.0 + (q_t * _woodbury_apply(ups, W, q_t)).sum(-1)


def _scan(pr: Prepared, F0: torch.Tensor, projection: str, *, mean: bool, want_var: bool):
    """The loop over tokens.  ``mean``: also run the mean recursion (the oracle); otherwise
    return the write keys ``β u`` for the chunked mean pass."""
    kind = pr.dyn.kind
    B, T, H, D = pr.q.shape
    ups, W = F0[..., 0], F0[..., 1:]
    M = pr.M0
    q_, k_, v_, r2_, ell2_, la_ = (
        x.unbind(1) if x is not None else None
        for x in (pr.q, pr.k, pr.v, pr.r2, pr.ell2, pr.dyn.log_alpha)
    )
    outs, ws, variances, gains = [], [], [], []
    for t in range(T):
        la_t = la_[t] if la_ is not None else None
        k_t = k_[t]
        u, beta, ups, W = _cov_step(ups, W, k_t, r2_[t], ell2_[t], la_t, kind, projection)
        gains.append((beta * (k_t * u).sum(-1, keepdim=True))[..., 0])
        if mean:
            M_bar = apply_transition(M, kind, la_t, None)
            resid = v_[t] - torch.einsum("bhdm,bhd->bhm", M_bar, k_t)
            M = M_bar + (beta * u)[..., :, None] * resid[..., None, :]
            outs.append(torch.einsum("bhdm,bhd->bhm", M, q_[t]))
        else:
            ws.append(beta * u)
        if want_var:
            variances.append(_variance(ups, W, q_[t]))
    empty = pr.q.new_zeros(B, 0, H)
    o = (torch.stack(outs, 1) if outs else pr.v.new_zeros(pr.v.shape)) if mean else None
    w = (torch.stack(ws, 1) if ws else pr.k.new_zeros(pr.k.shape)) if not mean else None
    var = (torch.stack(variances, 1) if variances else empty) if want_var else None
    gain = torch.stack(gains, 1) if gains else empty
    return o, w, var, gain, M, torch.cat([ups[..., None], W], -1)


def _finish(pr: Prepared, o, var, gain, M, F, output_final_state: bool) -> FilterOutput:
    out = pr.finish(o, var, gain, M, None, output_final_state)
    if not output_final_state:
        return out
    B, HG, D, n = F.shape
    G = pr.G
    F = F if G == 1 else F.reshape(B, HG // G, G, D, n)
    return FilterOutput(out.o, out.variance, out.gain, (out.state[0], F))


# -- public ops -----------------------------------------------------------------------------------------
def lowrank_recurrent(q, k, v, *, rank: int, r2, ell2, alpha=None, theta=None, p0=1.0,
                      projection: str = "conservative", initial_state=None, output_final_state: bool = False,
                      single_step: bool = False) -> FilterOutput:
    """The low-rank-plus-diagonal Bayesian Layer, token by token (the oracle; module docstring).

    Args:
        q, k: ``[B, T, H, D]``; v: ``[B, T, H, m]`` (``single_step``: no T axis).
        rank: ``r`` in ``[0, D]``, the number of low-rank precision columns.
        r2: observation noise ``[B, T, H]`` or ``[B, T, H, G]``; ell2: process noise ``[B, T, H]``.
        alpha: ``None``, ``[B, T, H]`` or ``[B, T, H, D]`` in (0, 1]; theta: refused.
        p0: prior variance (number or ``[H]``), ``υ_0 = 1/p0``, ``W_0 = 0``.
        projection: ``"conservative"`` (never overconfident) or ``"lofi"`` (diagonal-preserving).
        initial_state: ``(M [B, H, D, m], F [B, H, D, r+1] or [B, H, G, D, r+1])``.

    Returns:
        :class:`~bayeslayer.ops.FilterOutput` ``(o, variance [B, T, H, G], gain [B, T, H, G], state)``.
    """
    projection = check_projection(projection)
    pr, rank, F0 = _prepare(q, k, v, rank=rank, r2=r2, ell2=ell2, alpha=alpha, theta=theta, p0=p0,
                            initial_state=initial_state, single_step=single_step)
    o, _, var, gain, M, F = _scan(pr, F0, projection, mean=True, want_var=True)
    return _finish(pr, o, var, gain, M, F, output_final_state)


def lowrank_chunk(q, k, v, *, rank: int, r2, ell2, alpha=None, theta=None, p0=1.0,
                  projection: str = "conservative", initial_state=None, output_final_state: bool = False,
                  return_variance: bool = False, chunk_size: int = 64, cu_seqlens=None) -> FilterOutput:
    """Training/prefill path: the covariance pass token by token, the mean pass chunked (WY/UT).

    Same arguments and results as :func:`lowrank_recurrent` (the variance only with
    ``return_variance``).  Exact for this approximation: the projection touches only the
    covariance pass, and given the write keys ``w_t = β_t u_t`` the mean recursion is the
    generalized delta rule of :func:`bayeslayer.ops.bayesian_layer.chunk.mean_pass`.
    ``cu_seqlens`` (``[N + 1]``, B = 1) runs N packed sequences, each from its own state (states then
    have N in place of B), as :func:`bayeslayer.ops.bayesian_layer.chunk.filter_chunk`.
    """
    C = check_chunk_size(chunk_size)
    if cu_seqlens is not None:
        def one(q, k, v, inputs, state):
            return lowrank_chunk(q, k, v, rank=rank, r2=inputs.r2, ell2=inputs.ell2, alpha=inputs.alpha,
                                 theta=inputs.theta, p0=p0, projection=projection, initial_state=state,
                                 output_final_state=True, return_variance=return_variance, chunk_size=C)

        return run_packed(one, q, k, v, FilterInputs(r2=r2, ell2=ell2, alpha=alpha, theta=theta), cu_seqlens,
                          initial_state=initial_state, output_final_state=output_final_state)
    projection = check_projection(projection)
    pr, rank, F0 = _prepare(q, k, v, rank=rank, r2=r2, ell2=ell2, alpha=alpha, theta=theta, p0=p0,
                            initial_state=initial_state, single_step=False)
    _, w, var, gain, _, F = _scan(pr, F0, projection, mean=False, want_var=return_variance)
    T = pr.dims.T
    M = pr.M0
    if T == 0:
        return _finish(pr, pr.v.new_zeros(pr.v.shape), var, gain, M, F, output_final_state)
    ch = Chunked(pr, C, need_noise=False)
    wch = to_chunks(pad_time(w, ch.pad), C)
    outs = []
    for s, e in ch.blocks():
        o, M = mean_pass(ch.dyn(s, e), ch.q[s:e], ch.k[s:e], ch.v[s:e], wch[s:e], M, erase=True)
        outs.append(o)
    o = from_chunks(cat_blocks(outs), T)
    return _finish(pr, o, var, gain, M, F, output_final_state)


# -- the write model ------------------------------------------------------------------------------------
class LowRankWrite(WriteModel):
    """The low-rank-plus-diagonal write model: precision ``diag(υ) + W Wᵀ`` of ``rank`` columns, projected
    with ``projection`` after every write (module docstring); the state is ``(M, F)``.

    A :class:`~bayeslayer.ops.bayesian_layer.write_models.WriteModel` like the general filter's, built with
    its rank: ``filter_recurrent``, ``filter_chunk``, the backend dispatch and ``DesignModel`` take it as
    ``write=`` and run its own filter (:meth:`recurrent`, :meth:`chunk`: PyTorch only, the Triton kernels
    implement write model ``bayes``).  Noise arguments: ``r2``, ``ell2`` (and ``p0``); ``lam``/``gain`` are
    refused, rotation dynamics too.

    >>> LowRankWrite(2).state_size(16, 8, 2) == 16 * 8 + 2 * 16 * 3
    True
    """

    name = LOWRANK
    has_covariance = True
    erase = True
    own_filter = True

    def __init__(self, rank: int, projection: str = "conservative") -> None:
        self.rank = check_rank(rank)
        self.projection = check_projection(projection)

    def check_config(self, *, rank=None, dynamics: str = "any") -> None:
        if rank is not None and check_rank(rank) != self.rank:
            raise ValueError(f"rank={rank!r} disagrees with this write model's rank {self.rank}")
        if dynamics == "rotation":
            raise ValueError("the lowrank write model does not support rotation dynamics")

    def state_size(self, key_dim: int, value_dim: int, groups: int = 1) -> int:
        return key_dim * value_dim + groups * key_dim * (check_rank(self.rank, key_dim) + 1)

    def initial_state(self, batch_size: int, num_heads: int, key_dim: int, value_dim: int, *, p0: float = 1.0,
                      groups: int = 1, dtype: torch.dtype = torch.float32, device=None):
        return initial_lowrank_state(batch_size, num_heads, key_dim, value_dim, rank=self.rank, p0=p0,
                                     groups=groups, dtype=dtype, device=device)

    def has_variance(self, lam_given: bool) -> bool:
        return True

    def _noise(self, lam, gain) -> None:
        for name, value in (("lam", lam), ("gain", gain)):
            if value is not None:
                raise ValueError(f"write model 'lowrank' derives its gain from r2/ell2; do not pass {name}")

    def recurrent(self, q, k, v, *, r2=None, ell2=None, lam=None, gain=None, alpha=None, theta=None, p0=1.0,
                  initial_state=None, output_final_state: bool = False, single_step: bool = False) -> FilterOutput:
        """:func:`lowrank_recurrent` with this rank and projection."""
        self._noise(lam, gain)
        return lowrank_recurrent(q, k, v, rank=self.rank, projection=self.projection, r2=r2, ell2=ell2, alpha=alpha,
                                 theta=theta, p0=p0, initial_state=initial_state,
                                 output_final_state=output_final_state, single_step=single_step)

    def chunk(self, q, k, v, *, r2=None, ell2=None, lam=None, gain=None, alpha=None, theta=None, p0=1.0,
              initial_state=None, output_final_state: bool = False, return_variance: bool = False,
              chunk_size: int = 64, cu_seqlens=None) -> FilterOutput:
        """:func:`lowrank_chunk` with this rank and projection."""
        self._noise(lam, gain)
        return lowrank_chunk(q, k, v, rank=self.rank, projection=self.projection, r2=r2, ell2=ell2, alpha=alpha,
                             theta=theta, p0=p0, initial_state=initial_state, output_final_state=output_final_state,
                             return_variance=return_variance, chunk_size=chunk_size, cu_seqlens=cu_seqlens)

    def __eq__(self, other) -> bool:
        return isinstance(other, LowRankWrite) and (self.rank, self.projection) == (other.rank, other.projection)

    def __hash__(self) -> int:
        return hash((self.name, self.rank, self.projection))

    def __repr__(self) -> str:
        return f"LowRankWrite(rank={self.rank}, projection={self.projection!r})"


__all__ = [
    "PROJECTIONS", "LowRankWrite", "check_projection", "check_rank", "initial_lowrank_state", "lowrank_chunk",
    "lowrank_covariance", "lowrank_recurrent",
]
