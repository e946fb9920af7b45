"""How a design model's write model runs: one small object per ``DesignModel.write``.

:class:`~bayeslayer.design.DesignModel` holds the design's facts (write model, dynamics, rank, ...);
its :meth:`~bayeslayer.design.DesignModel.recurrent`, ``chunk``, ``step``, ``initial_state`` and
``state_size`` call the object here that :data:`DESIGN_WRITES` keeps under its ``write`` name:

* :class:`FilterWrite` — the four write models of the general filter (``bayes``, ``diagonal``,
  ``reset``, ``latent``: :mod:`bayeslayer.ops.bayesian_layer.write_models`), run by the recurrent oracle and, through
  the backend dispatch (:mod:`bayeslayer.ops.backend`), the chunked path or the Triton kernels;
* :class:`LowRankWrite` — ``lowrank``: the low-rank-plus-diagonal precision of
  :mod:`bayeslayer.ops.bayesian_layer.lowrank` (PyTorch only).

The filter's per-token inputs travel as one :class:`~bayeslayer.ops.bayesian_layer.prepare.FilterInputs`.
"""

from __future__ import annotations

from ..ops.backend import BackendError, dispatch_chunk, dispatch_step, forced_backend
from ..ops.bayesian_layer.lowrank import (
    check_projection,
    check_rank,
    initial_lowrank_state,
    lowrank_chunk,
    lowrank_recurrent,
)
from ..ops.bayesian_layer.prepare import FilterInputs, FilterOutput
from ..ops.bayesian_layer.recurrent import filter_recurrent, initial_bl_state
from ..ops.bayesian_layer.write_models import BAYES, DIAGONAL, LATENT, RESET, WriteModel


class DesignWrite:
    """A design's write model as the design model runs it (subclasses: :class:`FilterWrite`,
    :class:`LowRankWrite`).  ``design`` below is the calling :class:`~bayeslayer.design.DesignModel`."""

    name: str
    has_covariance: bool
    #: whether a design of this write model may fix its prior λ to a constant (``DesignModel.fixed_lam``)
    takes_fixed_lam: bool = False

    def check(self, design) -> None:
        """Refuse design fields this write model does not use (called when the design is built)."""
        if design.rank is not None:
            raise ValueError(f"rank applies only to write='lowrank', not {self.name!r}")

    def state_size(self, design, key_dim: int, value_dim: int, groups: int) -> int:
        raise NotImplementedError

    def recurrent(self, design, q, k, v, inputs: FilterInputs, *, p0, initial_state,
                  output_final_state: bool) -> FilterOutput:
        raise NotImplementedError

    def chunk(self, design, q, k, v, inputs: FilterInputs, *, p0, initial_state, output_final_state: bool,
              return_variance: bool, chunk_size, backend, cu_seqlens=None) -> FilterOutput:
        raise NotImplementedError

    def step(self, design, q, k, v, inputs: FilterInputs, *, state, backend) -> FilterOutput:
        raise NotImplementedError

    def initial_state(self, design, batch_size, num_heads, key_dim, value_dim, *, p0, groups, dtype, device):
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class FilterWrite(DesignWrite):
    """A write model of the general filter (:class:`bayeslayer.ops.bayesian_layer.write_models.WriteModel`)."""

    def __init__(self, model: WriteModel, *, takes_fixed_lam: bool = False) -> None:
        self.model = model
        self.name = model.name
        self.has_covariance = model.has_covariance
        self.takes_fixed_lam = takes_fixed_lam

    def state_size(self, design, key_dim, value_dim, groups):
        return self.model.state_size(key_dim, value_dim, groups)

    def recurrent(self, design, q, k, v, inputs, *, p0, initial_state, output_final_state):
        return filter_recurrent(q, k, v, write=self.model, **inputs.kwargs(), p0=p0, initial_state=initial_state,
                                output_final_state=output_final_state)

    def chunk(self, design, q, k, v, inputs, *, p0, initial_state, output_final_state, return_variance,
              chunk_size, backend, cu_seqlens=None):
        # the backend dispatch takes the write model's name (the Triton kernels' support table is by name)
        return dispatch_chunk(q, k, v, write=self.name, **inputs.kwargs(), p0=p0, initial_state=initial_state,
                              output_final_state=output_final_state, return_variance=return_variance,
                              chunk_size=chunk_size, backend=backend, cu_seqlens=cu_seqlens)

    def step(self, design, q, k, v, inputs, *, state, backend):
        return dispatch_step(q, k, v, write=self.name, **inputs.kwargs(), state=state, backend=backend)

    def initial_state(self, design, batch_size, num_heads, key_dim, value_dim, *, p0, groups, dtype, device):
        M, P = initial_bl_state(batch_size, num_heads, key_dim, value_dim, p0=p0, groups=groups,
                                dtype=dtype, device=device)
        return (M, P) if self.has_covariance else (M, None)


