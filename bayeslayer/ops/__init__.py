"""Pure tensor functions: the Bayesian Layer and its design-model family (no ``nn.Module`` here).

Public contract (sequence-first, like flash-linear-attention)::

    o, state = bl_recurrent(q, k, v, r2, ell2, alpha=None, theta=None, p0=1.0,
                            initial_state=None, output_final_state=False, return_variance=False)
    o, state = bl_chunk(q, k, v, r2, ell2, ..., chunk_size=64, backend="auto")
    o, state = bl_step(q, k, v, r2, ell2, alpha=None, theta=None, state=(M, P), backend="auto")

``bl_chunk`` and ``bl_step`` dispatch (:mod:`.backend`): CUDA tensors run the Triton kernels
(:mod:`.bayesian_layer.chunk_triton`, :mod:`.bayesian_layer.step_triton`) when Triton is installed,
everything else the PyTorch path; ``backend="torch"`` or ``"triton"`` forces one.  The backends are objects
(:class:`~.backend.Backend`) in a registry; :func:`~.backend.register_backend` adds one.  The op's files,
one per job, are in :mod:`.bayesian_layer`; what every op shares is in :mod:`.utils`.
"""

from .backend import Backend, BackendCall, BackendError, backend_names, bl_chunk, bl_step, register_backend
from .bayesian_layer.chunk import filter_chunk
from .bayesian_layer.chunk_triton import chain_failures
from .bayesian_layer.cp import CPContext, build_cp_context
from .bayesian_layer.prepare import FilterInputs, FilterOutput
from .bayesian_layer.recurrent import bl_recurrent, filter_recurrent
from .bayesian_layer.write_models import WRITE_MODELS, WriteModel, get_write_model, initial_bl_state
from .utils.validation import set_value_checks, value_checks

__all__ = [
    "WRITE_MODELS",
    "Backend",
    "BackendCall",
    "BackendError",
    "CPContext",
    "FilterInputs",
    "FilterOutput",
    "WriteModel",
    "backend_names",
    "bl_chunk",
    "build_cp_context",
    "chain_failures",
    "bl_recurrent",
    "bl_step",
    "filter_chunk",
    "filter_recurrent",
    "get_write_model",
    "initial_bl_state",
    "register_backend",
    "set_value_checks",
    "value_checks",
]
