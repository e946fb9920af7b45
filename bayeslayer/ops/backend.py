"""Backend dispatch: which implementation runs a chunked pass or a decoding step.

A backend is an object (:class:`Backend`) in the registry :data:`BACKEND_REGISTRY`, as in
flash-linear-attention's backend registry: it says whether it can run at all here (``available()``),
why it cannot run one call (``unsupported(call) -> reason | None``), and runs it (``chunk``, ``step``).
Two are registered; the functions they run know nothing of each other or of this module:

* ``torch`` (:class:`TorchBackend`) — :func:`bayeslayer.ops.bayesian_layer.chunk.filter_chunk` and
  :func:`bayeslayer.ops.bayesian_layer.recurrent.filter_recurrent` (every write model and dynamics, any device);
  the reference the others are checked against, and what a call no other backend takes runs on;
* ``triton`` (:class:`TritonBackend`) — :func:`bayeslayer.ops.bayesian_layer.chunk_triton.bl_chunk_triton` and
  :func:`bayeslayer.ops.bayesian_layer.step_triton.bl_step_triton` (the exact Kalman filter, write model ``bayes``,
  identity / scalar / diagonal decay; :mod:`bayeslayer.ops.bayesian_layer.triton_support` lists what they run).

``backend`` is ``"auto"`` (default) or the name of a registered backend (``"torch"``, ``"triton"``):

* ``"auto"``: the first backend, in increasing :attr:`Backend.priority` (fla's convention: lower runs first), that
  is available, takes the inputs' device under ``"auto"`` (:attr:`Backend.auto_devices`) and supports the call.
  So the Triton kernels when the inputs are CUDA tensors, Triton is installed and the configuration is one the
  kernels implement; the PyTorch path otherwise (CPU tensors included, even with ``TRITON_INTERPRET=1``: the
  interpreter is for tests, not speed);
* ``"torch"``: always the PyTorch path;
* ``"triton"``: always the kernels (on CPU tensors only under ``TRITON_INTERPRET=1``), or a
  :class:`BackendError` that says why they cannot run (Triton missing; no CUDA device and
  ``TRITON_INTERPRET`` not 1; an unsupported write model, dynamics, head dim, chunk size or dtype).

A decoding step whose inputs need gradients runs the (differentiable) Triton chunk forward on a
one-token sequence instead of the step kernel, which is not differentiable.

Every caller goes through here: :func:`bl_chunk`, :func:`bl_step`, ``DesignModel.chunk/step``
(:func:`dispatch_chunk`, :func:`dispatch_step`), the layers and the language model (their
``backend`` argument / config field), which ask the registry what a forced backend runs
(:func:`backend_unsupported`, :func:`forced_backend`) instead of testing its name.  A new backend is a
:class:`Backend` subclass and one :func:`register_backend` call (README.md, "Add a backend").  Import order is
one-way: ``utils → bayesian_layer (prepare → chunk, recurrent → *_triton) → backend → design → layers → models``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .bayesian_layer import triton_support as support
from .bayesian_layer.chunk import filter_chunk
from .bayesian_layer.chunk_triton import bl_chunk_triton
from .bayesian_layer.cp import filter_chunk_cp
from .bayesian_layer.prepare import FilterOutput
from .bayesian_layer.recurrent import filter_recurrent
from .bayesian_layer.step_triton import bl_step_triton
from .bayesian_layer.triton_support import BackendError
from .bayesian_layer.write_models import WriteModel, get_write_model

__all__ = ["BACKEND_REGISTRY", "Backend", "BackendCall", "BackendError", "TorchBackend", "TritonBackend",
           "backend_names", "backend_unsupported", "bl_chunk", "bl_step", "check_backend", "dispatch_chunk",
           "dispatch_step", "forced_backend", "get_backend", "register_backend", "select_backend"]


@dataclass(frozen=True)
class BackendCall:
    """What a backend is asked about: one ``op`` (``"chunk"`` or ``"step"``) of the write model named ``write``.

    Fields left at None are not checked: a layer asks about its configuration before it has seen a tensor
    (``device=None``), and a step has no chunk size."""

    op: str
    device: torch.device | None = None
    write: str = "bayes"
    rotation: bool = False
    head_dim: int | None = None
    chunk_size: int | None = None
    dtype: torch.dtype | None = None

    def __post_init__(self):
        if self.op not in support.OPS:
            raise ValueError(f"op must be one of {support.OPS}, got {self.op!r}")
        if self.device is not None and not isinstance(self.device, torch.device):
            object.__setattr__(self, "device", torch.device(self.device))


class Backend:
    """One implementation of the filter's chunked pass and decoding step, as the dispatch sees it.

    A subclass sets :attr:`name` (the ``backend=`` value that forces it), :attr:`label` (its name in
    messages) and :attr:`priority`, implements :meth:`chunk` and :meth:`step` and, when it cannot run
    everything everywhere, :meth:`available` and :meth:`unsupported`; :func:`register_backend` adds it.
    """

    #: the ``backend=`` value that forces it
    name: str = ""
    #: its name in messages ("Triton")
    label: str = ""
    #: ``"auto"`` asks the backends in increasing priority (lower first, fla's convention; ties in
    #: registration order)
    priority: int = 50
    #: the device types (``torch.device.type``) for which ``"auto"`` may choose it; None: any
    auto_devices: tuple[str, ...] | None = None
    #: True only for the PyTorch path: every configuration runs on it, mixers without a ``backend``
    #: argument included, so forcing it never asks for something a model cannot do
    reference: bool = False

    def available(self) -> bool:
        """Whether it can run anything on this machine (e.g. its package is installed); cheap."""
        return True

    def unsupported(self, call: BackendCall) -> str | None:
        """Why it cannot run ``call`` (a sentence for a :class:`BackendError`), or None when it can.

        Covers the configuration and, when ``call.device`` is given, the device (and so whether it is
        available at all); fields of ``call`` left at None are not checked."""
        return None

    def chunk(self, q, k, v, *, write, r2, ell2, lam, gain, alpha, theta, p0, initial_state, output_final_state,
              return_variance, chunk_size, cu_seqlens, n_segments) -> FilterOutput:
        """The chunked filter (arguments of :func:`bayeslayer.ops.bayesian_layer.chunk.filter_chunk`, ``write``
        as a :class:`~bayeslayer.ops.bayesian_layer.write_models.WriteModel`, and ``n_segments``, which a backend
        without segments ignores)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement chunk")

    def step(self, q, k, v, *, write, state, r2, ell2, lam, gain, alpha, theta) -> FilterOutput:
        """One decoding step (arguments of :func:`bayeslayer.ops.bayesian_layer.recurrent.filter_recurrent`
        with ``single_step=True``, ``write`` as a :class:`~bayeslayer.ops.bayesian_layer.write_models.WriteModel`;
        ``state`` is required); the variance whenever the write model defines one."""
        raise NotImplementedError(f"{type(self).__name__} does not implement step")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} priority={self.priority}>"


class TorchBackend(Backend):
    """The PyTorch path: every write model and dynamics, any device, differentiable."""

    name = "torch"
    label = "PyTorch"
    priority = 100
    reference = True

    def chunk(self, q, k, v, *, n_segments=None, **kwargs) -> FilterOutput:
        return filter_chunk(q, k, v, **kwargs)

    def step(self, q, k, v, *, write, state, r2, ell2, lam, gain, alpha, theta) -> FilterOutput:
        return filter_recurrent(q, k, v, write=write, r2=r2, ell2=ell2, lam=lam, gain=gain, alpha=alpha,
                                theta=theta, initial_state=state, output_final_state=True, single_step=True)


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


class TritonBackend(Backend):
    """The Triton kernels: the chunked forward and backward of :func:`bl_chunk_triton` (the covariance chain on
    chip, or the segment scan where its rule says so; ``n_segments`` forces the scan), and the fused step kernel.

    ``FilterOutput.gain`` is None (the kernels do not return the per-token gain ``kᵀw``)."""

    name = "triton"
    label = "Triton"
    priority = 10
    auto_devices = ("cuda",)  # CPU tensors run only in Triton's interpreter: for tests, not speed

    def available(self) -> bool:
        return support.triton_installed()

    def unsupported(self, call: BackendCall) -> str | None:
        reason = support.unsupported(call.op, write=call.write, rotation=call.rotation, head_dim=call.head_dim,
                                     chunk_size=call.chunk_size, dtype=call.dtype)
        if reason is None and call.device is not None:
            reason = support.triton_unavailable(call.device)
        return reason

    def chunk(self, q, k, v, *, write, r2, ell2, lam, gain, alpha, theta, p0, initial_state, output_final_state,
              return_variance, chunk_size, cu_seqlens, n_segments) -> FilterOutput:
        # write model ``bayes`` without rotation: the dispatch has refused anything else
        out = bl_chunk_triton(
            q, k, v, r2, ell2, alpha=alpha, p0=p0, initial_state=initial_state,
            output_final_state=output_final_state, return_variance=return_variance, chunk_size=chunk_size,
            cu_seqlens=cu_seqlens, n_segments=n_segments,
        )
        o, var, state = out if return_variance else (out[0], None, out[1])
        return FilterOutput(o, var, None, state)

    def step(self, q, k, v, *, write, state, r2, ell2, lam, gain, alpha, theta) -> FilterOutput:
        """The fused step kernel, or (inputs that need gradients) :meth:`chunk` on a one-token sequence."""
        if _needs_grad(q, k, v, r2, ell2, alpha, state):
            # the step kernel is not differentiable; the chunk forward (and its backward) on one token is
            out = self.chunk(
                q[:, None], k[:, None], v[:, None], write=write, r2=r2[:, None], ell2=ell2[:, None], lam=None,
                gain=None, alpha=None if alpha is None else alpha[:, None], theta=None, p0=1.0,
                initial_state=state, output_final_state=True, return_variance=True, chunk_size=16,
                cu_seqlens=None, n_segments=None,
            )
            return FilterOutput(out.o[:, 0], out.variance[:, 0], None, out.state)
        o, var, new_state = bl_step_triton(q, k, v, r2, ell2, alpha, state=state, return_variance=True)
        return FilterOutput(o, var, None, new_state)