class LowRankWrite(DesignWrite):
    """Low-rank-plus-diagonal precision ``diag(υ) + W Wᵀ`` of ``design.rank`` columns, projected with
    ``design.projection`` after every write (:mod:`bayeslayer.ops.bayesian_layer.lowrank`); no Triton kernel."""

    name = "lowrank"
    has_covariance = True

    def check(self, design) -> None:
        check_rank(design.rank)
        check_projection(design.projection)
        if design.dynamics == "rotation":
            raise ValueError("the lowrank write model does not support rotation dynamics")

    def state_size(self, design, key_dim, value_dim, groups):
        return key_dim * value_dim + groups * key_dim * (check_rank(design.rank, key_dim) + 1)

    def _arguments(self, design, inputs: FilterInputs) -> dict:
        for name in ("lam", "gain"):
            if getattr(inputs, name) is not None:
                raise ValueError(f"write model 'lowrank' derives its gain from r2/ell2; do not pass {name}")
        return dict(rank=design.rank, projection=design.projection, r2=inputs.r2, ell2=inputs.ell2,
                    alpha=inputs.alpha, theta=inputs.theta)

    def _torch_only(self, design, backend) -> None:
        """The low-rank covariance runs on the PyTorch path only: a forced backend other than it says so."""
        forced = forced_backend(backend)
        if forced is not None and not forced.reference:
            raise BackendError(f"write model {self.name!r} ({design.name}) has no {forced.label} kernel; "
                               "use backend='auto' or 'torch'")

    def recurrent(self, design, q, k, v, inputs, *, p0, initial_state, output_final_state):
        return lowrank_recurrent(q, k, v, **self._arguments(design, inputs), p0=p0, initial_state=initial_state,
                                 output_final_state=output_final_state)

    def chunk(self, design, q, k, v, inputs, *, p0, initial_state, output_final_state, return_variance,
              chunk_size, backend, cu_seqlens=None):
        self._torch_only(design, backend)
        return lowrank_chunk(q, k, v, **self._arguments(design, inputs), p0=p0, initial_state=initial_state,
                             output_final_state=output_final_state, return_variance=return_variance,
                             chunk_size=chunk_size, cu_seqlens=cu_seqlens)

    def step(self, design, q, k, v, inputs, *, state, backend):
        self._torch_only(design, backend)
        return lowrank_recurrent(q, k, v, **self._arguments(design, inputs), initial_state=state,
                                 output_final_state=True, single_step=True)

    def initial_state(self, design, batch_size, num_heads, key_dim, value_dim, *, p0, groups, dtype, device):
        return initial_lowrank_state(batch_size, num_heads, key_dim, value_dim, rank=design.rank, p0=p0,
                                     groups=groups, dtype=dtype, device=device)


#: every design write model by name, in the order error messages list them
DESIGN_WRITES: dict[str, DesignWrite] = {
    w.name: w for w in (FilterWrite(BAYES), FilterWrite(DIAGONAL), FilterWrite(RESET, takes_fixed_lam=True),
                        FilterWrite(LATENT), LowRankWrite())
}


def get_design_write(write) -> DesignWrite:
    """The :class:`DesignWrite` named ``write``, or the ValueError a design model with it raises."""
    if isinstance(write, str) and write in DESIGN_WRITES:
        return DESIGN_WRITES[write]
    raise ValueError(f"write must be {'/'.join(DESIGN_WRITES)}, got {write!r}")


__all__ = ["DESIGN_WRITES", "DesignWrite", "FilterWrite", "LowRankWrite", "get_design_write"]

