"""The recurrent oracle: exact filtering token by token (docs/theory.md §5.1).

One short loop covers every write model of the design-model family:

``bayes``     dense covariance, the Bayesian Layer (docs/theory.md §2.1)
``diagonal``  diagonal-covariance ablation: only ``diag(P̄_t)`` and ``diag(P_t)`` are kept
``reset``     covariance-reset family: ``P̄_t ← λ_t I`` every step (DeltaNet, GDN, KDA, ...)
``latent``    latent-input (additive) family: ``M_t = A_t M_{t-1} + ω_t k_t v_tᵀ`` (LA, GLA, SSD, ...)

Per token, with ``M̄ = A_t M_{t-1}``::

    P̄ = A P Aᵀ + ℓ² Σ      (Σ = I, or the real-channel mask with rotations)
    u = P̄ k ;  β = 1 / (r² + kᵀ u)
    M = M̄ + β u (v − M̄ᵀ k)ᵀ
    P = P̄ − β u uᵀ
    o = Mᵀ q ;  variance = 1 + qᵀ P q ;  gain = kᵀ (β u)

It is the reference that every chunked and fused path is tested against, and
the decode step (:func:`bayeslayer.ops.bl_step` runs ``filter_recurrent(..., single_step=True)``).

Precision: the covariance (``P̄, u, β, P`` and the variance) is carried in float64 whatever the
input dtype; the mean ``M`` and the outputs are in the compute dtype.  ``P = P̄ − β u uᵀ``
subtracts two matrices of size ``kᵀP̄k`` to leave ``≈ r²`` along ``k``; in float32 that keeps
about ``eps32·kᵀP̄k/r²`` of it, so ``p0 = 1e8`` gave negative variances and outputs 600% off.
Measured alternatives in float32 (``benchmarks/numerics.py --forms``, p0 = 1e8): the Joseph form
``(I − K kᵀ) P̄ (I − K kᵀ)ᵀ + r² K Kᵀ`` is no better (7e0: the same cancellation); a square-root
(Cholesky-factor) update reaches 7e-5 but is O(D³) per token and its factor cannot travel in the
``(M, P)`` state; the plain form in float64 reaches 5e-7.  The state's ``P`` is returned in the
dtype it came in (the prior ``p0·I``: the compute dtype), a static rule: a float32 state asked to
hold a wide prior warns in eager mode
(:func:`~bayeslayer.ops.utils.validation.check_state_precision`), and a float64 state
(``initial_bl_state(..., dtype=torch.float64)``) keeps its precision.  A covariance that grows
ill-conditioned while decoding (keys in a subspace, small ``r²``) also loses about 1e-3 to a float32
state between steps: decode from a float64 state then.
"""

from __future__ import annotations

import torch

from ..utils.validation import COVARIANCE_DTYPE, Dynamics, check_state_precision
from .prepare import FilterInputs, FilterOutput, prepare_inputs
from .transition import apply_transition, noise_mask
from .write_models import WriteModel, get_write_model


