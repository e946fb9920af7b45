"""``bl_chunk_triton``: the chunked Bayesian Layer on Triton kernels (docs/theory.md §5–6).

One default forward and one default backward, chosen per call by :func:`covariance_path`:

* ``"chain"`` (the default for key dims up to 128): the covariance chain on chip
  (:mod:`.chain_triton`: one program per (sequence, head·group) holding ``P`` in registers for the whole
  sequence), then the mean pass on flash-linear-attention's kernels (:mod:`.mean_pass_fla`); backward
  (:class:`ChainFunction`): fla's mean-pass backward, then the reverse chain, each chunk replayed from the
  covariance the forward held at its start.  Nothing is read on the host (no device sync): the layout of
  ``cu_seqlens`` stays on the device, and a factorisation that fails shows as NaN in its (sequence, head)'s
  outputs (:func:`chain_failures` reads the flags, which costs a sync, when asked).
* ``"scan"`` (key dims 129..256, an explicit ``n_segments``, and, by :func:`covariance_path`, few long chains):
  the exact segment scan (:mod:`.scan_triton`, docs/theory.md §6.3) and its backward through the scan
  (:mod:`.scan_grad`, B1–B4); it reads the sequence offsets and its failure flags on the host.

Neither has run on a GPU yet (:data:`RUN_ON_DEVICE`): the first CUDA call of each warns once per process.
Rotations (``theta``) have no kernel: :func:`bl_chunk_triton` refuses them, and
:mod:`bayeslayer.ops.backend` sends them to the PyTorch path (``backend="auto"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import NamedTuple

import torch

from ..utils.validation import (
    check_cu_seqlens,
    check_dynamics,
    check_p0,
    check_positive,
    check_qkv,
    check_state,
    split_state,
)
from . import groups as grp
from .chunk import filter_chunk
from .crossover import scan_predicted_faster
from .triton_support import CHAIN_MAX_HEAD_DIM, MAX_HEAD_DIM, BackendError, triton_unavailable, unsupported

#: the devices each Triton path has run on, its tests included (empty: tested under Triton's interpreter and
#: compiled for sm_90 only).  The first CUDA call of a path with none warns once per process.
RUN_ON_DEVICE: dict[str, tuple[str, ...]] = {"chain": (), "scan": ()}
#: the covariance passes :func:`bl_chunk_triton` chooses between (:func:`covariance_path`)
PATHS = tuple(RUN_ON_DEVICE)
_WARNED: set[str] = set()

#: the chunk size of the chain kernels, whatever ``chunk_size`` a call passes (the result does not depend on it
#: beyond rounding): 32, what the kernels were tuned for (compiled for sm_90: docs/kernels.md, "Compiled for
#: sm_90"); the C×C factorisation of 64-token chunks does not fit the registers
CHAIN_CHUNK_SIZE = 32
#: a sequence this short is one segment of the scan (``scan.ONE_SEGMENT_MAX_T``): the scan could not split it
SCAN_MIN_T = 4096
DEFAULT_SMS = 132


def covariance_path(n_chains: int, T: int, D: int, *, sms: int = DEFAULT_SMS, n_segments: int | None = None) -> str:
    """Which covariance pass the Triton path runs: ``"chain"`` or ``"scan"``.

    ``n_chains``: (sequences)·heads·groups; ``T``: the longest sequence's length; ``D``: the key dim; ``sms``: the
    device's streaming multiprocessors (132 on an H200); ``n_segments``: a caller's explicit segment count.

    * the scan for ``D > CHAIN_MAX_HEAD_DIM`` (the chain holds ``P`` in registers) or an explicit ``n_segments``;
    * the chain wherever the chains alone fill the SMs (``n_chains ≥ sms``), and for sequences the scan would not
      split (``T ≤ SCAN_MIN_T``);
    * below that, whichever the cost model predicts faster for this call
      (:func:`.crossover.scan_predicted_faster`: the documented sums with step cycles from the kernels as
      compiled for sm_90; docs/kernels.md, "Chain or segment scan").
    """
    for name, x in (("n_chains", n_chains), ("T", T), ("D", D), ("sms", sms)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ValueError(f"{name} must be a non-negative int, got {x!r}")
    if D > CHAIN_MAX_HEAD_DIM or n_segments is not None:
        return "scan"
    if n_chains >= sms or T <= SCAN_MIN_T:
        return "chain"
    return "scan" if scan_predicted_faster(max(n_chains, 1), T, max(D, 1), sms=max(sms, 1)) else "chain"


def _warn_never_run(path: str, device: torch.device) -> None:
    """Once per process and path: a CUDA call of a path no GPU has run yet (:data:`RUN_ON_DEVICE`)."""
    if device.type != "cuda" or RUN_ON_DEVICE.get(path) or path in _WARNED:
        return
    _WARNED.add(path)
    warnings.warn(f"bl_chunk_triton: the {path!r} kernels have never run on a GPU; they are tested under Triton's "
                  "interpreter and compiled for sm_90 only (docs/kernels.md). Check the results against "
                  "backend='torch' before relying on them.", RuntimeWarning, stacklevel=3)


def triton_available() -> bool:
    """True when Triton is installed and can run here: a CUDA device, or ``TRITON_INTERPRET=1`` (CPU).

    Why not, when it cannot: :func:`bayeslayer.ops.bayesian_layer.triton_support.triton_unavailable`.
    """
    return triton_unavailable() is None


def _check_chunk_size(chunk_size) -> int:
    reason = unsupported("chunk", chunk_size=chunk_size)
    if reason is not None:
        raise ValueError(f"the Triton path cannot run this chunk_size: {reason}")
    return int(chunk_size)


def _torch_reference(q, k, v, r2, ell2, alpha, theta, p0, M0, P0, cu, chunk_size, want_var):
    """The PyTorch chunk path on the same arguments (per packed sequence when ``cu`` is given).

    Returns ``(o, variance or None, M, P)``.  Used for T = 0 (nothing to launch), and by the
    tests as the varlen reference.
    """
    state = None if M0 is None else (M0, P0)
    out = filter_chunk(q, k, v, write="bayes", r2=r2, ell2=ell2, alpha=alpha, theta=theta, p0=p0,
                       initial_state=state, output_final_state=True, return_variance=want_var,
                       chunk_size=chunk_size, cu_seqlens=cu)
    return out.o, out.variance, out.state[0], out.state[1]


def _fold_forward(q, k, v, r2, ell2, alpha, p0, M0, P0, cu) -> dict:
    """The kernels' arguments: validated like :func:`prepare`, but q, k, v keep their dtype.

    The kernels cast on load, so bf16/fp16 inputs are never copied to fp32 (with G = 1
    they are not copied at all).  Returns the packed ``[NT, H·G, ...]`` tensors, the
    sequence offsets and fresh working copies of the folded state ``M``, ``P``.
    """
    B, T = q.shape[:2]
    dims = check_qkv(q, k, v)
    r2_f, G = grp.fold_noise(check_positive("r2", r2, dims, allow_groups=True))
    ell2_t = check_positive("ell2", ell2, dims)
    dyn = check_dynamics(alpha, None, dims)
    cd, dev = dims.cdtype, dims.device
    Hf, D, mg, NT = dims.H * G, dims.D, dims.m // G, B * T
    if cu is None:
        n_seq = B
        cu_k = torch.arange(0, B * T + 1, T if T > 0 else 1, device=dev, dtype=torch.int64)[: B + 1]
    else:
        n_seq = cu.numel() - 1
        cu_k = cu
    if M0 is not None:
        st = check_state((M0, P0), dataclasses.replace(dims, B=n_seq), G)
        M = grp.fold_state_mean(st[0], G).contiguous().clone()
        P = grp.fold_state_cov(st[1]).contiguous().clone()
    else:
        p0_h = grp.fold_heads(check_p0(p0, dims), G, dim=0)
        M = torch.zeros(n_seq, Hf, D, mg, dtype=cd, device=dev)
        P = (p0_h[None, :, None, None] * torch.eye(D, dtype=cd, device=dev)).expand(n_seq, -1, -1, -1).contiguous()
    diag = dyn.kind == "diagonal"
    la = dyn.log_alpha if dyn.log_alpha is not None else torch.zeros(B, T, dims.H, 1, dtype=cd, device=dev)
    la = grp.fold_heads(la, G)
    return dict(
        dims=dims, G=G, Hf=Hf, D=D, mg=mg, NT=NT, n_seq=n_seq, cu_k=cu_k, M=M, P=P,
        diag=diag, has_alpha=dyn.kind != "identity",
        q=grp.fold_heads(q, G).reshape(NT, Hf, D).contiguous(),
        k=grp.fold_heads(k, G).reshape(NT, Hf, D).contiguous(),
        v=grp.fold_values(v, G).reshape(NT, Hf, mg).contiguous(),
        r2=r2_f.reshape(NT, Hf).contiguous(),
        ell2=grp.fold_heads(ell2_t, G).reshape(NT, Hf).contiguous(),
        la=la.reshape(NT, Hf, -1).contiguous() if diag else la[..., 0].reshape(NT, Hf).contiguous(),
    )


def forward_scan_packed(q, k, v, r2, ell2, log_alpha, M0, P0, cu, C, segment_chunks, want_var):
    """The segment-scan forward on the Triton kernels, on packed, folded tensors, keeping what the composed
    backward needs: the forward of :class:`bayeslayer.ops.bayesian_layer.scan_grad.ScanFunction` (the scan path).

    Exactly the launches of :func:`bayeslayer.ops.bayesian_layer.scan_triton.forward_scan_triton` after its
    ``prepare_scan`` (both call :func:`bayeslayer.ops.bayesian_layer.scan_triton.scan_packed`: prep, Phase A and B
    kernels, Phase C on the covariance kernel over the segments, the mean kernel), with the mean pass's output left in
    the compute dtype (``finish_scan`` casts it, under autograd).  Arguments:
    :class:`bayeslayer.ops.bayesian_layer.scan.ScanCall`'s packed tensors, ``cu`` (list), ``C``, ``segment_chunks``.
    Returns ``(o, variance or None, M, P, ScanSaved)`` packed; the saved tensors are the write keys, the
    ``L⁻¹`` rows, the ``P_s`` checkpoints and Phase A's ``(A_s, J_s)`` (float64) — see
    :mod:`bayeslayer.ops.bayesian_layer.scan_grad`.  Failures raise once, after the pass.
    """
    from . import scan as sc
    from .scan_grad import ScanSaved
    from .scan_triton import scan_packed

    call = sc.ScanCall(B=1, T=k.shape[0], G=1, dims=None, cu=list(cu), C=C, segment_chunks=segment_chunks, q=q, k=k,
                       v=v, r2=r2, ell2=ell2, log_alpha=log_alpha, M0=M0, P0=P0)
    res = scan_packed(call, want_var, out_dtype=k.dtype)
    sc.raise_if_failed(res.failed, "forward_scan_packed")
    saved = ScanSaved(w=res.W, linv=res.linv, P_starts=res.P_starts.to(k.dtype), elements=res.elements)
    return res.o, res.var, res.M, res.P, saved


def _scan_autograd(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, want_var, n_segments):
    """The scan path with a gradient: ``prepare_scan`` (plain autograd) →
    :class:`~bayeslayer.ops.bayesian_layer.scan_grad.ScanFunction` on :func:`forward_scan_packed` → ``finish_scan``
    (plain autograd).  Returns ``(o, var or None, M, P)``."""
    from . import scan as sc
    from .scan_grad import ScanFunction, ScanSpec

    if not 1 <= q.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"the Triton path supports key dims D in 1..{MAX_HEAD_DIM}, got D={q.shape[-1]}")
    call = sc.prepare_scan(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, n_segments=n_segments)
    spec = ScanSpec(cu=call.cu, C=call.C, segment_chunks=call.segment_chunks, want_var=want_var,
                    forward=forward_scan_packed, covariance="triton")
    o, var, M, P = ScanFunction.apply(spec, call.q, call.k, call.v, call.r2, call.ell2, call.log_alpha, call.M0,
                                      call.P0)
    return sc.finish_scan(call, o, var if want_var else None, M, P)


class ChainSpec(NamedTuple):
    """The non-tensor arguments of :class:`ChainFunction`: the layout (:func:`.chain_triton.chain_layout`), whether
    the variance is returned, the dtype the mean pass reads ``W``, ``kw``, ``vu`` in (:func:`mean_operand_dtype`), the
    mean pass's implementation (:func:`mean_pass_impl`) and the chain kernels' arithmetic
    (:data:`.chain_triton.PRECISIONS`; None: :func:`.chain_triton.default_precision` of q's dtype and D)."""

    layout: object
    want_var: bool
    mean_dtype: torch.dtype
    mean: str
    prec: str | None = None


def mean_operand_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the mean pass's operands ``W``, ``kw``, ``vu`` (and q) for inputs of ``dtype``: float64 for
    float64, fp32 otherwise.  Rounding them to a 16-bit input dtype, as flash-linear-attention's GDN rounds its
    ``w``, ``u``, doubles the output error of bf16 inputs and takes the final ``M`` from fp32 to bf16 accuracy
    (``benchmarks/chain_precision.py``, docs/kernels.md "Precision of the chain path")."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def mean_pass_impl(dtype: torch.dtype, device) -> str:
    """Which mean pass runs: ``"fla"`` (flash-linear-attention's kernels: fp32 operands; on the CPU, under Triton's
    interpreter, fla's ``fwd_h``/``bwd_dhu``, which it cannot run, are replaced by their PyTorch twins) or
    ``"twin"`` (the PyTorch twins of those kernels: float64, which fla does not compute in)."""
    return "twin" if dtype == torch.float64 else "fla"


def _host_offsets(layout, n_tokens: int) -> list[int]:
    """The sequence offsets as a host list: the PyTorch twins of the mean pass index on the host (float64, and
    16-bit inputs under the interpreter only)."""
    return [int(x) for x in layout.cu.cpu()]


def _mean_forward(spec: ChainSpec, q, w, kw, vu, g, M0, cu):
    """The mean pass on the chain's outputs -> ``(o [NT, H', m] in the work dtype, M [N, H', D, m])``."""
    from . import mean_pass_fla as mpf
    from .scan import mean_pass_reference

    work = M0.dtype
    if spec.mean == "twin":
        f = (lambda x: x.to(work))
        return mean_pass_reference(f(q), f(w), f(kw), f(vu), g, M0, _host_offsets(spec.layout, q.shape[0]),
                                   spec.layout.C)
    fwd_h = None if q.device.type == "cuda" else mpf.fwd_h_reference
    md = spec.mean_dtype
    with mpf.one_autotune_config() if q.device.type != "cuda" else contextlib.nullcontext():
        o, M = mpf.mean_pass_fla(q.to(md), w, kw, vu, g, M0, cu, spec.layout.C, fwd_h=fwd_h)
    return o.to(work), M


def _mean_backward(spec: ChainSpec, q, w, kw, vu, g, M0, cu, do, dM):
    """Adjoint of :func:`_mean_forward`: ``(dq, dw, dkw, dvu, dlog_alpha, dM0)``."""
    from . import mean_pass_fla as mpf
    from .scan_grad import mean_backward_kernels

    work = M0.dtype
    if spec.mean == "twin":
        f = (lambda x: x.to(work))
        return mpf.mean_pass_fla_backward(f(q), f(w), f(kw), f(vu), g, M0, cu, spec.layout.C, f(do), dM,
                                          kernels=mpf.TWIN_KERNELS)
    md = spec.mean_dtype
    kernels = mean_backward_kernels(md, q.device)
    with mpf.one_autotune_config() if q.device.type != "cuda" else contextlib.nullcontext():
        return mpf.mean_pass_fla_backward(q.to(md), w, kw, vu, g, M0, cu, spec.layout.C, do.to(md), dM,
                                          kernels=kernels)


class ChainFunction(torch.autograd.Function):
    """Autograd of the packed chain path: the covariance chain (:func:`.chain_triton.chain_forward`) and the mean
    pass on its outputs; backward: the mean pass's adjoint, then the reverse chain
    (:func:`.chain_triton.chain_backward`), which also takes the substitution's adjoint (``kw = L⁻¹K̃``,
    ``vu = L⁻¹V``).  ``ChainFunction.apply(spec, cu, q, k, v, r2, ell2, log_alpha, M0, P0)`` on packed, folded
    tensors (q, k, v in their own dtype; ``M0``, ``P0`` in the working dtype) -> ``(o, variance, M, P)``
    packed.  Nothing is read on the host: the failure flags stay on the device (:func:`chain_failures`) and a
    failure shows as NaN in its (sequence, head)'s outputs."""

    #: the device-side failure flags of the last forward or backward (:func:`chain_failures`)
    last_failed: torch.Tensor | None = None

    @staticmethod
    def forward(ctx, spec: ChainSpec, cu, q, k, v, r2, ell2, log_alpha, M0, P0):
        from .chain_triton import chain_forward

        save = any(ctx.needs_input_grad[2:])
        fw = chain_forward(q, k, v, r2, ell2, log_alpha, P0, spec.layout, want_var=spec.want_var, save_p=save,
                           out_dtype=spec.mean_dtype, prec=spec.prec)
        o, M = _mean_forward(spec, q, fw.w, fw.kw, fw.vu, fw.g, M0, cu)
        ctx.save_for_backward(q, k, v, r2, ell2, log_alpha, M0, fw.w, fw.kw, fw.vu, fw.g, fw.checkpoints, fw.factors)
        ctx.spec, ctx.cu = spec, cu
        ChainFunction.last_failed = fw.failed
        var = fw.var if fw.var is not None else o.new_empty(0)
        if fw.var is None:
            ctx.mark_non_differentiable(var)
        return o, var, M, fw.P

    @staticmethod
    def backward(ctx, d_o, d_var, d_M, d_P):
        from .chain_triton import chain_backward

        spec, cu = ctx.spec, ctx.cu
        q, k, v, r2, ell2, la, M0, w, kw, vu, g, ck, fck = ctx.saved_tensors
        work = M0.dtype
        do = d_o if d_o is not None else torch.zeros(v.shape, dtype=work, device=v.device)
        dq_m, dw, dkw, dvu, dla_m, dM0 = _mean_backward(spec, q, w, kw, vu, g, M0, cu, do, d_M)
        dvar = d_var if spec.want_var and d_var is not None and d_var.numel() > 0 else None
        gr, failed = chain_backward(q, k, v, r2, ell2, la, spec.layout, ck, fck, dw=dw, dkw=dkw, dvu=dvu, dvar=dvar,
                                    dP=d_P, prec=spec.prec, work=work, w=w, kw=kw)
        ChainFunction.last_failed = failed
        dq = dq_m.to(work) if gr.q is None else dq_m.to(work) + gr.q
        return (None, None, dq, gr.k, gr.v, gr.r2, gr.ell2, gr.log_alpha + dla_m.to(work), dM0.to(work), gr.P0)


def chain_chunk(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, want_var, *, prec=None):
    """The chunked Bayesian Layer on the chain kernels: validate and fold (``_fold_forward``'s graph, under autograd),
    :class:`ChainFunction`, unfold.  Returns ``(o [B, T, H, m], variance [B, T, H, G] or None, M, P)`` like
    :func:`_forward_triton`.  Reads nothing on the host beyond what validation reads (nothing with value checks off).
    """
    from .chain_triton import chain_layout, default_precision

    B, T = q.shape[:2]
    grads = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v, r2, ell2, alpha, p0, M0, P0))
    grouped = isinstance(r2, torch.Tensor) and r2.dim() == 4 and r2.shape[-1] > 1
    if grouped and grads and q.dtype in (torch.bfloat16, torch.float16):
        # groups repeat q and k: their gradients are summed over the groups in fp32, then rounded once
        q, k, v = q.float(), k.float(), v.float()
    a = _fold_forward(q, k, v, r2, ell2, alpha, p0, M0, P0, cu)
    dims, G = a["dims"], a["G"]
    la = a["la"] if a["diag"] else a["la"][..., None]
    layout = chain_layout(cu, B, T, chunk_size, q.device)
    # the kernels' precision by the caller's dtype (grouped 16-bit inputs reach them as fp32 above)
    spec = ChainSpec(layout=layout, want_var=want_var, mean_dtype=mean_operand_dtype(dims.dtype),
                     mean=mean_pass_impl(dims.dtype, q.device),
                     prec=default_precision(dims.dtype, dims.D) if prec is None else prec)
    o, var, M, P = ChainFunction.apply(spec, cu, a["q"], a["k"], a["v"], a["r2"], a["ell2"], la, a["M"], a["P"])
    o = grp.unfold_values(o.reshape(B, T, a["Hf"], a["mg"]), G).to(dims.dtype)
    var_out = grp.unfold_per_token(var.reshape(B, T, a["Hf"]), G) if want_var else None
    return o, var_out, grp.unfold_state_mean(M, G), grp.unfold_state_cov(P, G)