#: every registered backend by name, in registration order: the values ``backend`` takes besides ``"auto"``.
#: Add one with :func:`register_backend`.
BACKEND_REGISTRY: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    """Register ``backend`` (a :class:`Backend` instance) under ``backend.name``; returns it.

    From then on ``backend=backend.name`` forces it everywhere a ``backend`` is taken, and ``"auto"`` considers
    it at its :attr:`~Backend.priority`.  A name already taken, or ``"auto"``, raises ``ValueError``."""
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a bayeslayer.ops.backend.Backend instance, got {backend!r}")
    name = backend.name
    if not isinstance(name, str) or not name.isidentifier() or name == "auto":
        raise ValueError(f"backend.name must be a name (letters, digits, underscores) other than 'auto', got {name!r}")
    if not isinstance(backend.label, str) or not backend.label.strip():
        raise ValueError(f"backend.label must be a non-empty string, got {backend.label!r}")
    if isinstance(backend.priority, bool) or not isinstance(backend.priority, int):
        raise TypeError(f"backend.priority must be an int, got {backend.priority!r}")
    if name in BACKEND_REGISTRY:
        raise ValueError(f"backend {name!r} is already registered ({BACKEND_REGISTRY[name]!r})")
    BACKEND_REGISTRY[name] = backend
    return backend


register_backend(TorchBackend())
register_backend(TritonBackend())


def backend_names() -> tuple[str, ...]:
    """The values ``backend`` takes: ``"auto"`` and the registered backends' names."""
    return ("auto", *BACKEND_REGISTRY)


def check_backend(backend, name: str = "backend") -> str:
    """``backend`` validated: one of :func:`backend_names` (``None`` means ``"auto"``)."""
    if backend is None:
        return "auto"
    names = backend_names()
    if not isinstance(backend, str) or backend not in names:
        raise ValueError(f"{name} must be one of {names} (or None for 'auto'), got {backend!r}")
    return backend


def get_backend(name: str) -> Backend:
    """The registered backend called ``name``."""
    if not isinstance(name, str) or name not in BACKEND_REGISTRY:
        raise ValueError(f"name must be a registered backend, one of {tuple(BACKEND_REGISTRY)}, got {name!r}")
    return BACKEND_REGISTRY[name]


def forced_backend(backend) -> Backend | None:
    """The backend that the value ``backend`` forces (validated; None for ``"auto"``, which chooses per call)."""
    backend = check_backend(backend)
    return None if backend == "auto" else BACKEND_REGISTRY[backend]


def backend_unsupported(backend, op: str, *, write: str = "bayes", rotation: bool = False,
                        head_dim: int | None = None, chunk_size: int | None = None,
                        dtype: torch.dtype | None = None) -> str | None:
    """Why the backend that ``backend`` forces cannot run an ``op`` of this configuration (the device is not
    asked: that is checked when the call runs), or None; always None for ``"auto"``, which falls back."""
    forced = forced_backend(backend)
    if forced is None:
        return None
    return forced.unsupported(BackendCall(op, write=write, rotation=rotation, head_dim=head_dim,
                                          chunk_size=chunk_size, dtype=dtype))


def _select(backend, call: BackendCall) -> Backend:
    forced = forced_backend(backend)
    if forced is not None:
        reason = forced.unsupported(call)
        if reason is not None:
            raise BackendError(f"backend={forced.name!r} cannot run this {call.op}: {reason}")
        return forced
    device_type = None if call.device is None else call.device.type
    for candidate in sorted(BACKEND_REGISTRY.values(), key=lambda b: b.priority):
        if candidate.auto_devices is not None and device_type not in candidate.auto_devices:
            continue
        if candidate.available() and candidate.unsupported(call) is None:
            return candidate
    raise BackendError(f"no registered backend can run this {call.op} ({call}); registered: "
                       f"{tuple(BACKEND_REGISTRY)}")


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
    """The name of the backend that runs this call (rules in the module docstring).

    Raises :class:`BackendError` when a forced backend cannot run it, naming the reason.
    """
    call = BackendCall(op, device=device, write=write, rotation=rotation, head_dim=head_dim,
                       chunk_size=chunk_size, dtype=dtype)
    return _select(backend, call).name


