"""Backend dispatch: which implementation runs a chunked pass or a decoding step.

Two implementations sit below this module and know nothing of each other or of it:

* ``torch`` — :func:`bayeslayer.ops.bayesian_layer.chunk.filter_chunk` and
  :func:`bayeslayer.ops.bayesian_layer.recurrent.filter_recurrent` (every write model and dynamics, any device);
* ``triton`` — :func:`bayeslayer.ops.bayesian_layer.chunk_triton.bl_chunk_triton` and
  :func:`bayeslayer.ops.bayesian_layer.step_triton.bl_step_triton` (the exact Kalman filter, write model ``bayes``,
  identity / scalar / diagonal decay; :mod:`bayeslayer.ops.bayesian_layer.triton_support` lists what they run).

``backend`` is ``"auto"`` (default), ``"torch"`` or ``"triton"``:

* ``"auto"``: the Triton kernels when the inputs are CUDA tensors, Triton is installed and the
  configuration is one the kernels implement; the PyTorch path otherwise (CPU tensors included,
  even with ``TRITON_INTERPRET=1``: the interpreter is for tests, not speed);
* ``"torch"``: always the PyTorch path;
* ``"triton"``: always the kernels (on CPU tensors only under ``TRITON_INTERPRET=1``), or a
  :class:`BackendError` that says why they cannot run (Triton missing; no CUDA device and
  ``TRITON_INTERPRET`` not 1; an unsupported write model, dynamics, head dim, chunk size or dtype).

A decoding step whose inputs need gradients runs the (differentiable) Triton chunk forward on a
one-token sequence instead of the step kernel, which is not differentiable.

Every caller goes through here: :func:`bl_chunk`, :func:`bl_step`, ``DesignModel.chunk/step``
(:func:`dispatch_chunk`, :func:`dispatch_step`), the layers and the language model (their
``backend`` argument / config field); the layers ask it (:func:`unsupported`) what the kernels run.
:data:`IMPLEMENTATIONS` is the registry of what each backend runs.  Import order is one-way:
``utils → bayesian_layer (prepare → chunk, recurrent → *_triton) → backend → design → layers → models``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .bayesian_layer.chunk import filter_chunk
from .bayesian_layer.chunk_triton import bl_chunk_triton  # called under this name (tests/triton_spy.py)
from .bayesian_layer.cp import filter_chunk_cp
from .bayesian_layer.prepare import FilterOutput
from .bayesian_layer.recurrent import filter_recurrent
from .bayesian_layer.step_triton import bl_step_triton  # called under this name (tests/triton_spy.py)
from .bayesian_layer.triton_support import BackendError, triton_unavailable, unsupported

# bl_chunk_triton's forward is the segment scan (ops/bayesian_layer/scan_triton.py; one segment, i.e. the
# chunk-serial covariance kernel, up to 4096 tokens); ``n_segments`` overrides its segment count.

__all__ = ["BACKENDS", "IMPLEMENTATIONS", "BackendError", "Implementation", "bl_chunk", "bl_step", "check_backend",
           "dispatch_chunk", "dispatch_step", "select_backend", "unsupported"]


def check_backend(backend, name: str = "backend") -> str:
    """``backend`` validated: one of :data:`BACKENDS` (``None`` means ``"auto"``)."""
    if backend is None:
        return "auto"
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"{name} must be one of {BACKENDS} (or None for 'auto'), got {backend!r}")
    return backend


def select_backend(
    backend,
    op: str,
    *,
    device: torch.device | str | None,
    write: str = "bayes",
    rotation: bool = False,
    head_dim: int | None = None,
    chunk_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> str:
    """``"torch"`` or ``"triton"`` for this call (rules in the module docstring).

    Raises :class:`BackendError` when ``backend="triton"`` cannot run, naming the reason.
    """
    backend = check_backend(backend)
    if backend == "torch":
        return "torch"
    if backend == "auto" and (device is None or torch.device(device).type != "cuda"):
        return "torch"
    reason = unsupported(op, write=write, rotation=rotation, head_dim=head_dim, chunk_size=chunk_size,
                         dtype=dtype)
    if reason is None:
        reason = triton_unavailable(device)
    if backend == "auto":
        return "triton" if reason is None else "torch"
    if reason is not None:
        raise BackendError(f"backend='triton' cannot run this {op}: {reason}")
    return "triton"


def _describe(q) -> tuple[torch.device | None, int | None, torch.dtype | None]:
    """Device, key dim and dtype of ``q`` for :func:`select_backend` (None where q is not a usable tensor:
    the chosen path's own validation then names the bad argument)."""
    if not isinstance(q, torch.Tensor) or q.dim() == 0:
        return None, None, None
    return q.device, q.shape[-1], q.dtype if q.is_floating_point() else None


def dispatch_chunk(
    q, k, v, *, write: str, r2=None, ell2=None, lam=None, gain=None, alpha=None, theta=None, p0=1.0,
    initial_state=None, output_final_state: bool = False, return_variance: bool = False,
    chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None, backend="auto", n_segments: int | None = None,
) -> FilterOutput:
    """The chunked filter of write model ``write`` on the selected backend (arguments of
    :func:`bayeslayer.ops.bayesian_layer.chunk.filter_chunk`).  ``n_segments``: the Triton path's segment count
    (see :func:`bl_chunk`); the PyTorch path has no segments and ignores it.

    On the Triton path ``FilterOutput.gain`` is ``None`` (the kernels do not return the per-token
    gain ``kᵀw``; the PyTorch path does).
    """
    device, D, dtype = _describe(q)
    if lam is not None or gain is not None:
        # not arguments of the Kalman filter: the PyTorch path's validation refuses them by name
        backend = "torch" if write == "bayes" else backend
    chosen = select_backend(backend, "chunk", device=device, write=write, rotation=theta is not None,
                            head_dim=D, chunk_size=chunk_size, dtype=dtype)
    return IMPLEMENTATIONS[chosen].chunk(
        q, k, v, write=write, r2=r2, ell2=ell2, lam=lam, gain=gain, alpha=alpha, theta=theta, p0=p0,
        initial_state=initial_state, output_final_state=output_final_state, return_variance=return_variance,
        chunk_size=chunk_size, cu_seqlens=cu_seqlens, n_segments=n_segments,
    )


def _chunk_torch(q, k, v, *, n_segments=None, **kwargs) -> FilterOutput:
    """The PyTorch chunked path (no segments: ``n_segments`` is the Triton path's)."""
    return filter_chunk(q, k, v, **kwargs)


def _chunk_triton(q, k, v, *, write, r2, ell2, lam, gain, alpha, theta, p0, initial_state, output_final_state,
                  return_variance, chunk_size, cu_seqlens, n_segments) -> FilterOutput:
    """The Triton kernels (write model ``bayes``; ``select_backend`` has refused anything else)."""
    out = bl_chunk_triton(
        q, k, v, r2, ell2, alpha=alpha, p0=p0, initial_state=initial_state,
        output_final_state=output_final_state, return_variance=return_variance, chunk_size=chunk_size,
        cu_seqlens=cu_seqlens, n_segments=n_segments,
    )
    o, var, state = out if return_variance else (out[0], None, out[1])
    return FilterOutput(o, var, None, state)


def _needs_grad(*xs) -> bool:
    if not torch.is_grad_enabled():
        return False
    for x in xs:
        if isinstance(x, (tuple, list)):
            if _needs_grad(*x):
                return True
        elif isinstance(x, torch.Tensor) and x.requires_grad:
            return True
    return False


def dispatch_step(
    q, k, v, *, write: str, state, r2=None, ell2=None, lam=None, gain=None, alpha=None, theta=None,
    backend="auto",
) -> FilterOutput:
    """One decoding step of write model ``write`` on the selected backend (shapes without the time
    axis; ``state`` required; arguments of :func:`bayeslayer.ops.bayesian_layer.recurrent.filter_recurrent` with
    ``single_step=True``).  Returns the variance whenever the write model defines one, and
    ``gain=None`` on the Triton path."""
    if state is None:
        raise ValueError("state is required for a decoding step; start from bayeslayer.ops.initial_bl_state()")
    device, D, dtype = _describe(q)
    if lam is not None or gain is not None:
        backend = "torch" if write == "bayes" else backend
    chosen = select_backend(backend, "step", device=device, write=write, rotation=theta is not None,
                            head_dim=D, dtype=dtype)
    return IMPLEMENTATIONS[chosen].step(q, k, v, write=write, state=state, r2=r2, ell2=ell2, lam=lam, gain=gain,
                                        alpha=alpha, theta=theta)


def _step_torch(q, k, v, *, write, state, r2, ell2, lam, gain, alpha, theta) -> FilterOutput:
    """One step of the recurrent oracle (every write model and dynamics)."""
    return filter_recurrent(q, k, v, write=write, r2=r2, ell2=ell2, lam=lam, gain=gain, alpha=alpha,
                            theta=theta, initial_state=state, output_final_state=True, single_step=True)


def _step_triton(q, k, v, *, write, state, r2, ell2, lam, gain, alpha, theta) -> FilterOutput:
    """The fused step kernel, or (inputs that need gradients) the chunk kernels on a one-token sequence."""
    if _needs_grad(q, k, v, r2, ell2, alpha, state):
        # the step kernel is not differentiable; the chunk forward (and its backward) on one token is
        o, var, new_state = bl_chunk_triton(
            q[:, None], k[:, None], v[:, None], r2[:, None], ell2[:, None],
            alpha=None if alpha is None else alpha[:, None], initial_state=state, output_final_state=True,
            return_variance=True, chunk_size=16,
        )
        return FilterOutput(o[:, 0], var[:, 0], None, new_state)
    o, var, new_state = bl_step_triton(q, k, v, r2, ell2, alpha, state=state, return_variance=True)
    return FilterOutput(o, var, None, new_state)


class Implementation(NamedTuple):
    """What a backend runs: ``chunk(q, k, v, *, write, r2, ell2, lam, gain, alpha, theta, p0, initial_state,
    output_final_state, return_variance, chunk_size, cu_seqlens, n_segments)`` and ``step(q, k, v, *, write,
    state, r2, ell2, lam, gain, alpha, theta)``, both returning a :class:`FilterOutput`."""

    chunk: Callable[..., FilterOutput]
    step: Callable[..., FilterOutput]


#: the implementations :func:`select_backend` chooses between, by name (``"auto"`` picks one of them per call).
#: Each looks its entry points up in this module when it runs (so ``tests/triton_spy.py`` can wrap them).
IMPLEMENTATIONS: dict[str, Implementation] = {
    "torch": Implementation(chunk=_chunk_torch, step=_step_torch),
    "triton": Implementation(chunk=_chunk_triton, step=_step_triton),
}
#: the names ``backend`` takes: ``"auto"`` and the keys of :data:`IMPLEMENTATIONS`
BACKENDS = ("auto", *IMPLEMENTATIONS)


def bl_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r2, ell2, alpha=None, theta=None, p0=1.0,
             initial_state=None, output_final_state: bool = False, return_variance: bool = False, chunk_size: int = 64,
             cu_seqlens: torch.Tensor | None = None, backend: str | None = "auto", n_segments: int | None = None,
             cp_context=None):
    """The Bayesian Layer, chunked: same contract and results as :func:`bayeslayer.ops.bl_recurrent`.

    Cost per token ≈ 2D² (``K̃ P_0`` and the ``P_C`` update) + O(C(D + m)) + O(Dm)
    multiply-adds, all matmul-shaped, plus a C×C Cholesky per chunk.  Diagonal and
    rotation dynamics use ``[C, C, D]`` ratio tensors on the PyTorch path (O(C·D) per token).

    ``cu_seqlens`` (``[N + 1]`` int, B = 1) packs N variable-length sequences along T like
    flash-linear-attention; ``initial_state``/final state are then per sequence (N in place of B).
    A wide prior (``p0·‖k‖²/r² > 1e4``) or a float64 ``P`` runs the covariance pass in float64 and
    returns ``P`` in float64 (:func:`~bayeslayer.ops.utils.validation.covariance_dtype`), a wide prior the mean
    pass too; on the PyTorch path a group of chunks where ``max diag(P)·‖k‖²/r²`` can exceed 1e2 runs
    its covariance pass in float64 as well (:func:`~bayeslayer.ops.bayesian_layer.chunk.chunk_group_dtype`); a chunk
    that is not positive definite even so raises a ``ValueError`` naming p0 and the safe range.
    ``backend``: ``"auto"`` (Triton kernels for CUDA tensors when Triton is installed and the
    configuration is supported, else PyTorch), ``"torch"``, or ``"triton"`` (the kernels, or a
    :class:`BackendError` saying why not) — see the module docstring.
    ``n_segments``: on the Triton path the covariance pass is an exact segment scan over the longest
    sequence split into this many segments (None: chosen from B·H and T, one segment up to 4096
    tokens; segments never cross a ``cu_seqlens`` boundary); the PyTorch path ignores it.

    ``cp_context``: a :class:`~bayeslayer.ops.bayesian_layer.cp.CPContext`
    (:func:`~bayeslayer.ops.bayesian_layer.cp.build_cp_context`) runs this rank's slice of a context-parallel sequence
    (:mod:`bayeslayer.ops.bayesian_layer.cp`, PyTorch path): q, k, v, ... hold the slice, ``initial_state`` the global
    sequences' states, and the final state those of the sequences that end on this rank (``cp_context.final_seqs``);
    ``cu_seqlens`` goes into the context instead.

    Returns ``(o, state)`` or, with ``return_variance``, ``(o, variance [B, T, H, G], state)``.
    """
    if cp_context is not None:
        if cu_seqlens is not None:
            raise ValueError("with cp_context, pass the global cu_seqlens to build_cp_context, not cu_seqlens")
        if check_backend(backend) == "triton":
            raise BackendError("backend='triton' cannot run with cp_context: context parallelism runs on the "
                               "PyTorch path")
        out = filter_chunk_cp(q, k, v, r2, ell2, ctx=cp_context, alpha=alpha, theta=theta, p0=p0,
                              initial_state=initial_state, output_final_state=output_final_state,
                              return_variance=return_variance, chunk_size=chunk_size)
        return (out.o, out.variance, out.state) if return_variance else (out.o, out.state)
    out = dispatch_chunk(
        q, k, v, write="bayes", r2=r2, ell2=ell2, alpha=alpha, theta=theta, p0=p0,
        initial_state=initial_state, output_final_state=output_final_state,
        return_variance=return_variance, chunk_size=chunk_size, cu_seqlens=cu_seqlens, backend=backend,
        n_segments=n_segments,
    )
    if return_variance:
        return out.o, out.variance, out.state
    return out.o, out.state


