"""Write models: how a token is written into the memory and what the filter keeps of the posterior.

One small object per write model of the design-model family (docs/theory.md §1).  The argument preparation
(:mod:`bayeslayer.ops.bayesian_layer.prepare`), the recurrent oracle (:mod:`bayeslayer.ops.bayesian_layer.recurrent`)
and the chunked path (:mod:`bayeslayer.ops.bayesian_layer.chunk`) call its methods; none of them tests a write model's
name.

* :class:`CovarianceWrite` — the filter carries a key covariance ``P`` between tokens and derives the
  gain from ``r2`` and ``ell2``: ``bayes`` (dense ``P``, the exact Kalman filter) and ``diagonal``
  (only ``diag P̄_t`` and ``diag P_t`` are kept);
* :class:`ResetWrite` — ``reset``: the covariance is reset, ``P̄_t ← λ_t I``, every token (the delta
  rule family): ``M = M̄ + η k (v − M̄ᵀk)ᵀ`` with ``η = λ/(r² + λ‖k‖²)`` or ``η = gain``;
* :class:`LatentWrite` — ``latent``: latent-input write ``φ_t ~ N(0, λ_t I)`` (the additive family):
  ``M = M̄ + ω k vᵀ`` with ``ω = λ/(λ + r²)`` or ``ω = gain``.

>>> get_write_model("reset").erase, get_write_model("latent").erase, get_write_model("bayes").has_covariance
(True, False, True)
"""

from __future__ import annotations

import torch

from ..utils.validation import check_reset_gain
from .transition import apply_transition, noise_mask


