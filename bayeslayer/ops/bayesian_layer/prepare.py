"""Argument preparation shared by the oracle and the chunked paths.

Validates every argument (see :mod:`bayeslayer.ops.utils.validation`), casts to the
filter's arithmetic dtype, folds observation-noise groups into heads and builds
the prior state; :meth:`Prepared.finish` undoes the folding on the way out.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch

from ..utils.validation import (
    Dims,
    Dynamics,
    check_dynamics,
    check_p0,
    check_positive,
    check_qkv,
    check_state,
)
from . import groups as grp
from .write_models import WriteModel, get_write_model


@dataclass(frozen=True, eq=False)
class FilterInputs:
    """The per-token inputs of a filter besides ``q, k, v``: noise and dynamics, as the ops take them.

    Which noise arguments a write model needs: :func:`prepare`.  ``alpha``/``theta``: the dynamics
    (:func:`~bayeslayer.ops.utils.validation.check_dynamics`).  Travels from the design model to the ops as one
    value instead of six keywords at every call.
    """

    r2: Any = None
    ell2: Any = None
    lam: Any = None
    gain: Any = None
    alpha: Any = None
    theta: Any = None

    def kwargs(self) -> dict[str, Any]:
        """``{name: value}`` of every field, for the ops that take them as keywords."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def map(self, fn) -> FilterInputs:
        """The inputs with ``fn`` applied to every field (``None`` included)."""
        return FilterInputs(**{name: fn(val) for name, val in self.kwargs().items()})


class FilterOutput(NamedTuple):
    """What a filter reports. ``variance`` and ``gain`` are ``[B, T, H, G]`` (compute dtype)."""

    o: torch.Tensor
    variance: torch.Tensor | None
    gain: torch.Tensor | None
    state: tuple[torch.Tensor, torch.Tensor | None] | None


@dataclass
class Prepared:
    """Folded inputs: H' = H·G heads, value dim m/G, all in the compute dtype."""

    dims: Dims
    G: int
    q: torch.Tensor  # [B, T, H', D]
    k: torch.Tensor
    v: torch.Tensor  # [B, T, H', m/G]
    r2: torch.Tensor | None  # [B, T, H']
    ell2: torch.Tensor | None
    lam: torch.Tensor | None
    coef: torch.Tensor | None  # reset/latent: the write coefficient η_t or ω_t, [B, T, H']
    dyn: Dynamics  # tensors [B, T, H', ...]
    M0: torch.Tensor  # [B, H', D, m/G]
    P0: torch.Tensor | None  # [B, H', D, D]
    single_step: bool

    def finish(self, o, var, gain, M, P, output_final_state: bool) -> FilterOutput:
        G = self.G
        o = grp.unfold_values(o, G).to(self.dims.dtype)
        var = grp.unfold_per_token(var, G) if var is not None else None
        gain = grp.unfold_per_token(gain, G) if gain is not None else None
        final = None
        if output_final_state:
            final = (grp.unfold_state_mean(M, G), grp.unfold_state_cov(P, G) if P is not None else None)
        if self.single_step:
            o = o[:, 0]
            var = var[:, 0] if var is not None else None
            gain = gain[:, 0] if gain is not None else None
        return FilterOutput(o, var, gain, final)


def prepare(
    q, k, v, *, write: str | WriteModel, r2=None, ell2=None, lam=None, gain=None, alpha=None, theta=None,
    p0=1.0, initial_state=None, single_step: bool = False, keep_float64_state: bool = False,
) -> Prepared:
    """Validate and fold.  ``bayes``/``diagonal`` need ``r2`` and ``ell2``; ``reset``/``latent``
    need either ``lam`` and ``r2`` (the coefficient is derived: ``η = λ/(r² + λ‖k‖²)`` or
    ``ω = λ/(λ + r²)``) or the coefficient itself as ``gain`` (> 0, like GDN's β or Mamba-2's Δ).
    A given reset gain must keep the erase from expanding the memory, ``gain·‖k‖² ≤ 2``
    (:func:`~bayeslayer.ops.utils.validation.check_reset_gain`); the latent family's ``ω`` has no upper bound
    (its write is additive, the decay does the forgetting, and Mamba-2's step size Δ exceeds 1).
    ``keep_float64_state``: a float64 ``P`` in ``initial_state`` stays float64 in ``P0``.
    """
    return prepare_inputs(q, k, v, get_write_model(write), FilterInputs(r2, ell2, lam, gain, alpha, theta),
                          p0=p0, initial_state=initial_state, single_step=single_step,
                          keep_float64_state=keep_float64_state)