def bl_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r2, ell2, alpha=None, theta=None, state=None,
            return_variance: bool = False, backend: str | None = "auto"):
    """One decoding step of the Bayesian Layer.

    Shapes are those of :func:`bayeslayer.ops.bl_recurrent` without the time axis: q, k ``[B, H, D]``,
    v ``[B, H, m]``, r2 ``[B, H]`` / ``[B, H, G]``, ell2 ``[B, H]``, alpha ``[B, H]`` /
    ``[B, H, D]`` (``[B, H, D/2]`` with theta), theta ``[B, H, D/2]``.  ``state = (M, P)``
    is required (start from :func:`bayeslayer.ops.initial_bl_state`) and not modified; on the PyTorch
    path its ``P`` is validated like :func:`bayeslayer.ops.bl_recurrent`'s (symmetric, one Cholesky)
    while value checks are on, and the new ``P`` is float64 when the given one was or the prior is wide
    (decoding then continues in float64).  Returns
    ``(o [B, H, m], new_state)`` or ``(o, variance [B, H, G], new_state)``.  ``backend`` as in
    :func:`bl_chunk`; on Triton this is the fused step kernel (:func:`bl_step_triton`).
    """
    if state is None:
        raise ValueError("state is required for bl_step; start from bayeslayer.ops.initial_bl_state(...)")
    out = dispatch_step(q, k, v, write="bayes", state=state, r2=r2, ell2=ell2, alpha=alpha, theta=theta,
                        backend=backend)
    if return_variance:
        return out.o, out.variance, out.state
    return out.o, out.state
