"""Design models: the layer is *derived* from an explicit probabilistic model of its memory.

A :class:`DesignModel` names its three parts (docs/theory.md §1):

* **dynamics** — the latent memory's transition ``A_t``: ``identity``, ``scalar``
  (``α_t I``), ``diagonal`` (``diag(α_t)``), ``rotation`` (damped 2×2 rotations),
  or ``any`` (whatever ``alpha``/``theta`` the caller passes);
* **write** — the observation model and what the filter keeps of the posterior:
  ``bayes`` (exact Kalman filter, dense key covariance), ``diagonal`` (diagonal
  covariance ablation), ``reset`` (covariance reset ``P̄_t ← λ_t I``: the delta
  rule family), ``latent`` (latent-input write ``φ_t ~ N(0, λ_t I)``: the additive
  family), ``lowrank`` (precision ``diag(υ) + W Wᵀ`` of rank ``r``, projected after every write:
  :func:`lowrank_diagonal`, :mod:`bayeslayer.ops.bayesian_layer.lowrank`);
* **readout** — ``y_t = E[Z_t] = M_tᵀ q_t`` with predictive variance ``1 + q_tᵀ P_t q_t``.

Every design runs through the same two pieces of machinery in
:mod:`bayeslayer.ops`: the recurrent oracle and the chunked path.  No design has
a hand-written loop of its own: its write model is one object of the ops' write-model family
(``DesignModel.write_model``: :mod:`bayeslayer.ops.bayesian_layer.write_models`, and
:class:`~bayeslayer.ops.bayesian_layer.lowrank.LowRankWrite` built with the design's rank), which says
what the state holds and how big it is, and which the ops' filters run.
:meth:`DesignModel.chunk` and :meth:`DesignModel.step` take a ``backend``
(``"auto"``/``"torch"``/``"triton"``, :mod:`bayeslayer.ops.backend`): designs with write model
``bayes`` run on the Triton kernels for CUDA tensors; the others have no kernel.

>>> from bayeslayer.design import GATED_DELTANET
>>> GATED_DELTANET.write, GATED_DELTANET.dynamics
('reset', 'scalar')
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..ops.backend import dispatch_chunk, dispatch_step
from ..ops.bayesian_layer.lowrank import LowRankWrite, check_projection, check_rank
from ..ops.bayesian_layer.prepare import FilterInputs, FilterOutput
from ..ops.bayesian_layer.recurrent import filter_recurrent
from ..ops.bayesian_layer.write_models import WriteModel, get_write_model

DYNAMICS = ("identity", "scalar", "diagonal", "rotation", "any")


@dataclass(frozen=True)
class DesignModel:
    """An explicit design model; :meth:`recurrent`, :meth:`chunk` and :meth:`step` are derived from it.

    Attributes:
        name: registry name.
        write: ``bayes`` | ``diagonal`` | ``reset`` | ``latent`` | ``lowrank``.
        dynamics: the transition family the design requires (``any`` accepts all).
        fixed_lam: a constant reset prior ``λ = c`` (the fixed-isotropic-prior ablation); when set,
            callers pass only ``r2``.
        per_column: a separate gain per value column (Longhorn-style): ``r2``/``gain`` carry one
            entry per value column (``G = m``).
        rank: ``lowrank`` only: the number of low-rank precision columns ``r``.
        projection: ``lowrank`` only: ``conservative`` (never overconfident) or ``lofi``.

    Noise arguments by write model (tensors ``[B, T, H]``, or ``[B, T, H, G]`` where grouped):

    * ``bayes``, ``diagonal``, ``lowrank``: ``r2``, ``ell2`` (and ``p0``);
    * ``reset``: ``lam`` and ``r2`` (``η = λ/(r² + λ‖k‖²)``), or ``gain = η`` directly;
    * ``latent``: ``lam`` and ``r2`` (``ω = λ/(λ + r²)``), or ``gain = ω`` directly.
    """

    name: str
    write: str
    dynamics: str = "any"
    fixed_lam: float | None = None
    per_column: bool = False
    description: str = ""
    rank: int | None = None
    projection: str = "conservative"

    def __post_init__(self):
        write = self.write_model  # refuses an unknown write model (and a low-rank one's bad rank or projection)
        write.check_config(rank=self.rank, dynamics=self.dynamics)
        if self.dynamics not in DYNAMICS:
            raise ValueError(f"dynamics must be one of {DYNAMICS}, got {self.dynamics!r}")
        if self.fixed_lam is not None and (not write.takes_fixed_lam or not self.fixed_lam > 0):
            raise ValueError("fixed_lam needs write='reset' and a positive value")

    @property
    def write_model(self) -> WriteModel:
        """This design's write model, the object the ops run (:mod:`bayeslayer.ops.bayesian_layer.write_models`;
        ``lowrank``: :class:`~bayeslayer.ops.bayesian_layer.lowrank.LowRankWrite` of :attr:`rank` and
        :attr:`projection`)."""
        if self.write == LowRankWrite.name:
            return LowRankWrite(self.rank, self.projection)
        return get_write_model(self.write)

    @property
    def has_covariance(self) -> bool:
        """Whether the filter carries a key-space covariance between tokens (state ``(M, P)``)."""
        return self.write_model.has_covariance

    def state_size(self, key_dim: int, value_dim: int, groups: int = 1) -> int:
        """Recurrent state floats per head: ``D·m`` (+ ``G·D²`` dense, ``G·D`` diagonal or ``G·D·(r+1)``
        low-rank-plus-diagonal covariance)."""
        return self.write_model.state_size(key_dim, value_dim, groups)

    # -- argument plumbing -------------------------------------------------------------------------
    @staticmethod
    def _check_types(alpha, theta):
        for arg, val in (("alpha", alpha), ("theta", theta)):
            if val is not None and not isinstance(val, torch.Tensor):
                raise TypeError(f"{arg} must be a torch.Tensor or None, got {type(val).__name__}")

    def _check_dynamics(self, alpha, theta):
        self._check_types(alpha, theta)
        kind = "identity"
        if theta is not None:
            kind = "rotation"
        elif alpha is not None:
            kind = "scalar" if alpha.dim() == 3 else "diagonal" if alpha.dim() == 4 else "?"
        if self.dynamics != "any" and kind != self.dynamics:
            raise ValueError(
                f"design {self.name!r} has {self.dynamics} dynamics but got "
                f"alpha {None if alpha is None else tuple(alpha.shape)}, theta "
                f"{None if theta is None else tuple(theta.shape)} ({kind})"
            )

    def _inputs(self, r2, ell2, lam, gain, alpha, theta) -> FilterInputs:
        # Every argument is passed on, so that the ops refuse one the write model does not use
        # (e.g. ell2 for a reset design) instead of it being dropped here silently.
        if self.fixed_lam is not None:
            if lam is not None or gain is not None:
                raise ValueError(f"design {self.name!r} fixes lam={self.fixed_lam}; pass only r2")
            lam = self.fixed_lam
        return FilterInputs(r2=r2, ell2=ell2, lam=lam, gain=gain, alpha=alpha, theta=theta)

    def _sequence_inputs(self, v, r2, ell2, lam, gain, alpha, theta) -> FilterInputs:
        self._check_dynamics(alpha, theta)
        inputs = self._inputs(r2, ell2, lam, gain, alpha, theta)
        if self.per_column:
            noise = gain if gain is not None else r2
            m = v.shape[-1] if isinstance(v, torch.Tensor) else None
            if not isinstance(noise, torch.Tensor) or noise.dim() != 4 or noise.shape[-1] != m:
                seen = tuple(noise.shape) if isinstance(noise, torch.Tensor) else type(noise).__name__
                raise ValueError(
                    f"design {self.name!r} needs a per-value-column r2 or gain [B, T, H, m] (m={m}), "
                    f"got {seen}"
                )
        return inputs

    # -- derived filters ---------------------------------------------------------------------------
    def recurrent(
        self, q, k, v, *, r2=None, ell2=None, lam=None, gain=None, alpha=None, theta=None, p0=1.0,
        initial_state=None, output_final_state=False,
    ) -> FilterOutput:
        """Token-by-token oracle. Returns :class:`~bayeslayer.ops.FilterOutput` ``(o, variance, gain, state)``."""
        inputs = self._sequence_inputs(v, r2, ell2, lam, gain, alpha, theta)
        return filter_recurrent(q, k, v, write=self.write_model, **inputs.kwargs(), p0=p0,
                                initial_state=initial_state, output_final_state=output_final_state)

    def chunk(
        self, q, k, v, *, r2=None, ell2=None, lam=None, gain=None, alpha=None, theta=None, p0=1.0,
        initial_state=None, output_final_state=False, return_variance=False, chunk_size=64, backend="auto",
        cu_seqlens=None,
    ) -> FilterOutput:
        """Chunked path (training/prefill); same results as :meth:`recurrent`.

        ``backend``: ``"auto"``, ``"torch"`` or ``"triton"`` (:mod:`bayeslayer.ops.backend`); on the
        Triton path ``gain`` is ``None``.  ``cu_seqlens`` (``[N + 1]`` int offsets, B = 1) runs N sequences
        packed along T, each from its own state, like flash-linear-attention (``initial_state`` and the
        final state then hold one sequence per row).
        """
        inputs = self._sequence_inputs(v, r2, ell2, lam, gain, alpha, theta)
        return dispatch_chunk(q, k, v, write=self.write_model, **inputs.kwargs(), p0=p0,
                              initial_state=initial_state, output_final_state=output_final_state,
                              return_variance=return_variance, chunk_size=chunk_size, backend=backend,
                              cu_seqlens=cu_seqlens)

    def step(self, q, k, v, *, state, r2=None, ell2=None, lam=None, gain=None, alpha=None, theta=None,
             backend="auto") -> FilterOutput:
        """One decoding step (shapes without the time axis); ``state`` is required.

        ``backend`` as in :meth:`chunk`; on Triton the fused step kernel runs.
        """
        if state is None:
            raise ValueError("state is required for step(); start from initial_state(...)")
        self._check_types(alpha, theta)
        self._check_dynamics(
            None if alpha is None else alpha.unsqueeze(1), None if theta is None else theta.unsqueeze(1)
        )
        inputs = self._inputs(r2, ell2, lam, gain, alpha, theta)
        return dispatch_step(q, k, v, write=self.write_model, **inputs.kwargs(), state=state, backend=backend)

    def initial_state(self, batch_size, num_heads, key_dim, value_dim, *, p0=1.0, groups=1,
                      dtype=torch.float32, device=None):
        """Prior state: ``(0, p0·I)`` with a covariance, ``(0, [1/p0, 0])`` low-rank, ``(0, None)`` otherwise."""
        return self.write_model.initial_state(batch_size, num_heads, key_dim, value_dim, p0=p0, groups=groups,
                                              dtype=dtype, device=device)


# -- the family (docs/theory.md §3) ------------------------------------------------------------------------
BAYESIAN = DesignModel("bayesian", "bayes", "any", description="Bayesian Layer: exact Kalman filter")
DIAGONAL_COVARIANCE = DesignModel("diagonal_covariance", "diagonal", "any",
                                  description="ablation: keep only diag of P̄_t and P_t")
DELTANET = DesignModel("deltanet", "reset", "identity", description="covariance reset, A_t = I")
GATED_DELTANET = DesignModel("gated_deltanet", "reset", "scalar", description="covariance reset, A_t = α_t I")
KDA = DesignModel("kda", "reset", "diagonal", description="covariance reset, A_t = diag(α_t)")
LONGHORN = DesignModel("longhorn", "reset", "identity", per_column=True,
                       description="covariance reset with a separate gain per value column")
LINEAR_ATTENTION = DesignModel("linear_attention", "latent", "identity", description="latent input, A_t = I")
GLA = DesignModel("gla", "latent", "diagonal", description="latent input, A_t = diag(α_t)")
MAMBA2 = DesignModel("mamba2", "latent", "scalar",
                     description="latent input, A_t = a_t I: Mamba-2's SSD core (inputs scaled by the step "
                                 "size Δ_t as the write coefficient) and RetNet (a fixed decay γ, coefficient 1)")
#: RetNet's retention is the same filter as Mamba-2's SSD core (latent input, scalar decay; a fixed γ is
#: only the alpha its caller passes): one design model, registered under both names.
RETNET = MAMBA2


def fixed_prior(c: float) -> DesignModel:
    """Fixed isotropic prior ablation: ``P̄_t = c I`` every step (a reset with constant ``λ = c``)."""
    if not (isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c > 0):
        raise ValueError(f"fixed prior variance c must be a finite positive number, got {c!r}")
    return DesignModel(f"fixed_prior_{c:g}", "reset", "any", fixed_lam=float(c),
                       description=f"fixed isotropic prior P̄ = {c:g} I")


DESIGNS: dict[str, DesignModel] = {
    **{d.name: d for d in (BAYESIAN, DIAGONAL_COVARIANCE, DELTANET, GATED_DELTANET, KDA, LONGHORN,
                           LINEAR_ATTENTION, GLA, MAMBA2)},
    "retnet": RETNET,
}


def lowrank_diagonal(rank: int, projection: str = "conservative") -> DesignModel:
    """Low-rank-plus-diagonal Bayesian Layer: precision ``diag(υ) + W Wᵀ``, ``W`` of ``rank`` columns.

    The write and the predict step are exact in this form; after each write the rank-``(r+1)``
    factor is projected back to ``r`` columns (:mod:`bayeslayer.ops.bayesian_layer.lowrank`).
    ``projection="conservative"`` drops the least-informative whitened direction: never
    overconfident (``P_approx ⪰ P_exact``), ``rank = D`` is dense BL exactly, ``rank = 0`` is the
    covariance reset with the dynamics-propagated prior ``λ_t = α_t² λ_{t−1} + ℓ_t²``.
    ``projection="lofi"`` moves the dropped diagonal into ``υ`` (LoFi): ``rank = 0`` is the
    diagonal-precision filter; no Loewner guarantee.  State ``D·m + G·D·(r+1)`` per head.
    """
    rank = check_rank(rank)
    projection = check_projection(projection)
    suffix = "" if projection == "conservative" else f"_{projection}"
    return DesignModel(f"lowrank_diagonal_{rank}{suffix}", "lowrank", "any", rank=rank, projection=projection,
                       description=f"precision diag + rank-{rank} ({projection} projection)")


def get_design(name: str) -> DesignModel:
    """Look a design up by name (``fixed_prior_<c>`` builds the ablation with ``λ = c``;
    ``lowrank_diagonal_<r>[_lofi]`` the low-rank-plus-diagonal design)."""
    if not isinstance(name, str):
        raise TypeError(f"design name must be a str, got {type(name).__name__}")
    if name in DESIGNS:
        return DESIGNS[name]
    if name.startswith("fixed_prior_"):
        try:
            return fixed_prior(float(name[len("fixed_prior_"):]))
        except ValueError:
            pass
    if name.startswith("lowrank_diagonal_"):
        rest = name[len("lowrank_diagonal_"):]
        proj = "conservative"
        if rest.endswith("_lofi"):
            rest, proj = rest[: -len("_lofi")], "lofi"
        if rest.isdigit():
            return lowrank_diagonal(int(rest), proj)
    raise ValueError(f"unknown design {name!r}; known: {sorted(DESIGNS)}, lowrank_diagonal_<r>[_lofi] "
                     f"or fixed_prior_<c>")


__all__ = [
    "BAYESIAN", "DELTANET", "DESIGNS", "DIAGONAL_COVARIANCE", "DesignModel", "GATED_DELTANET", "GLA",
    "KDA", "LINEAR_ATTENTION", "LONGHORN", "MAMBA2", "RETNET", "fixed_prior", "get_design", "lowrank_diagonal",
]