class WriteModel:
    """A write model; subclasses say what the filter does with a token.

    Attributes:
        name: the name the ops take as ``write=``.
        has_covariance: the state carries ``P`` between tokens (state ``(M, P)``, else ``(M, None)``).
        erase: the mean update erases the memory's prediction ``M̄ᵀk`` (a delta rule) before writing.
    """

    name: str
    has_covariance: bool
    erase: bool

    def state_size(self, key_dim: int, value_dim: int, groups: int = 1) -> int:
        """Recurrent state floats per head (``D·m`` for the mean, plus the covariance kept)."""
        raise NotImplementedError

    def has_variance(self, lam_given: bool) -> bool:
        """Whether the filter reports a predictive variance (``lam_given``: λ was passed, not a gain)."""
        raise NotImplementedError

    def chunk_write_keys(self, pr, want_variance: bool, P: torch.Tensor | None):
        """What the chunked path needs before its mean pass, from a
        :class:`~bayeslayer.ops.bayesian_layer.prepare.Prepared`.

        Returns ``(w, variance, P)``: the write keys ``w_t`` ``[B, T, H', D]`` (``None``: they come
        block by block from the matmul-form covariance pass), the variance when ``want_variance``
        (``None`` where the covariance pass gives it or there is none), and the final ``P``.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class CovarianceWrite(WriteModel):
    """Kalman write with a covariance: ``u = P̄k``, ``β = 1/(r² + kᵀu)``, ``M = M̄ + βu(v − M̄ᵀk)ᵀ``,
    ``P = P̄ − βuuᵀ``; ``diagonal=True`` keeps only the diagonal of ``P̄`` and ``P`` (the ablation)."""

    has_covariance = True
    erase = True

    def __init__(self, name: str, *, diagonal: bool) -> None:
        self.name = name
        self.diagonal = diagonal

    def project(self, P: torch.Tensor) -> torch.Tensor:
        """What the filter keeps of a covariance ``[..., D, D]``: all of it, or its diagonal."""
        if self.diagonal:
            return torch.diag_embed(torch.diagonal(P, dim1=-2, dim2=-1))
        return P

    def state_size(self, key_dim: int, value_dim: int, groups: int = 1) -> int:
        return key_dim * value_dim + groups * key_dim * (1 if self.diagonal else key_dim)

    def has_variance(self, lam_given: bool) -> bool:
        return True

    def chunk_write_keys(self, pr, want_variance: bool, P: torch.Tensor | None):
        if not self.diagonal:
            return None, None, P  # the dense covariance pass is matmul-shaped: it runs per block
        return _diagonal_covariance_scan(pr, want_variance, P)


class CoefficientWrite(WriteModel):
    """A write without a covariance: ``M = M̄ + c k rᵀ`` with the coefficient ``c`` given as ``gain``
    or derived from ``lam`` and ``r2`` (:meth:`coefficient`), ``r`` from :meth:`residual`."""

    has_covariance = False

    def __init__(self, name: str) -> None:
        self.name = name

    def state_size(self, key_dim: int, value_dim: int, groups: int = 1) -> int:
        return key_dim * value_dim

    def coefficient(self, lam: torch.Tensor, r2: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The write coefficient ``[B, T, H]`` from ``lam``, ``r2`` ``[B, T, H]`` and the keys."""
        raise NotImplementedError

    def check_gain(self, gain: torch.Tensor, k: torch.Tensor) -> None:
        """Refuse a given coefficient the write model cannot take (nothing by default)."""

    def residual(self, v: torch.Tensor, M_bar: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """What is written along ``k``: ``v − M̄ᵀk`` with an erase, ``v`` without (``[B, H, m]``)."""
        if self.erase:
            return v - torch.einsum("bhdm,bhd->bhm", M_bar, k)
        return v

    def variance(self, q: torch.Tensor, k: torch.Tensor, coef: torch.Tensor, lam) -> torch.Tensor | None:
        """Predictive variance ``1 + qᵀPq`` where the write model defines a ``P`` (elementwise over the
        leading dims of ``coef``), else ``None``."""
        return None

    def has_variance(self, lam_given: bool) -> bool:
        return False

    def chunk_write_keys(self, pr, want_variance: bool, P: torch.Tensor | None):
        var = self.variance(pr.q, pr.k, pr.coef, pr.lam) if want_variance else None
        return pr.coef[..., None] * pr.k, var, P


class ResetWrite(CoefficientWrite):
    """Covariance reset ``P̄_t ← λ_t I``: ``η = λ/(r² + λ‖k‖²)``, an erasing write; its posterior
    before the next reset is ``P = λI − ηλ kkᵀ``, so the variance is defined when λ is given."""

    erase = True

    def coefficient(self, lam, r2, k):
        return lam / (r2 + lam * (k * k).sum(-1))

    def check_gain(self, gain, k):
        check_reset_gain(gain, k)  # the erase must not expand the memory: gain·‖k‖² ≤ 2

    def variance(self, q, k, coef, lam):
        if lam is None:
            return None
        qk = (q * k).sum(-1)
        return 1.0 + lam * (q * q).sum(-1) - coef * lam * qk * qk

    def has_variance(self, lam_given: bool) -> bool:
        return lam_given


class LatentWrite(CoefficientWrite):
    """Latent-input write ``φ_t ~ N(0, λ_t I)``: ``ω = λ/(λ + r²)``, additive (no erase), no variance;
    ``ω`` has no upper bound (the decay does the forgetting; Mamba-2's step size exceeds 1)."""

    erase = False

    def coefficient(self, lam, r2, k):
        return lam / (lam + r2)


BAYES = CovarianceWrite("bayes", diagonal=False)
DIAGONAL = CovarianceWrite("diagonal", diagonal=True)
RESET = ResetWrite("reset")
LATENT = LatentWrite("latent")
#: every write model of the general filter, by name (the low-rank covariance has its own ops: :mod:`.lowrank`)
WRITES: dict[str, WriteModel] = {w.name: w for w in (BAYES, DIAGONAL, RESET, LATENT)}
WRITE_MODELS = tuple(WRITES)


def get_write_model(write) -> WriteModel:
    """The :class:`WriteModel` named ``write`` (or ``write`` itself when it is one)."""
    if isinstance(write, WriteModel):
        return write
    if isinstance(write, str) and write in WRITES:
        return WRITES[write]
    raise ValueError(f"write must be one of {WRITE_MODELS}, got {write!r}")


def _diagonal_covariance_scan(pr, want_var: bool, P0: torch.Tensor):
    """Diagonal-covariance ablation: ``p̄ = diag(A P Aᵀ) + ℓ²σ``, ``u = p̄ ⊙ k``, ``P = diag(p̄ − β u²)``.

    O(D) per token, in P0's dtype; returns write keys ``β u`` ``[B, T, H', D]`` and the variance
    in the compute dtype, and the final ``P`` in P0's.
    """
    dyn = pr.dyn
    B, T, H, D = pr.k.shape
    cd, pd = pr.k.dtype, P0.dtype
    p = torch.diagonal(P0, dim1=-2, dim2=-1)  # [B,H,D]
    sig = noise_mask(dyn, D, pd, pr.k.device)
    ws, vs = [], []
    # per-token views by unbind, not x[:, t] (x[:, t] makes the backward quadratic in T)
    la_, th_, ell2_, r2_, k_, q_ = (
        x.to(pd).unbind(1) if x is not None else None
        for x in (dyn.log_alpha, dyn.theta, pr.ell2, pr.r2, pr.k, pr.q)
    )
    for t in range(T):
        la_t = la_[t] if la_ is not None else None
        th_t = th_[t] if th_ is not None else None
        if dyn.kind == "rotation":
            Pm = torch.diag_embed(p)
            Pm = apply_transition(apply_transition(Pm, dyn.kind, la_t, th_t).transpose(-1, -2), dyn.kind, la_t, th_t)
            p_bar = torch.diagonal(Pm, dim1=-2, dim2=-1)
        elif dyn.kind == "identity":
            p_bar = p
        else:
            p_bar = torch.exp(2 * la_t) * p
        p_bar = p_bar + ell2_[t][..., None] * sig
        k_t = k_[t]
        u = p_bar * k_t
        beta = 1.0 / (r2_[t][..., None] + (k_t * u).sum(-1, keepdim=True))
        ws.append(beta * u)
        p = p_bar - beta * u * u
        if want_var:
            vs.append(1.0 + (q_[t] ** 2 * p).sum(-1))
    w = torch.stack(ws, 1).to(cd)
    var = torch.stack(vs, 1).to(cd) if want_var else None
    return w, var, torch.diag_embed(p)


__all__ = ["BAYES", "DIAGONAL", "LATENT", "RESET", "WRITES", "WRITE_MODELS", "CoefficientWrite",
           "CovarianceWrite", "LatentWrite", "ResetWrite", "WriteModel", "get_write_model"]