def _describe(q) -> tuple[torch.device | None, int | None, torch.dtype | None]:
    """Device, key dim and dtype of ``q`` for :func:`select_backend` (None where q is not a usable tensor:
    the chosen path's own validation then names the bad argument)."""
    if not isinstance(q, torch.Tensor) or q.dim() == 0:
        return None, None, None
    return q.device, q.shape[-1], q.dtype if q.is_floating_point() else None


def dispatch_chunk(
    q, k, v, *, write: str | WriteModel, r2=None, ell2=None, lam=None, gain=None, alpha=None, theta=None, p0=1.0,
    initial_state=None, output_final_state: bool = False, return_variance: bool = False,
    chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None, backend="auto", n_segments: int | None = None,
) -> FilterOutput:
    """The chunked filter of write model ``write`` (a name or a
    :class:`~bayeslayer.ops.bayesian_layer.write_models.WriteModel`, e.g. a
    :class:`~bayeslayer.ops.bayesian_layer.lowrank.LowRankWrite`) on the selected backend (arguments of
    :func:`bayeslayer.ops.bayesian_layer.chunk.filter_chunk`).  ``n_segments``: the Triton path's segment count
    (see :func:`bl_chunk`); the PyTorch path has no segments and ignores it.

    On the Triton path ``FilterOutput.gain`` is ``None`` (the kernels do not return the per-token
    gain ``kᵀw``; the PyTorch path does).
    """
    write = get_write_model(write)
    device, D, dtype = _describe(q)
    if lam is not None or gain is not None:
        # not arguments of the Kalman filter: the PyTorch path's validation refuses them by name
        backend = "torch" if write.name == "bayes" else backend
    chosen = _select(backend, BackendCall("chunk", device=device, write=write.name, rotation=theta is not None,
                                          head_dim=D, chunk_size=chunk_size, dtype=dtype))
    return chosen.chunk(
        q, k, v, write=write, r2=r2, ell2=ell2, lam=lam, gain=gain, alpha=alpha, theta=theta, p0=p0,
        initial_state=initial_state, output_final_state=output_final_state, return_variance=return_variance,
        chunk_size=chunk_size, cu_seqlens=cu_seqlens, n_segments=n_segments,
    )


def dispatch_step(
    q, k, v, *, write: str | WriteModel, state, r2=None, ell2=None, lam=None, gain=None, alpha=None, theta=None,
    backend="auto",
) -> FilterOutput:
    """One decoding step of write model ``write`` on the selected backend (shapes without the time
    axis; ``state`` required; arguments of :func:`bayeslayer.ops.bayesian_layer.recurrent.filter_recurrent` with
    ``single_step=True``).  Returns the variance whenever the write model defines one, and
    ``gain=None`` on the Triton path."""
    if state is None:
        raise ValueError("state is required for a decoding step; start from bayeslayer.ops.initial_bl_state()")
    write = get_write_model(write)
    device, D, dtype = _describe(q)
    if lam is not None or gain is not None:
        backend = "torch" if write.name == "bayes" else backend
    chosen = _select(backend, BackendCall("step", device=device, write=write.name, rotation=theta is not None,
                                          head_dim=D, dtype=dtype))
    return chosen.step(q, k, v, write=write, state=state, r2=r2, ell2=ell2, lam=lam, gain=gain, alpha=alpha,
                       theta=theta)


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
    Precision is static (:mod:`bayeslayer.ops.utils.validation`): the PyTorch path carries the covariance in
    float64 whatever the input dtype and returns ``P`` in the dtype it came in (a float32 state asked to hold
    a wide prior, ``p0·‖k‖²/r² > 1e4``, warns in eager mode: pass a float64 state); a chunk that is not
    positive definite even so raises a ``ValueError`` naming p0 and the safe range (an eager value check).
    ``backend``: ``"auto"`` (Triton kernels for CUDA tensors when Triton is installed and the
    configuration is supported, else PyTorch), ``"torch"``, or ``"triton"`` (the kernels, or a
    :class:`BackendError` saying why not) — see the module docstring.
    ``n_segments``: on the Triton path, run the covariance pass as the exact segment scan with the longest
    sequence split into this many segments (segments never cross a ``cu_seqlens`` boundary; None: the
    covariance chain, or the scan where :func:`bayeslayer.ops.bayesian_layer.chunk_triton.covariance_path` says
    so); the PyTorch path ignores it.

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
        forced = forced_backend(backend)
        if forced is not None and not forced.reference:
            raise BackendError(f"backend={forced.name!r} cannot run with cp_context: context parallelism runs on "
                               "the PyTorch path")
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
    while value checks are on; the covariance is computed in float64 and the new ``P`` has the given one's
    dtype (decode from a float64 state for a wide prior: a float32 one warns).  Returns
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