def filter_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    write: str | WriteModel,
    r2: torch.Tensor | None,
    ell2: torch.Tensor | None,
    lam: torch.Tensor | None,
    coef: torch.Tensor | None,
    dyn: Dynamics,
    M: torch.Tensor,
    P: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The loop itself, on folded inputs in the compute dtype.

    q, k: [B, T, H, D]; v: [B, T, H, m]; r2, ell2, lam, coef: [B, T, H]; M: [B, H, D, m];
    P: [B, H, D, D] (bayes/diagonal) or None.  ``reset``/``latent`` use ``coef`` (η or ω) and,
    for the variance, ``lam``.  Returns (o, variance, gain, M, P); the variance is None
    where the design defines none (latent, or reset given only its gain).  The covariance
    arithmetic runs in P's dtype (float64 from :func:`filter_recurrent`), the mean in q's.
    """
    write = get_write_model(write)
    B, T, H, D = q.shape
    cd = q.dtype
    pd = P.dtype if P is not None else cd
    sig = noise_mask(dyn, D, pd, q.device)
    outs, variances, gains = [], [], []
    # per-token views by unbind, not x[:, t]: under autograd each x[:, t] would write its gradient
    # into a zero tensor of the whole sequence (T fills of [B, T, ...], quadratic in T)
    q_, k_, v_, la_, th_, coef_, lam_ = (
        x.unbind(1) if x is not None else None for x in (q, k, v, dyn.log_alpha, dyn.theta, coef, lam)
    )
    # the covariance's inputs in its own dtype
    qp_, kp_, lap_, thp_, r2_, ell2_ = (
        x.to(pd).unbind(1) if x is not None else None for x in (q, k, dyn.log_alpha, dyn.theta, r2, ell2)
    )
    for t in range(T):
        la_t = la_[t] if la_ is not None else None
        th_t = th_[t] if th_ is not None else None
        q_t, k_t, v_t = q_[t], k_[t], v_[t]
        M_bar = apply_transition(M, dyn.kind, la_t, th_t)
        if not write.has_covariance:
            c = coef_[t][..., None]  # [B,H,1]: the write coefficient, ω_t (latent) or η_t (reset)
            resid = write.residual(v_t, M_bar, k_t)
            M = M_bar + (c * k_t)[..., :, None] * resid[..., None, :]
            outs.append(torch.einsum("bhdm,bhd->bhm", M, q_t))
            gains.append((c * (k_t * k_t).sum(-1, keepdim=True))[..., 0])
            var_t = write.variance(q_t, k_t, c[..., 0], lam_[t] if lam_ is not None else None)
            if var_t is not None:
                variances.append(var_t)
            continue
        kp_t, qp_t = kp_[t], qp_[t]
        lap_t = lap_[t] if lap_ is not None else None
        thp_t = thp_[t] if thp_ is not None else None
        AP = apply_transition(P, dyn.kind, lap_t, thp_t)
        P_bar = apply_transition(AP.transpose(-1, -2), dyn.kind, lap_t, thp_t)
        P_bar = P_bar + ell2_[t][..., None, None] * torch.diag(sig)
        P_bar = write.project(P_bar)
        u = torch.einsum("bhij,bhj->bhi", P_bar, kp_t)
        beta = 1.0 / (r2_[t][..., None] + (kp_t * u).sum(-1, keepdim=True))  # [B,H,1]
        resid = v_t - torch.einsum("bhdm,bhd->bhm", M_bar, k_t)
        M = M_bar + (beta * u).to(cd)[..., :, None] * resid[..., None, :]
        P = P_bar - beta[..., None] * u[..., :, None] * u[..., None, :]
        P = write.project(P)
        P = 0.5 * (P + P.transpose(-1, -2))
        outs.append(torch.einsum("bhdm,bhd->bhm", M, q_t))
        variances.append((1.0 + torch.einsum("bhi,bhij,bhj->bh", qp_t, P, qp_t)).to(cd))
        gains.append((beta * (kp_t * u).sum(-1, keepdim=True))[..., 0].to(cd))
    o = torch.stack(outs, 1) if outs else v.new_zeros(B, 0, H, v.shape[-1])
    has_var = write.has_variance(lam is not None)
    var = (torch.stack(variances, 1) if T > 0 else v.new_zeros(B, 0, H)) if has_var else None
    gain = torch.stack(gains, 1) if gains else v.new_zeros(B, 0, H)
    return o, var, gain, M, P


def filter_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, write: str | WriteModel = "bayes", r2=None,
                     ell2=None, lam=None, gain=None, alpha=None, theta=None, p0=1.0, initial_state=None,
                     output_final_state: bool = False, single_step: bool = False) -> FilterOutput:
    """Validate, fold groups, run :func:`filter_scan`, unfold. The general oracle.

    ``write`` picks the write model (module docstring).  ``bayes``/``diagonal``
    need ``ell2`` (process noise) and use ``p0``; ``reset``/``latent`` need
    ``lam`` (the reset prior variance, or the latent write variance).
    The state is ``(M, P)`` for ``bayes``/``diagonal`` and ``(M, None)`` otherwise.  A write model with a
    filter of its own (:attr:`~bayeslayer.ops.WriteModel.own_filter`, e.g.
    :class:`~bayeslayer.ops.bayesian_layer.lowrank.LowRankWrite`) runs that filter with these arguments.
    """
    write = get_write_model(write)
    if write.own_filter:  # e.g. the low-rank covariance (lowrank.py): a filter of its own
        return write.recurrent(q, k, v, r2=r2, ell2=ell2, lam=lam, gain=gain, alpha=alpha, theta=theta, p0=p0,
                               initial_state=initial_state, output_final_state=output_final_state,
                               single_step=single_step)
    pr = prepare_inputs(q, k, v, write, FilterInputs(r2, ell2, lam, gain, alpha, theta), p0=p0,
                        initial_state=initial_state, single_step=single_step, keep_float64_state=True)
    P0 = pr.P0
    # the covariance runs in float64 (module docstring); the state's P goes back in the dtype it came in
    if P0 is not None and output_final_state:
        check_state_precision(P0, pr.k, pr.r2, name="state" if single_step else "the initial state (or p0·I)")
    o, var, g, M, P = filter_scan(
        pr.q, pr.k, pr.v, write=write, r2=pr.r2, ell2=pr.ell2, lam=pr.lam, coef=pr.coef, dyn=pr.dyn,
        M=pr.M0, P=P0.to(COVARIANCE_DTYPE) if P0 is not None else None,
    )
    if P0 is not None:
        P = P.to(P0.dtype)
    return pr.finish(o, var, g, M, P, output_final_state)


def bl_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r2, ell2, alpha=None, theta=None, p0=1.0,
                 initial_state=None, output_final_state: bool = False, return_variance: bool = False):
    """The Bayesian Layer, token by token (exact Kalman filter, docs/theory.md §2.1).

    Args:
        q, k: ``[B, T, H, D]`` queries and keys (used as given: no scaling, no normalisation).
        v: ``[B, T, H, m]`` values (pseudo-observations).
        r2: observation-noise variance ``r_t²``, ``[B, T, H]`` or ``[B, T, H, G]`` (``m % G == 0``), > 0.
        ell2: process-noise variance ``ℓ_t²``, ``[B, T, H]``, > 0.
        alpha: ``None`` (``A_t = I``), ``[B, T, H]`` (``α_t I``), ``[B, T, H, D]`` (``diag(α_t)``); in (0, 1].
        theta: ``[B, T, H, D/2]`` rotation angles of channel pairs ``(2c, 2c+1)``; then alpha is
            ``None``, ``[B, T, H]`` or ``[B, T, H, D/2]`` and process noise enters only the even
            (real) channels.
        p0: prior variance ``P_0 = p0·I`` when no state is given (number or ``[H]`` tensor).
        initial_state: ``(M [B, H, D, m], P [B, H, D, D] or [B, H, G, D, D])``.

    Returns:
        ``(o, state)`` or, with ``return_variance``, ``(o, variance, state)``: ``o[b,t,h] = M_tᵀ q_t``
        in the input dtype, ``variance[b,t,h,g] = 1 + q_tᵀ P_t q_t`` ([B, T, H, G], fp32/fp64),
        ``state = (M, P)`` when ``output_final_state`` else ``None``.  The covariance is computed in
        float64; ``P`` is returned in the dtype it came in (the prior ``p0·I``: the compute dtype;
        :func:`~bayeslayer.ops.utils.validation.check_state_precision` warns when a float32 ``P`` is
        asked to hold a wide prior).
    """
    out = filter_recurrent(
        q, k, v, write="bayes", r2=r2, ell2=ell2, alpha=alpha, theta=theta, p0=p0,
        initial_state=initial_state, output_final_state=output_final_state,
    )
    if return_variance:
        return out.o, out.variance, out.state
    return out.o, out.state