def _scan_chunk(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, want_var, n_segments):
    """The ``"scan"`` path: the segment-scan forward and, when a gradient can be asked for, its backward through the
    scan (:func:`_scan_autograd`).  Returns ``(o, var or None, M, P)``."""
    grads = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v, r2, ell2, alpha, p0, M0, P0))
    if grads:
        return _scan_autograd(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, want_var, n_segments)
    from .scan_triton import forward_scan_triton

    return forward_scan_triton(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, want_var, n_segments=n_segments)


def chain_failures() -> torch.Tensor | None:
    """The device-side failure flags ``[N, H']`` of the last chain forward or backward in this process (True where
    a chunk's factorisation met a pivot that was not positive; its outputs are NaN from there on), or None before
    the first call.  Reading them (``.any()``) synchronises the device: the chain path itself never does."""
    return ChainFunction.last_failed


def bl_chunk_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    r2,
    ell2,
    alpha: torch.Tensor | None = None,
    theta: torch.Tensor | None = None,
    p0=1.0,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False,
    return_variance: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    n_segments: int | None = None,
    *,
    path: str | None = None,
):
    """The Bayesian Layer, chunked, on Triton: same contract and results as :func:`bayeslayer.ops.bl_chunk`.

    Shapes: q, k ``[B, T, H, D]`` (D = 1..256; padded to a power of two inside),
    v ``[B, T, H, m]``, r2 ``[B, T, H]`` or ``[B, T, H, G]``, ell2 ``[B, T, H]``,
    alpha None / ``[B, T, H]`` (scalar decay) / ``[B, T, H, D]`` (diagonal decay),
    theta must be None: rotations have no kernel (``bayeslayer.ops.bl_chunk`` runs them on the
    PyTorch path); this function raises ``ValueError`` for them rather than fall back.
    ``cu_seqlens`` ``[N + 1]`` (int32/int64, B = 1) packs N sequences along T, like
    flash-linear-attention; ``initial_state`` and the final state are then per
    sequence, ``M [N, H, D, m]``, ``P [N, H, D, D]`` (``[N, H, G, D, D]`` with groups).

    Output ``o_t = M_tᵀ q_t`` in the input dtype; filter arithmetic in fp32 (fp64
    for fp64 inputs).  Returns ``(o, state)`` or, with ``return_variance``,
    ``(o, variance [B, T, H, G], state)``; ``state`` is None unless
    ``output_final_state``.  ``chunk_size`` ∈ {16, 32, 64} (the scan path's; the chain path runs
    :data:`CHAIN_CHUNK_SIZE`).

    Which covariance pass runs is :func:`covariance_path`'s choice (module docstring); ``n_segments`` forces the
    segment scan with that many segments of the longest sequence, ``path`` (``"chain"`` or ``"scan"``, for
    benchmarks and tests) forces one path.  Gradients flow through either path; a given ``P``'s gradient is its
    symmetric part (the only part a function of a covariance defines).
    """
    C = _check_chunk_size(chunk_size)
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor [B, T, H, D], got {type(q).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, D], got shape {tuple(q.shape)}")
    reason = unsupported("chunk", rotation=theta is not None, head_dim=q.shape[-1],
                         dtype=q.dtype if q.is_floating_point() else None)
    if reason is not None:
        raise ValueError(f"bl_chunk_triton cannot run this input: {reason}")
    reason = triton_unavailable(q.device)
    if reason is not None:
        raise BackendError(f"bl_chunk_triton cannot run: {reason}")
    cu = check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[1], q.device)
    if n_segments is not None and (isinstance(n_segments, bool) or not isinstance(n_segments, int)
                                   or n_segments < 1):
        raise ValueError(f"n_segments must be None or a positive int, got {n_segments!r}")
    if path not in (None, *PATHS):
        raise ValueError(f"path must be None or one of {PATHS}, got {path!r}")
    if path == "chain" and (n_segments is not None or q.shape[-1] > CHAIN_MAX_HEAD_DIM):
        raise ValueError(f"path='chain' runs no segments and key dims up to {CHAIN_MAX_HEAD_DIM}; got "
                         f"n_segments={n_segments!r}, D={q.shape[-1]}")
    M0, P0 = split_state(initial_state)
    if q.shape[1] == 0:  # nothing to launch; the PyTorch path validates and returns the empty results
        o, var, M, P = _torch_reference(q, k, v, r2, ell2, alpha, None, p0, M0, P0, cu, C, return_variance)
    else:
        G = r2.shape[-1] if isinstance(r2, torch.Tensor) and r2.dim() == 4 else 1
        n_seq = q.shape[0] if cu is None else cu.numel() - 1
        # the longest sequence bounds what the scan could split; without cu_seqlens it is T (no host read)
        if path is None:
            path = covariance_path(n_seq * q.shape[2] * G, q.shape[1], q.shape[-1], sms=_sms(q.device),
                                   n_segments=n_segments)
        _warn_never_run(path, q.device)
        if path == "chain":
            o, var, M, P = chain_chunk(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, CHAIN_CHUNK_SIZE, return_variance)
        else:
            o, var, M, P = _scan_chunk(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, C, return_variance, n_segments)
    state = (M, P) if output_final_state else None
    if return_variance:
        return o, var, state
    return o, state


def _sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a CUDA device's own count; :data:`DEFAULT_SMS` otherwise)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS
