"""Write models: how a token is written into the memory and what the filter keeps of the posterior.

One small object per write model of the design-model family (docs/theory.md §1), and the one place a
write model's facts live: what its state holds and how big it is, its prior state, which design fields
it takes.  The argument preparation (:mod:`bayeslayer.ops.bayesian_layer.prepare`), the recurrent oracle
(:mod:`bayeslayer.ops.bayesian_layer.recurrent`), the chunked path (:mod:`bayeslayer.ops.bayesian_layer.chunk`),
the backend dispatch (:mod:`bayeslayer.ops.backend`) and the design models (:class:`bayeslayer.design.DesignModel`)
call its methods; none of them tests a write model's name.

* :class:`CovarianceWrite` — the filter carries a key covariance ``P`` between tokens and derives the
  gain from ``r2`` and ``ell2``: ``bayes`` (dense ``P``, the exact Kalman filter) and ``diagonal``
  (only ``diag P̄_t`` and ``diag P_t`` are kept);
* :class:`ResetWrite` — ``reset``: the covariance is reset, ``P̄_t ← λ_t I``, every token (the delta
  rule family): ``M = M̄ + η k (v − M̄ᵀk)ᵀ`` with ``η = λ/(r² + λ‖k‖²)`` or ``η = gain``;
* :class:`LatentWrite` — ``latent``: latent-input write ``φ_t ~ N(0, λ_t I)`` (the additive family):
  ``M = M̄ + ω k vᵀ`` with ``ω = λ/(λ + r²)`` or ``ω = gain``;
* :class:`~bayeslayer.ops.bayesian_layer.lowrank.LowRankWrite` — ``lowrank``: the precision kept as
  ``diag(υ) + W Wᵀ`` of ``rank`` columns, built with its rank (``LowRankWrite(rank, projection)``, so not in
  :data:`WRITES`); it brings its own PyTorch filter (:attr:`WriteModel.own_filter`).

The first four run on the general filter and are picked by name (:data:`WRITES`, :func:`get_write_model`);
every entry point that takes ``write=`` also takes the object.

>>> get_write_model("reset").erase, get_write_model("latent").erase, get_write_model("bayes").has_covariance
(True, False, True)
"""

from __future__ import annotations

import math
import numbers

import torch

from ..utils.validation import check_reset_gain
from .transition import apply_transition, noise_mask


class WriteModel:
    """A write model; subclasses say what the filter does with a token.

    Attributes:
        name: the write model's name (``write=`` of the ops, ``DesignModel.write``).
        has_covariance: the state carries a covariance between tokens (state ``(M, P)``, else ``(M, None)``).
        erase: the mean update erases the memory's prediction ``M̄ᵀk`` (a delta rule) before writing.
        takes_fixed_lam: a design of this write model may fix its prior λ to a constant
            (``DesignModel.fixed_lam``, the fixed-isotropic-prior ablation).
        own_filter: False: the general filter runs it (:func:`~bayeslayer.ops.filter_recurrent`,
            :func:`~bayeslayer.ops.filter_chunk`, and the Triton kernels where they implement it).  True: it
            brings its own PyTorch filter, the methods ``recurrent`` and ``chunk`` (arguments of ``filter_recurrent``
            and ``filter_chunk`` less ``write``), which those two functions call for it.
    """

    name: str
    has_covariance: bool
    erase: bool
    takes_fixed_lam: bool = False
    own_filter: bool = False

    def check_config(self, *, rank=None, dynamics: str = "any") -> None:
        """Refuse a design configuration this write model cannot run (called when a design model is built):
        ``rank`` (only the low-rank write model has one) and the ``dynamics`` family it accepts."""
        if rank is not None:
            raise ValueError(f"rank applies only to write='lowrank', not {self.name!r}")

    def state_size(self, key_dim: int, value_dim: int, groups: int = 1) -> int:
        """Recurrent state floats per head (``D·m`` for the mean, plus the covariance kept)."""
        raise NotImplementedError

    def initial_state(self, batch_size: int, num_heads: int, key_dim: int, value_dim: int, *, p0: float = 1.0,
                      groups: int = 1, dtype: torch.dtype = torch.float32, device=None):
        """The prior state in the layout the filter takes: ``(0, p0·I)`` with a covariance, ``(0, None)`` without."""
        M, P = initial_bl_state(batch_size, num_heads, key_dim, value_dim, p0=p0, groups=groups, dtype=dtype,
                                device=device)
        return (M, P) if self.has_covariance else (M, None)

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
    before the next reset is ``P = λI − ηλ kkᵀ``, so the variance is defined when λ is given.
    A constant λ is the fixed-isotropic-prior ablation (:attr:`WriteModel.takes_fixed_lam`)."""

    erase = True
    takes_fixed_lam = True

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
#: every write model of the general filter, by name: the ones a name alone picks
WRITES: dict[str, WriteModel] = {w.name: w for w in (BAYES, DIAGONAL, RESET, LATENT)}
#: the low-rank write model's name; it is built with its rank,
#: :class:`LowRankWrite(rank, projection) <bayeslayer.ops.bayesian_layer.lowrank.LowRankWrite>`
LOWRANK = "lowrank"
#: every write model's name, in the order messages list them (``DesignModel.write`` takes one)
WRITE_MODELS = (*WRITES, LOWRANK)


def get_write_model(write) -> WriteModel:
    """The :class:`WriteModel` named ``write`` (or ``write`` itself when it is one); ``"lowrank"`` needs its
    rank, so it is refused by name here: pass ``LowRankWrite(rank, projection)`` instead."""
    if isinstance(write, WriteModel):
        return write
    if isinstance(write, str) and write in WRITES:
        return WRITES[write]
    if write == LOWRANK:
        raise ValueError("write='lowrank' needs its rank: pass "
                         "write=bayeslayer.ops.bayesian_layer.lowrank.LowRankWrite(rank, projection)")
    raise ValueError(f"write must be one of {WRITE_MODELS}, got {write!r}")


def initial_bl_state(batch_size: int, num_heads: int, key_dim: int, value_dim: int, *, p0: float = 1.0, groups: int = 1,
                     dtype: torch.dtype = torch.float32, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The prior state ``(M_0 = 0, P_0 = p0·I)`` in the layout the ops accept."""
    for name, val in (("batch_size", batch_size), ("num_heads", num_heads), ("key_dim", key_dim),
                      ("value_dim", value_dim), ("groups", groups)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} must be a positive integer, got {val!r}")
    if value_dim % groups != 0:
        raise ValueError(f"value_dim={value_dim} is not divisible by groups={groups}")
    # an infinite p0 would put inf on the diagonal and 0·inf = NaN off it
    if not isinstance(p0, numbers.Real) or isinstance(p0, bool) or not math.isfinite(p0) or not p0 > 0:
        raise ValueError(f"p0 must be a finite number > 0, got {p0!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    M = torch.zeros(batch_size, num_heads, key_dim, value_dim, dtype=dtype, device=device)
    eye = torch.eye(key_dim, dtype=dtype, device=device) * float(p0)
    if groups == 1:
        P = eye.expand(batch_size, num_heads, key_dim, key_dim).clone()
    else:
        P = eye.expand(batch_size, num_heads, groups, key_dim, key_dim).clone()
    return M, P


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


__all__ = ["BAYES", "DIAGONAL", "LATENT", "LOWRANK", "RESET", "WRITES", "WRITE_MODELS", "CoefficientWrite",
           "CovarianceWrite", "LatentWrite", "ResetWrite", "WriteModel", "get_write_model", "initial_bl_state"]
