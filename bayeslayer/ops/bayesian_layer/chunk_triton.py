"""``bl_chunk_triton``: the chunked Bayesian Layer on Triton kernels (docs/theory.md §6).

Forward (:func:`forward_chunk`): the covariance pass as an exact segment scan
(:mod:`.scan_triton`: Phase A and C parallel over segments, Phase B one kernel serial over
them; a single segment, i.e. the chunk-serial covariance kernel alone, up to 4096
tokens), then the mean pass (one program per value block, sequence and head·group).

Backward: **recompute, not fused**.  :class:`_BLChunkTriton` stores only its
inputs; its backward re-runs the Triton forward to checkpoint the state at every
block start, then walks blocks of :data:`BACKWARD_BLOCK` chunks in reverse,
recomputing each block with the PyTorch chunk step under autograd and
differentiating it (:func:`_blockwise_backward`).  Gradients are therefore the
PyTorch path's; memory is the checkpoints, one block's graph and one gradient
buffer per input (in its dtype); time is a Python loop over blocks, and inside
the chunk step over their chunks — host-bound on a GPU (docs/kernels.md).
``backward="scan"`` (or the default set by :func:`triton_backward`) instead differentiates the segment scan itself:
``prepare_scan`` under plain autograd, :class:`bayeslayer.ops.bayesian_layer.scan_grad.ScanFunction` on
:func:`forward_scan_packed` (which keeps W, the ``L⁻¹`` rows, the ``P_s`` checkpoints and Phase A's
elements), ``finish_scan`` under autograd.  Its backward: fla's mean-pass backward kernels, the
substitution's adjoint (PyTorch, batched over chunks) and the covariance scan's B2–B4 on the Triton kernels
of :mod:`.scan_backward_triton` (``ScanSpec.covariance="triton"``, on the stored Phase A elements; no host loop over
chunks or segments, one failure check after it).  ``"blockwise"`` stays the default until the scan backward
has run on a GPU (its kernels are tested under the interpreter and compiled for sm_90, never executed on a
device); inside ``with triton_backward("scan"):`` every caller that does not choose gets the scan
backward.  The backwards are a registry, :data:`TRITON_BACKWARDS`.
Rotations (``theta``) have no kernel: :func:`bl_chunk_triton` refuses them, and
:mod:`bayeslayer.ops.backend` sends them to the PyTorch path (``backend="auto"``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
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
from .chunk import filter_chunk, variance_output
from .triton_support import BackendError, tile_sizes, triton_unavailable, unsupported

# chunks recomputed and differentiated together in the backward: the PyTorch chunk step batches
# everything that does not depend on the carried state over a block, so fewer, larger kernels run,
# at the price of one block's autograd graph in memory (instead of one chunk's)
BACKWARD_BLOCK = 16
# the backward bl_chunk_triton runs when its caller passes ``backward=None``: "blockwise" unless a
# ``with triton_backward(...)`` block around the call says otherwise (a context variable: scoped to the block,
# the thread and the asyncio task, restored on exit; no process-wide switch).  The names are the keys of
# TRITON_BACKWARDS, filled in below the implementations.
_DEFAULT_BACKWARD: contextvars.ContextVar[str] = contextvars.ContextVar("bayeslayer_triton_backward",
                                                                      default="blockwise")


def default_triton_backward() -> str:
    """The backward :func:`bl_chunk_triton` runs here when its caller passes ``backward=None``."""
    return _DEFAULT_BACKWARD.get()


@contextlib.contextmanager
def triton_backward(backward: str) -> Iterator[str]:
    """Within the ``with`` block, :func:`bl_chunk_triton` calls that do not choose (``backward=None``) — so
    ``bl_chunk(backend="triton")``, the design models, the layers and ``BayesLayerForCausalLM`` on the Triton
    path — train with ``backward``: ``"blockwise"`` (the default outside any block) or ``"scan"`` (the fused
    backward through the segment scan); any name of :data:`TRITON_BACKWARDS`.  The choice is made when the
    forward runs, so a ``.backward()`` after the block still runs the backward chosen inside it.  Yields the
    name; the previous default is restored on exit, also on an error."""
    if not isinstance(backward, str) or backward not in TRITON_BACKWARDS:
        raise ValueError(f"backward must be one of {tuple(TRITON_BACKWARDS)}, got {backward!r}")
    token = _DEFAULT_BACKWARD.set(backward)
    try:
        yield backward
    finally:
        _DEFAULT_BACKWARD.reset(token)


# tl.dot input precision of the fp32 filter arithmetic (fp64 always runs "ieee").  Only
# `benchmarks/gpu.py --variants` changes it.  Measured on an H200 (Triton 3.6, T = 8192, D = 128,
# docs/kernels.md): "tf32x3" was slower than "ieee" at every chunk size, "tf32" 20-26% faster but
# with 2e-3 relative output error (a Kalman gain needs fp32), and both crashed with an illegal
# memory access at chunk size 64; so fp32 products stay IEEE.
FP32_PRECISION = "ieee"


def triton_available() -> bool:
    """True when Triton is installed and can run here: a CUDA device, or ``TRITON_INTERPRET=1`` (CPU).

    Why not, when it cannot: :func:`bayeslayer.ops.bayesian_layer.triton_support.triton_unavailable`.
    """
    return triton_unavailable() is None


def default_num_warps(chunk_size: int) -> int:
    """Warps per program: a 64×64 fp32 tile needs 8 warps to stay (mostly) in registers."""
    return 8 if chunk_size >= 64 else 4


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


def _checkpoint_offsets(cu_k: torch.Tensor, C: int, every: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: number of chunks and the first checkpoint row.

    A sequence keeps the state at the start of chunks 0, every, 2·every, ... and at its end:
    ``cdiv(chunks, every) + 1`` rows.
    """
    n_chunks = (cu_k[1:] - cu_k[:-1] + C - 1) // C
    offsets = torch.zeros_like(cu_k)
    offsets[1:] = torch.cumsum((n_chunks + every - 1) // every + 1, 0)
    return n_chunks, offsets


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


def _forward_triton(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, want_var, save_checkpoints=False):
    """Validate, fold, launch the covariance then the mean kernel, unfold.

    Returns ``(o, var, M, P)``, and with ``save_checkpoints`` also ``(CKP, CKM, n_chunks,
    offsets)``: the folded states at the start of every :data:`BACKWARD_BLOCK`-th chunk (the
    blocks the backward recomputes) and at the end of every sequence.
    """
    import triton

    from .kernels_triton import bl_chunk_cov_kernel, bl_chunk_mean_kernel
    from .scan_triton import ldl_scratch

    B, T = q.shape[:2]
    a = _fold_forward(q, k, v, r2, ell2, alpha, p0, M0, P0, cu)
    dims, G, Hf, D, mg, NT = a["dims"], a["G"], a["Hf"], a["D"], a["mg"], a["NT"]
    n_seq, cu_k, M, P, diag, has_alpha = a["n_seq"], a["cu_k"], a["M"], a["P"], a["diag"], a["has_alpha"]
    qf, kf, vf, r2f, l2f, laf = a["q"], a["k"], a["v"], a["r2"], a["ell2"], a["la"]
    cd = dims.cdtype
    C = chunk_size
    BD, BK, BV = tile_sizes(D, mg)
    o = torch.empty(NT, Hf, mg, dtype=dims.dtype, device=dims.device)
    var = torch.empty(NT, Hf, dtype=cd, device=dims.device) if want_var else o.new_empty(1, dtype=cd)
    w = torch.empty(NT, Hf, D, dtype=cd, device=dims.device)  # write keys β_t u_t
    linv = torch.empty(NT, Hf, C, dtype=cd, device=dims.device)  # rows of each chunk's L⁻¹ = (I + T)⁻¹
    Yscr = torch.empty(n_seq, Hf, C, BD, dtype=cd, device=dims.device)
    Uscr = torch.empty_like(Yscr)
    ck = None
    if save_checkpoints:
        n_chunks, offsets = _checkpoint_offsets(cu_k, C, BACKWARD_BLOCK)
        rows = int(offsets[-1])
        CKP = torch.empty(rows, Hf, D, D, dtype=cd, device=dims.device)
        CKM = torch.empty(rows, Hf, D, mg, dtype=cd, device=dims.device)
        ck = (CKP, CKM, n_chunks, offsets)
        ck_args = (CKP, CKM, offsets)
    else:
        ck_args = (Yscr, Yscr, cu_k)  # unused pointers
    if NT > 0:
        prec = "ieee" if cd == torch.float64 else FP32_PRECISION
        shape = dict(H=Hf, D=D, C=C, BD=BD, BK=BK, DIAG=diag, HAS_ALPHA=has_alpha, SAVE_CK=save_checkpoints,
                     PREC=prec, CK_EVERY=BACKWARD_BLOCK if save_checkpoints else 1, num_warps=default_num_warps(C))
        bl_chunk_cov_kernel[(n_seq, Hf)](
            qf, kf, r2f, l2f, laf, cu_k, P, w, linv, Yscr, Uscr, var, ck_args[0], ck_args[2],
            *ldl_scratch(n_seq, Hf, C, cd, dims.device), RETURN_VAR=want_var, **shape,
        )
        bl_chunk_mean_kernel[(triton.cdiv(mg, BV), n_seq, Hf)](
            qf, kf, vf, w, linv, laf, cu_k, M, o, ck_args[1], ck_args[2], MV=mg, BV=BV, **shape,
        )
    o = grp.unfold_values(o.reshape(B, T, Hf, mg), G)
    var_out = grp.unfold_per_token(var.reshape(B, T, Hf), G) if want_var else None
    out = (o, var_out, grp.unfold_state_mean(M, G), grp.unfold_state_cov(P, G))
    return out + ck if save_checkpoints else out


class _ChunkIndex:
    """Gather blocks of chunks out of packed ``[NT, H', ...]`` tensors, and scatter their gradients back.

    A block is chunks ``c0 .. c1-1`` of every sequence, laid out ``[c1-c0, N, H', C, ...]`` as the
    PyTorch chunk step takes them; every sequence starts a chunk, and positions past a sequence's
    end hold the ``fill`` value that makes a token an exact no-op.  Only one block is ever
    materialised, never the padded sequence.
    """

    def __init__(self, cu_k: torch.Tensor, n_chunks: torch.Tensor, C: int, NT: int):
        N = cu_k.numel() - 1
        self.n_chunks = int(n_chunks.max())
        t = torch.arange(self.n_chunks * C, device=cu_k.device)
        inside = t[None, :] < (cu_k[1:] - cu_k[:-1])[:, None]
        idx = (cu_k[:-1, None] + t[None, :]).clamp(max=max(NT - 1, 0))
        self.idx = idx.view(N, self.n_chunks, C)
        self.inside = inside.view(N, self.n_chunks, C)

    def gather(self, x: torch.Tensor, c0: int, c1: int, fill: float, dtype: torch.dtype) -> torch.Tensor:
        ins = self.inside[:, c0:c1]
        g = x[self.idx[:, c0:c1]].to(dtype)  # [N, nb, C, H', ...]
        g = g.masked_fill(~ins.view(*ins.shape, *([1] * (x.dim() - 1))), fill)
        return g.movedim(2, 3).movedim(1, 0)

    def scatter(self, buf: torch.Tensor, g: torch.Tensor, c0: int, c1: int) -> None:
        """``buf[token] = g`` for the real tokens of the block (each token is written exactly once)."""
        g = g.movedim(0, 1).movedim(3, 2)  # [N, nb, C, H', ...]
        ins = self.inside[:, c0:c1]
        buf[self.idx[:, c0:c1][ins]] = g[ins].to(buf.dtype)


def _blockwise_backward(args, needs, cu, C, want_var, d_o, d_var, d_M, d_P):
    """Gradients of ``(o, var, M_T, P_T)`` w.r.t. ``args``, one block of chunks at a time in reverse.

    1. the Triton forward re-runs with checkpoints: the state ``(M, P)`` at every block start;
    2. for blocks of :data:`BACKWARD_BLOCK` chunks, last block first (all sequences at once, each
       gathered from the packed inputs and padded to whole chunks with no-op tokens), the PyTorch
       chunk step (:func:`bayeslayer.ops.bayesian_layer.chunk.covariance_pass`,
       :func:`~bayeslayer.ops.bayesian_layer.chunk.mean_pass`) is recomputed in the filter dtype from the checkpoint at
       the block start under autograd and differentiated, carrying ``(dM, dP)`` back to the block start; the block's
       input gradients are written into per-token gradient buffers;
    3. those buffers and ``(dM_0, dP_0)`` go back through the validation/folding graph
       (:func:`_fold_forward`, the kernels' own) to the caller's tensors.
    Memory: the checkpoints, one block's graph, and one gradient buffer per input that needs one,
    in the input's dtype (with G > 1, q, k, v are folded in the filter dtype, so that the gradient
    sum over groups runs in it).  No full-size fp32 copy of q, k, v, dO is made for 16-bit inputs.
    """
    from .chunk import ChunkDynamics, covariance_pass, mean_pass

    q, k, v, r2, ell2, alpha, p0, M0, P0 = args
    with torch.no_grad():
        CKP, CKM, n_chunks, offsets = _forward_triton(
            *[a.detach() if isinstance(a, torch.Tensor) else a for a in args], cu, C, False, save_checkpoints=True
        )[4:]
    leaves = []
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    grouped = isinstance(r2, torch.Tensor) and r2.dim() == 4 and r2.shape[-1] > 1
    with torch.enable_grad():
        args = list(args)
        for i, x in enumerate(args):
            if isinstance(x, torch.Tensor) and needs[i]:
                args[i] = x.detach().requires_grad_(True)
                leaves.append(i)
        qkv = args[:3]
        if grouped and q.dtype != cd:  # groups repeat q, k: sum their gradients in the filter dtype
            qkv = [x.to(cd) for x in qkv]
        a = _fold_forward(*qkv, *args[3:], cu)
        la = a["la"] if a["diag"] else a["la"][..., None]
    G, Hf, D, mg, NT, N = a["G"], a["Hf"], a["D"], a["mg"], a["NT"], a["n_seq"]
    flat = {"q": (a["q"], 0.0), "k": (a["k"], 0.0), "v": (a["v"], 0.0), "r2": (a["r2"], 1.0),
            "ell2": (a["ell2"], 0.0), "la": (la, 0.0)}
    index = _ChunkIndex(a["cu_k"], n_chunks, C, NT)
    bufs = {name: torch.zeros_like(x) for name, (x, _) in flat.items() if x.requires_grad}

    def fold_grad(g, shape, fold):
        return fold(g.to(cd)) if g is not None else torch.zeros(shape, dtype=cd, device=q.device)

    do = grp.fold_values(d_o, G).reshape(NT, Hf, mg) if d_o is not None else None
    dvar = None
    if want_var and d_var is not None and d_var.numel() > 0:
        dvar = d_var.reshape(NT, Hf)
    dM = fold_grad(d_M, (N, Hf, D, mg), lambda g: grp.fold_state_mean(g, G))
    dP = fold_grad(d_P, (N, Hf, D, D), lambda g: grp.fold_state_cov(g if g.dim() == 5 else g.unsqueeze(2)))
    # checkpoint rows of block b (chunks b·E .. b·E+E-1, E = BACKWARD_BLOCK) per sequence; at or past a
    # sequence's end its final state (its remaining chunks are exact no-ops)
    E = BACKWARD_BLOCK
    NC = index.n_chunks
    n_blocks = (NC + E - 1) // E
    rows_of = offsets[:-1, None] + torch.minimum(
        torch.arange(n_blocks, device=offsets.device)[None, :], ((n_chunks + E - 1) // E)[:, None]
    )
    for blk in range(n_blocks - 1, -1, -1):
        c0, c1 = blk * E, min(blk * E + E, NC)
        xs = {name: index.gather(x.detach(), c0, c1, fill, cd) for name, (x, fill) in flat.items()}
        wanted = [name for name in xs if name in bufs]
        with torch.enable_grad():
            P_c = CKP[rows_of[:, blk]].requires_grad_(True)
            M_c = CKM[rows_of[:, blk]].requires_grad_(True)
            for name in wanted:
                xs[name].requires_grad_(True)
            dyn = ChunkDynamics(xs["la"], None)
            w, var, P_end = covariance_pass(
                dyn, xs["q"] if dvar is not None else None, xs["k"], xs["r2"], xs["ell2"], P_c
            )
            o, M_end = mean_pass(dyn, xs["q"], xs["k"], xs["v"], w, M_c, erase=True)
            outs, gouts = [P_end, M_end], [dP, dM]
            if do is not None:
                outs.append(o)
                gouts.append(index.gather(do, c0, c1, 0.0, cd))
            if dvar is not None:
                outs.append(var)
                gouts.append(index.gather(dvar, c0, c1, 0.0, cd))
            gs = torch.autograd.grad(outs, [P_c, M_c, *(xs[n] for n in wanted)], gouts, allow_unused=True)
        dP, dM = gs[0], gs[1]
        for name, g in zip(wanted, gs[2:], strict=True):
            if g is not None:
                index.scatter(bufs[name], g, c0, c1)
    result = [None] * len(args)
    if leaves:
        with torch.enable_grad():
            outs, gouts = [], []
            for name, buf in bufs.items():
                outs.append(flat[name][0])
                gouts.append(buf)
            for x, g in ((a["M"], dM), (a["P"], dP)):
                if x.requires_grad:
                    outs.append(x)
                    gouts.append(g.to(x.dtype))
            gs = torch.autograd.grad(outs, [args[i] for i in leaves], gouts, allow_unused=True)
        for i, g in zip(leaves, gs, strict=True):
            result[i] = g
    return result


def forward_chunk(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, want_var, n_segments=None):
    """The forward :func:`bl_chunk_triton` runs: the covariance pass as the segment scan
    (:func:`bayeslayer.ops.bayesian_layer.scan_triton.forward_scan_triton`: Phase A, B, C on Triton kernels; one
    segment per sequence up to 4096 tokens, so that short sequences run Phase C alone, which is the
    chunk-serial pass), the mean pass on :func:`~bayeslayer.ops.bayesian_layer.kernels_triton.bl_chunk_mean_kernel`.
    ``n_segments`` overrides the segment count (segments of the longest sequence; never across a
    ``cu_seqlens`` boundary).  Returns ``(o, var or None, M, P)`` as :func:`_forward_triton`."""
    from .scan_triton import forward_scan_triton

    return forward_scan_triton(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, want_var,
                               n_segments=n_segments)


def forward_scan_packed(q, k, v, r2, ell2, log_alpha, M0, P0, cu, C, segment_chunks, want_var):
    """The segment-scan forward on the Triton kernels, on packed, folded tensors, keeping what the composed
    backward needs: the forward of :class:`bayeslayer.ops.bayesian_layer.scan_grad.ScanFunction` (``backward="scan"``).

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
    """``backward="scan"``: ``prepare_scan`` (plain autograd) →
    :class:`~bayeslayer.ops.bayesian_layer.scan_grad.ScanFunction` on :func:`forward_scan_packed` → ``finish_scan``
    (plain autograd).  Returns ``(o, var or None, M, P)``."""
    from . import scan as sc
    from .scan_grad import ScanFunction, ScanSpec

    if not 1 <= q.shape[-1] <= 256:
        raise ValueError(f"the Triton path supports key dims D in 1..256, got D={q.shape[-1]}")
    call = sc.prepare_scan(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, n_segments=n_segments)
    spec = ScanSpec(cu=call.cu, C=call.C, segment_chunks=call.segment_chunks, want_var=want_var,
                    forward=forward_scan_packed, covariance="triton")
    o, var, M, P = ScanFunction.apply(spec, call.q, call.k, call.v, call.r2, call.ell2, call.log_alpha, call.M0,
                                      call.P0)
    return sc.finish_scan(call, o, var if want_var else None, M, P)


class _BLChunkTriton(torch.autograd.Function):
    """Triton forward; backward block by block from Triton-recomputed state checkpoints (see
    :func:`_blockwise_backward`)."""

    @staticmethod
    def forward(ctx, q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, want_var, n_segments):
        o, var, M, P = forward_chunk(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, want_var, n_segments)
        inputs = (q, k, v, r2, ell2, alpha, p0, M0, P0)
        ctx.save_for_backward(*[x if isinstance(x, torch.Tensor) else None for x in inputs])
        ctx.plain = [None if isinstance(x, torch.Tensor) else x for x in inputs]
        ctx.cu, ctx.chunk_size, ctx.want_var = cu, chunk_size, want_var
        return o, variance_output(ctx, o, var), M, P

    @staticmethod
    def backward(ctx, d_o, d_var, d_M, d_P):
        args = [s if s is not None else p for s, p in zip(ctx.saved_tensors, ctx.plain, strict=True)]
        grads = _blockwise_backward(args, ctx.needs_input_grad[:9], ctx.cu, ctx.chunk_size, ctx.want_var,
                                    d_o, d_var, d_M, d_P)
        return (*grads, None, None, None, None)


class ChainSpec(NamedTuple):
    """The non-tensor arguments of :class:`ChainFunction`: the layout (:func:`.chain_triton.chain_layout`), whether
    the variance is returned, the dtype the mean pass reads ``W``, ``kw``, ``vu`` in (:func:`mean_operand_dtype`), the
    mean pass's implementation (:func:`mean_pass_impl`) and the product precision of the chain kernels (None: their
    default)."""

    layout: object
    want_var: bool
    mean_dtype: torch.dtype
    mean: str
    prec: str | None = None


def mean_operand_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the mean pass's operands ``W``, ``kw``, ``vu`` for inputs of ``dtype``: the inputs' own for
    16-bit inputs (as flash-linear-attention's GDN runs its ``w``, ``u``), fp32 for fp32, float64 for float64."""
    return dtype if dtype in (torch.bfloat16, torch.float16, torch.float64) else torch.float32


def mean_pass_impl(dtype: torch.dtype, device) -> str:
    """Which mean pass runs: ``"fla"`` (flash-linear-attention's kernels: CUDA tensors, and fp32 under Triton's
    interpreter, where fla's ``fwd_h``/``bwd_dhu``, which it cannot run, are replaced by their PyTorch twins) or
    ``"twin"`` (the PyTorch twins of those kernels: float64, which fla does not compute in, and 16-bit inputs under
    the interpreter, whose 16-bit ``tl.dot`` is not usable)."""
    if dtype == torch.float64:
        return "twin"
    if torch.device(device).type == "cuda":
        return "fla"
    return "fla" if dtype == torch.float32 else "twin"


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
    packed.  Nothing is read on the host: the failure flags stay on the device (``ctx``/the returned
    ``failed`` attribute) and a failure shows as NaN in its (sequence, head)'s outputs."""

    @staticmethod
    def forward(ctx, spec: ChainSpec, cu, q, k, v, r2, ell2, log_alpha, M0, P0):
        from .chain_triton import chain_forward

        save = any(ctx.needs_input_grad[2:])
        fw = chain_forward(q, k, v, r2, ell2, log_alpha, P0, spec.layout, want_var=spec.want_var, save_p=save,
                           out_dtype=spec.mean_dtype, prec=spec.prec)
        o, M = _mean_forward(spec, q, fw.w, fw.kw, fw.vu, fw.g, M0, cu)
        ctx.save_for_backward(q, k, v, r2, ell2, log_alpha, M0, fw.w, fw.kw, fw.vu, fw.g, fw.checkpoints)
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
        q, k, v, r2, ell2, la, M0, w, kw, vu, g, ck = ctx.saved_tensors
        work = M0.dtype
        do = d_o if d_o is not None else torch.zeros(v.shape, dtype=work, device=v.device)
        dq_m, dw, dkw, dvu, dla_m, dM0 = _mean_backward(spec, q, w, kw, vu, g, M0, cu, do, d_M)
        dvar = d_var if spec.want_var and d_var is not None and d_var.numel() > 0 else None
        gr = chain_backward(q, k, v, r2, ell2, la, spec.layout, ck, dw=dw, dkw=dkw, dvu=dvu, dvar=dvar, dP=d_P,
                            prec=spec.prec)
        ChainFunction.last_failed = gr.failed
        dq = dq_m.to(work) if gr.q is None else dq_m.to(work) + gr.q
        return (None, None, dq, gr.k, gr.v, gr.r2, gr.ell2, gr.log_alpha + dla_m.to(work), dM0.to(work), gr.P0)


def chain_chunk(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, want_var, *, prec=None):
    """The chunked Bayesian Layer on the chain kernels: validate and fold (``_fold_forward``'s graph, under autograd),
    :class:`ChainFunction`, unfold.  Returns ``(o [B, T, H, m], variance [B, T, H, G] or None, M, P)`` like
    :func:`_forward_triton`.  Reads nothing on the host beyond what validation reads (nothing with value checks off).
    """
    from .chain_triton import chain_layout

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
    spec = ChainSpec(layout=layout, want_var=want_var, mean_dtype=mean_operand_dtype(dims.dtype),
                     mean=mean_pass_impl(dims.dtype, q.device), prec=prec)
    o, var, M, P = ChainFunction.apply(spec, cu, a["q"], a["k"], a["v"], a["r2"], a["ell2"], la, a["M"], a["P"])
    o = grp.unfold_values(o.reshape(B, T, a["Hf"], a["mg"]), G).to(dims.dtype)
    var_out = grp.unfold_per_token(var.reshape(B, T, a["Hf"]), G) if want_var else None
    return o, var_out, grp.unfold_state_mean(M, G), grp.unfold_state_cov(P, G)


#: the backwards of :func:`bl_chunk_triton`, by name: each runs the Triton forward under its own autograd,
#: ``(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, want_var, n_segments) -> (o, var or None, M, P)``.
#: ``"blockwise"``: :class:`_BLChunkTriton` (PyTorch chunk-step recompute per block: the PyTorch path's gradients);
#: ``"scan"``: :func:`_scan_autograd` (the composed backward of the segment scan, :mod:`.scan_grad`: fla's mean-pass
#: backward, the substitution's adjoint, the covariance scan's B2–B4 on the Triton kernels of
#: :mod:`.scan_backward_triton` — not the default until it has run on a GPU; docs/kernels.md "Backward v2").
#: Without a gradient to take every name runs the plain forward (``_BLChunkTriton``).
TRITON_BACKWARDS: dict[str, Callable] = {"blockwise": _BLChunkTriton.apply, "scan": _scan_autograd}


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
    backward: str | None = None,
):
    """The Bayesian Layer, chunked, on Triton: same contract and results as :func:`bayeslayer.ops.bl_chunk`.

    Shapes: q, k ``[B, T, H, D]`` (D = 16..256; padded to a power of two inside),
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
    ``output_final_state``.  ``chunk_size`` ∈ {16, 32, 64}.

    Forward: the covariance pass as an exact segment scan (:func:`forward_chunk`); ``n_segments``
    (None: chosen from the number of (sequence, head) chains and T, one segment up to 4096 tokens)
    sets how many segments the longest sequence is split into.

    Gradients (``backward``: a name of :data:`TRITON_BACKWARDS`; None: :func:`default_triton_backward`, set by
    :func:`triton_backward`): ``"blockwise"`` recomputes each block of
    :data:`BACKWARD_BLOCK` chunks with the PyTorch chunk step from state checkpoints
    written by the Triton forward (module docstring); ``"scan"`` runs the composed backward of the
    segment scan (:mod:`bayeslayer.ops.bayesian_layer.scan_grad`) behind :func:`forward_scan_packed`: fla's mean-pass
    backward, the substitution's adjoint and the Triton covariance backward B2–B4 (module docstring).
    The two agree to rounding, except that ``"scan"`` returns the symmetric part of a given ``P``'s
    gradient.
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
    backward = default_triton_backward() if backward is None else backward
    if not isinstance(backward, str) or backward not in TRITON_BACKWARDS:
        raise ValueError(f"backward must be None or one of {tuple(TRITON_BACKWARDS)}, got {backward!r}")
    M0, P0 = split_state(initial_state)
    if q.shape[1] == 0:  # nothing to launch; the PyTorch path validates and returns the empty results
        o, var, M, P = _torch_reference(q, k, v, r2, ell2, alpha, None, p0, M0, P0, cu, C, return_variance)
    else:
        # the chosen backward only when a gradient can be asked for: inference runs the plain forward either way
        wants_grad = torch.is_grad_enabled() and any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v, r2, ell2, alpha, p0, M0, P0))
        run = TRITON_BACKWARDS[backward] if wants_grad else _BLChunkTriton.apply
        o, var, M, P = run(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, C, return_variance, n_segments)
    state = (M, P) if output_final_state else None
    if return_variance:
        return o, var, state
    return o, state
