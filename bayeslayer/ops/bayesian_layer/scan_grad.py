"""The whole backward of the segment-scan forward, composed, and the autograd Function that runs it.

The pieces of docs/theory.md §6.4–6.5 wired together.  The forward (packed, folded tensors after
:func:`bayeslayer.ops.bayesian_layer.scan.prepare_scan`) is the covariance scan (Phase A, B, C) followed by the mean
pass on the substituted tensors ``kw = L⁻¹(γ⊙K)``, ``vu = L⁻¹V``.  Its backward, :func:`scan_backward`,
chains three adjoints that exist on their own and are tested on their own::

    B1  mean pass      mean_pass_fla.mean_pass_fla_backward   (do, dM)        -> dq, dW, dkw, dvu, dlog α, dM0
        substitution   mean_pass_fla.substitution_backward    (dkw, dvu)      -> dL⁻¹, dK, dV, dlog α (+ K̃ term)
    B2–B4 covariance   scan_backward.covariance_scan_backward (twin) or
                       scan_backward_triton.covariance_scan_backward_triton
                                                         (dW, dL⁻¹, dvar, dP) -> dq, dk, dr², dℓ², dlog α, dP0

and sums what reaches the same input (``q``: variance path + mean pass; ``k``: covariance pass +
substitution; ``log α``: all three).  :class:`ScanFunction` puts it behind autograd with the forward
left pluggable (:func:`forward_packed_reference`, the plain-PyTorch twin, or the Triton forward of
``ops/bayesian_layer/chunk_triton.py``); ``prepare_scan``'s own ops (α → log α, group folding, ``p0 → P0``, the
packing) and ``finish_scan``'s unfolding stay outside it, so plain autograd differentiates them.

What the forward keeps (:class:`ScanSaved`), chosen for memory — nothing of size ``[T, D, D]``:

- stored: the write keys ``W`` ``[NT, H', D]`` and the per-token rows of every chunk's ``L⁻¹``
  ``[NT, H', C]`` (the mean pass and the substitution need them; recomputing them is a replay of the
  whole covariance pass); the segment-start checkpoints ``P_s`` ``[S, H', D, D]``; Phase A's ``A_s``,
  ``J_s`` ``[S − N, H', D, D]`` (float64) when the forward ran Phase A on its own (the Triton forward
  does; they spare B3 a second Phase A), else recomputed by the backward;
- recomputed: ``kw``, ``vu`` and ``g`` (one batched product per chunk from the stored ``L⁻¹``),
  β, ``L⁻¹`` and every other per-chunk quantity of the covariance adjoint (replayed from ``P_s`` in
  B2 and B4), the mean pass's chunk states (fla recomputes them with ``fwd_h``, as GDN's backward does).

Gradients of the covariance ``P0`` come back symmetrised (only that part is defined for a covariance;
``p0`` and any symmetric parametrisation of ``P0`` get the exact gradient).

Which covariance backward runs is explicit, ``ScanSpec.covariance`` (:data:`COVARIANCE_BACKWARDS`):
``"twin"`` (the default, what :func:`forward_packed_reference` / :func:`bl_scan_autograd` run, and the float64
reference): the plain-PyTorch :func:`~bayeslayer.ops.bayesian_layer.scan_backward.covariance_scan_backward`, a Python
loop over the chunk positions of a segment (all segments and heads batched), twice (B2, B4) — counted under the
interpreter (T = 128 and 256, C = 16, one segment, D = 16), the whole backward then dispatched 8017 / 15433 PyTorch
ops, the covariance twin ≈ 920 per chunk position.  ``"triton"`` (what the Triton forward,
``bl_chunk_triton(path="scan")``, sets): ``covariance_scan_backward_triton``, the B2, B3, B4 kernels on the stored
Phase A elements (a launch count independent of T), its failure flag checked once after it
(:func:`~bayeslayer.ops.bayesian_layer.scan.raise_if_failed`).  ``bl_chunk_triton`` runs this backward wherever it
runs the segment scan (``chunk_triton.covariance_path``); the covariance chain has its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..utils.validation import split_state
from . import mean_pass_fla, scan
from .chunk import variance_output
from .scan_backward import covariance_scan_backward


class ScanSaved(NamedTuple):
    """What a packed scan forward keeps for :func:`scan_backward` (see the module docstring).

    ``w`` ``[NT, H', D]``, ``linv`` ``[NT, H', C]`` (compute dtype), ``P_starts`` ``[S, H', D, D]``
    (compute dtype: the states the forward's Phase C replayed from), ``elements``: Phase A's
    ``(A, J)`` of ``lay.element_segments`` (float64) or None (recomputed).
    """

    w: torch.Tensor
    linv: torch.Tensor
    P_starts: torch.Tensor
    elements: tuple[torch.Tensor, torch.Tensor] | None = None


def substituted(linv, k, v, log_alpha, cu: list[int], C: int):
    """``(kw = L⁻¹(γ⊙K), vu = L⁻¹V, g)`` packed from the stored ``L⁻¹`` rows, arithmetic in ``linv``'s dtype.

    The same product as ``ops/bayesian_layer/scan_triton.py::substituted_inputs`` (plain PyTorch kept in the Triton
    module; here so that the backward does not import Triton).  One batched product per chunk.
    """
    lay = scan.scan_layout(list(cu), C, 1, k.device)
    NT = k.shape[0]
    Lg = lay.grid(linv, 0.0)
    g = torch.cumsum(lay.grid(log_alpha.to(linv.dtype), 0.0), dim=-2)
    kw = Lg @ (torch.exp(g) * lay.grid(k.to(linv.dtype), 0.0))
    vu = Lg @ lay.grid(v.to(linv.dtype), 0.0)
    return lay.scatter(kw, NT), lay.scatter(vu, NT), lay.scatter(g, NT)


def mean_backward_kernels(dtype: torch.dtype, device) -> dict:
    """The kernels :func:`bayeslayer.ops.bayesian_layer.mean_pass_fla.mean_pass_fla_backward` runs by default.

    float64, or no flash-linear-attention installed: every kernel its plain-PyTorch twin
    (:data:`~bayeslayer.ops.bayesian_layer.mean_pass_fla.TWIN_KERNELS`).  CUDA: fla's own kernels.  CPU under
    ``TRITON_INTERPRET=1``: fla's kernels except those the interpreter cannot run
    (:data:`~bayeslayer.ops.bayesian_layer.mean_pass_fla.NOT_INTERPRETABLE`: their twins), as the forward tests do.
    CPU without the interpreter: the twins.
    """
    if dtype == torch.float64:
        return dict(mean_pass_fla.TWIN_KERNELS)
    try:
        mean_pass_fla.require_fla()
    except RuntimeError:
        return dict(mean_pass_fla.TWIN_KERNELS)
    if torch.device(device).type == "cuda":
        return {}
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return {n: mean_pass_fla.TWIN_KERNELS[n] for n in mean_pass_fla.NOT_INTERPRETABLE}
    return dict(mean_pass_fla.TWIN_KERNELS)


# the covariance scan backwards (B2–B4) :func:`scan_backward` can run: the plain-PyTorch twin, or the Triton kernels
COVARIANCE_BACKWARDS = ("twin", "triton")


class ScanGradInputs(NamedTuple):
    """Gradients of the packed scan inputs (shapes and dtypes of the inputs; ``P0`` symmetrised)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    r2: torch.Tensor
    ell2: torch.Tensor
    log_alpha: torch.Tensor
    M0: torch.Tensor
    P0: torch.Tensor


def scan_backward(q, k, v, r2, ell2, log_alpha, M0, P0, cu: list[int], C: int, *, segment_chunks: int,
                  saved: ScanSaved, do=None, dvariance=None, dM=None, dP=None, mean_kernels: dict | None = None,
                  element_dtype: torch.dtype | None = torch.float64, covariance: str = "twin") -> ScanGradInputs:
    """Gradients of the packed scan forward's inputs from the adjoints of its outputs (B1 → substitution → B2–B4).

    Inputs as :class:`bayeslayer.ops.bayesian_layer.scan.ScanCall`'s packed tensors (q, k ``[NT, H', D]``, v ``[NT, H',
    m]``, r2, ell2 ``[NT, H']``, log_alpha ``[NT, H', Da]``, M0 ``[N, H', D, m]``, P0 ``[N, H', D, D]``), ``cu``,
    ``C``, ``segment_chunks`` as the forward ran, ``saved`` (:class:`ScanSaved`) from it.  Adjoints (None:
    zero): ``do`` ``[NT, H', m]``, ``dvariance`` ``[NT, H']``, ``dM`` ``[N, H', D, m]``, ``dP`` ``[N, H', D, D]``.
    ``mean_kernels``: ``{fla name: callable}`` for the mean pass's backward (None:
    :func:`mean_backward_kernels`).  ``element_dtype``: as :func:`covariance_scan_backward`.
    ``covariance`` (:data:`COVARIANCE_BACKWARDS`): which B2–B4 runs — ``"twin"``, the plain-PyTorch
    :func:`~bayeslayer.ops.bayesian_layer.scan_backward.covariance_scan_backward` (a Python loop over each segment's
    chunk positions; the float64 reference), or ``"triton"``,
    ``ops/bayesian_layer/scan_backward_triton.py::covariance_scan_backward_triton`` (a launch count independent of T;
    Phase A/B3 in float64, so ``element_dtype`` must be float64), whose failure flag is checked once, after it.
    """
    if covariance not in COVARIANCE_BACKWARDS:
        raise ValueError(f"covariance must be one of {COVARIANCE_BACKWARDS}, got {covariance!r}")
    if covariance == "triton" and element_dtype != torch.float64:
        raise ValueError(f"covariance='triton' runs Phase A and B3 in float64; element_dtype must be torch.float64, "
                         f"got {element_dtype}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a packed [NT, H', ·] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(saved, ScanSaved):
        raise TypeError(f"saved must be a ScanSaved, got {type(saved).__name__}")
    NT, Hf, D = k.shape
    if tuple(saved.w.shape) != (NT, Hf, D):
        raise ValueError(f"saved.w must be [{NT}, {Hf}, {D}], got {tuple(saved.w.shape)}")
    if tuple(saved.linv.shape) != (NT, Hf, C):
        raise ValueError(f"saved.linv must be [{NT}, {Hf}, C={C}], got {tuple(saved.linv.shape)}")
    if not isinstance(M0, torch.Tensor) or M0.dim() != 4 or M0.shape[:2] != P0.shape[:2]:
        raise ValueError(f"M0 must be [N, H', D, m] like P0 {tuple(P0.shape)}, got "
                         f"{getattr(M0, 'shape', type(M0).__name__)}")
    if do is None:
        do = torch.zeros_like(v)
    kernels = mean_kernels if mean_kernels is not None else mean_backward_kernels(q.dtype, q.device)
    kw, vu, g = substituted(saved.linv, k, v, log_alpha, cu, C)
    # B1: the mean pass on the substituted tensors, then the substitution's adjoint
    dq_m, dw, dkw, dvu, dla_m, dM0 = mean_pass_fla.mean_pass_fla_backward(q, saved.w, kw, vu, g, M0, list(cu), C,
                                                                           do, dM, kernels=kernels)
    dlinv, dk_s, dv, dla_s = mean_pass_fla.substitution_backward(saved.linv, k, v, log_alpha, list(cu), C, dkw, dvu,
                                                                 dlog_alpha=dla_m)
    # B2–B4: the covariance scan, with the adjoints of its outputs that the mean pass read
    elements = None
    if saved.elements is not None:
        A, J = saved.elements
        elements = (A, None, J)
    cov_args = (q, k, v, r2, ell2, log_alpha, P0, list(cu), C)
    cov_kw = dict(segment_chunks=segment_chunks, P_starts=saved.P_starts, dw=dw.to(k.dtype),
                  dlinv=dlinv.to(k.dtype), dvariance=dvariance, dP=dP, elements=elements)
    if covariance == "triton":
        from .scan_backward_triton import covariance_scan_backward_triton

        cg, failed = covariance_scan_backward_triton(*cov_args, **cov_kw)
        scan.raise_if_failed(failed, "scan_backward")  # the backward's one host sync, after all of B2–B4
    else:
        cg = covariance_scan_backward(*cov_args, **cov_kw, element_dtype=element_dtype)
    return ScanGradInputs(q=dq_m.to(q.dtype) + cg.q, k=dk_s.to(k.dtype) + cg.k, v=dv.to(v.dtype),
                          r2=cg.r2, ell2=cg.ell2, log_alpha=dla_s.to(log_alpha.dtype) + cg.log_alpha,
                          M0=dM0.to(M0.dtype), P0=cg.P0)


def forward_packed_reference(q, k, v, r2, ell2, log_alpha, M0, P0, cu: list[int], C: int, segment_chunks: int,
                             want_var: bool, *, element_dtype: torch.dtype | None = torch.float64):
    """The packed scan forward in plain PyTorch (:func:`~bayeslayer.ops.bayesian_layer.scan.covariance_scan` +
    :func:`~bayeslayer.ops.bayesian_layer.scan.mean_pass_reference`), in :class:`ScanFunction`'s forward contract:
    ``(o [NT, H', m], variance [NT, H'] or None, M [N, H', D, m], P [N, H', D, D], ScanSaved)``."""
    out = scan.covariance_scan(q, k, v, r2, ell2, log_alpha, P0, list(cu), C, segment_chunks=segment_chunks,
                               want_var=want_var, element_dtype=element_dtype)
    scan.raise_if_failed(out.failed, "forward_packed_reference")
    o, M = scan.mean_pass_reference(q, out.w, out.kw, out.vu, out.g, M0, list(cu), C)
    return o, out.variance, M, out.P, ScanSaved(w=out.w, linv=out.linv, P_starts=out.P_starts)


class ScanSpec(NamedTuple):
    """The non-tensor arguments of :class:`ScanFunction`: layout, the forward to run and backward options.

    ``forward``: ``(q, k, v, r2, ell2, log_alpha, M0, P0, cu, C, segment_chunks, want_var) ->
    (o, variance or None, M, P, ScanSaved)`` on packed tensors (:func:`forward_packed_reference`, or the
    Triton forward ``ops/bayesian_layer/chunk_triton.py::forward_scan_packed``).  ``covariance``: the B2–B4 the
    backward runs (:func:`scan_backward`'s argument): ``"twin"`` (plain PyTorch, the default: the reference forward's)
    or ``"triton"`` (the Triton forward sets it).
    """

    cu: list
    C: int
    segment_chunks: int
    want_var: bool
    forward: Callable
    mean_kernels: dict | None = None
    element_dtype: torch.dtype | None = torch.float64
    covariance: str = "twin"


class ScanFunction(torch.autograd.Function):
    """Autograd for the packed scan: forward ``spec.forward``, backward :func:`scan_backward`.

    ``ScanFunction.apply(spec, q, k, v, r2, ell2, log_alpha, M0, P0)`` → ``(o, variance, M, P)``, all packed
    (``variance`` is an empty, non-differentiable tensor without ``spec.want_var``).  Apply it to the
    tensors of :func:`~bayeslayer.ops.bayesian_layer.scan.prepare_scan` and unfold with
    :func:`~bayeslayer.ops.bayesian_layer.scan.finish_scan`: autograd differentiates both.
    """

    @staticmethod
    def forward(ctx, spec: ScanSpec, q, k, v, r2, ell2, log_alpha, M0, P0):
        if not isinstance(spec, ScanSpec):
            raise TypeError(f"spec must be a ScanSpec, got {type(spec).__name__}")
        if spec.covariance not in COVARIANCE_BACKWARDS:
            raise ValueError(f"spec.covariance must be one of {COVARIANCE_BACKWARDS}, got {spec.covariance!r}")
        o, var, M, P, saved = spec.forward(q, k, v, r2, ell2, log_alpha, M0, P0, spec.cu, spec.C,
                                           spec.segment_chunks, spec.want_var)
        if not isinstance(saved, ScanSaved):
            raise TypeError(f"spec.forward must return a ScanSaved last, got {type(saved).__name__}")
        el = saved.elements if saved.elements is not None else ()
        ctx.save_for_backward(q, k, v, r2, ell2, log_alpha, M0, P0, saved.w, saved.linv, saved.P_starts, *el)
        ctx.spec = spec
        return o, variance_output(ctx, o, var), M, P

    @staticmethod
    def backward(ctx, d_o, d_var, d_M, d_P):
        spec = ctx.spec
        q, k, v, r2, ell2, la, M0, P0, w, linv, P_starts, *el = ctx.saved_tensors
        saved = ScanSaved(w=w, linv=linv, P_starts=P_starts, elements=tuple(el) if el else None)
        dvar = d_var if spec.want_var and d_var is not None and d_var.numel() > 0 else None
        g = scan_backward(q, k, v, r2, ell2, la, M0, P0, spec.cu, spec.C, segment_chunks=spec.segment_chunks,
                          saved=saved, do=d_o, dvariance=dvar, dM=d_M, dP=d_P, mean_kernels=spec.mean_kernels,
                          element_dtype=spec.element_dtype, covariance=spec.covariance)
        needs = ctx.needs_input_grad[1:]
        return (None, *(x if need else None for x, need in zip(g, needs, strict=True)))


def bl_scan_autograd(q, k, v, r2, ell2, alpha=None, p0=1.0, initial_state=None, output_final_state=False,
                     return_variance=False, chunk_size=64, cu_seqlens=None, n_segments=None, *, forward=None,
                     mean_kernels=None):
    """:func:`bayeslayer.ops.bl_chunk`'s contract (no rotations) on :class:`ScanFunction`.

    ``forward``: the packed forward (None: :func:`forward_packed_reference`, plain PyTorch); the Triton
    path passes its own (``ops/bayesian_layer/chunk_triton.py``).  Gradients by :func:`scan_backward`.
    """
    M0, P0 = split_state(initial_state)
    call = scan.prepare_scan(q, k, v, r2, ell2, alpha, p0, M0, P0, cu_seqlens, chunk_size, n_segments=n_segments)
    spec = ScanSpec(cu=call.cu, C=call.C, segment_chunks=call.segment_chunks, want_var=return_variance,
                    forward=forward or forward_packed_reference, mean_kernels=mean_kernels)
    o, var, M, P = ScanFunction.apply(spec, call.q, call.k, call.v, call.r2, call.ell2, call.log_alpha, call.M0,
                                      call.P0)
    o, var, M, P = scan.finish_scan(call, o, var if return_variance else None, M, P)
    state = (M, P) if output_final_state else None
    return (o, var, state) if return_variance else (o, state)