def prepare_inputs(
    q, k, v, write: WriteModel, inputs: FilterInputs, *, p0=1.0, initial_state=None, single_step: bool = False,
    keep_float64_state: bool = False,
) -> Prepared:
    """:func:`prepare` with the write model as an object and the inputs as one :class:`FilterInputs`."""
    r2, ell2, lam, gain, alpha, theta = (inputs.r2, inputs.ell2, inputs.lam, inputs.gain, inputs.alpha,
                                         inputs.theta)
    dims = check_qkv(q, k, v, single_step=single_step)
    has_cov = write.has_covariance
    # an argument the write model does not use would be silently ignored: refuse it instead
    if not has_cov and ell2 is not None:
        raise ValueError(f"write model {write.name!r} has no process noise; do not pass ell2")
    if not has_cov and gain is not None and r2 is not None:
        raise ValueError(f"write model {write.name!r}: pass either gain or r2 (with lam), not both")
    ell2_t = lam_t = gain_t = None
    if has_cov or gain is None:
        if r2 is None:
            raise ValueError(f"r2 (observation noise variance) is required for write model {write.name!r}")
        r2_t = check_positive("r2", r2, dims, allow_groups=True, single_step=single_step)
        r2_f, G = grp.fold_noise(r2_t)
    if has_cov:
        if gain is not None or lam is not None:
            raise ValueError(f"write model {write.name!r} derives its gain from r2/ell2; do not pass gain or lam")
        if ell2 is None:
            raise ValueError(f"ell2 (process noise variance) is required for write model {write.name!r}")
        ell2_t = check_positive("ell2", ell2, dims, single_step=single_step)
    elif gain is not None:
        if lam is not None:
            raise ValueError("pass either gain or lam (with r2), not both")
        gain_t = check_positive("gain", gain, dims, allow_groups=True, single_step=single_step)
        r2_f = None
        gain_t, G = grp.fold_noise(gain_t)
    else:
        if lam is None:
            raise ValueError(f"lam (prior/write variance) or gain is required for write model {write.name!r}")
        lam_t = check_positive("lam", lam, dims, single_step=single_step)
    dyn = check_dynamics(alpha, theta, dims, single_step=single_step)
    # a decoding step takes its state as ``state=``: name that argument in errors
    state = check_state(initial_state, dims, G, need_cov=has_cov, keep_float64=keep_float64_state,
                        name="state" if single_step else "initial_state")
    cd = dims.cdtype
    if single_step:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    if state is None:
        M0 = torch.zeros(dims.B, dims.H * G, dims.D, dims.m // G, dtype=cd, device=dims.device)
        P0 = None
        if has_cov:
            p0_h = grp.fold_heads(check_p0(p0, dims), G, dim=0)
            eye = torch.eye(dims.D, dtype=cd, device=dims.device)
            P0 = (p0_h[None, :, None, None] * eye).expand(dims.B, -1, -1, -1)
    else:
        M0 = grp.fold_state_mean(state[0], G)
        # The diagonal ablation keeps only diag(P); with rotations A P Aᵀ would otherwise mix an
        # off-diagonal of a given P into the first step of the oracle but not of the chunked scan.
        P0 = write.project(grp.fold_state_cov(state[1])) if has_cov else None
    kf = grp.fold_heads(k.to(cd), G)
    lam_f = grp.fold_heads(lam_t, G)
    coef = gain_t
    if gain_t is not None:
        write.check_gain(gain_t, kf)
    elif lam_f is not None:
        coef = write.coefficient(lam_f, r2_f, kf)
    return Prepared(
        dims=dims,
        G=G,
        q=grp.fold_heads(q.to(cd), G),
        k=kf,
        v=grp.fold_values(v.to(cd), G),
        r2=r2_f,
        ell2=grp.fold_heads(ell2_t, G),
        lam=lam_f,
        coef=coef,
        dyn=Dynamics(dyn.kind, grp.fold_heads(dyn.log_alpha, G), grp.fold_heads(dyn.theta, G)),
        M0=M0,
        P0=P0,
        single_step=single_step,
    )
