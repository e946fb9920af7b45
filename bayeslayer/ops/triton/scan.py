"""The segment-scan forward on a GPU (design note ``gpu-kernels.md`` §2, first step).

:func:`forward_scan_triton` runs the covariance pass as the exact segment scan of
:mod:`bayeslayer.ops.scan` and the mean pass on flash-linear-attention's kernels:

=========  =====================================================================  =====================
phase      what runs                                                              grid / order
=========  =====================================================================  =====================
A          :func:`bayeslayer.ops.scan.phase_a` (PyTorch, float64, batched over    ``n_s`` chunk steps,
           every non-last segment and head)                                       each over all segments
B          :func:`bayeslayer.ops.scan.phase_b` (PyTorch, float64, Cholesky form)  ``S_g − 1`` steps
C          :func:`bayeslayer.ops.triton.kernels.bl_chunk_cov_kernel` launched     (segments, H'):
           with the *segments* as its sequences, each from its ``P_s``            parallel over segments
C'         ``L⁻¹(γ⊙K)``, ``L⁻¹V`` from the stored ``L⁻¹`` rows (batched matmul)   parallel over chunks
mean       :func:`bayeslayer.ops.fla_mean.mean_pass_fla` (fla's ``fwd_h`` +       as GDN
           ``fwd_o``), or the PyTorch twin for float64 / without fla
=========  =====================================================================  =====================

Phase C reuses the existing covariance kernel unchanged: a segment is a run of whole chunks
of one sequence, so launching that kernel over the segment boundaries (``cu_seg``) from
the scanned segment-start covariances replays exactly the chunks of the chunk-serial pass,
``S_g`` times shorter per program.  What is still owed (``docs/kernels.md``, "Segment scan
(v2)"): Phase A and B as Triton kernels (here they are batched PyTorch, a host loop of
``n_s`` resp. ``S_g`` steps, no host sync), and the blocked 16×16 ``tl.dot`` LDLᵀ in place
of the kernel's C-step elimination.  Forward only (no autograd).
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from .. import scan as sc
from .chunk import ldl_scratch
from .kernels import bl_chunk_cov_kernel

SUPPORTED_CHUNK_SIZES = (16, 32, 64)
# fp32 tl.dot products of Phase C stay IEEE (a Kalman gain needs fp32; see ops/triton/chunk.py)
PREC = "ieee"


@triton.jit
def scan_track_kernel(
    W, KW, BETA, la, cu_seg, segs, A, J, Hscr,
    H: tl.constexpr,
    D: tl.constexpr,
    C: tl.constexpr,
    BD: tl.constexpr,
    BK: tl.constexpr,
    DIAG: tl.constexpr,
    PREC: tl.constexpr,
):
    """Phase A's tracking for one (segment ``segs[i]``, head): the segment transition and information.

    From the P = 0 run of the segment (W = βU, KW = L⁻¹(γ⊙K), β per token, all ``[NT, H, ·]``),
    per chunk, serial over the segment's chunks, with ``W̃_i = Φ_CΦ_i⁻¹ w_i``::

        Hm = KW A ;   A ← Φ_C A − W̃ᵀ Hm ;   J += Hmᵀ diag(β) Hm

    A ``[n, H, D, D]`` holds I on entry, J zeros; Hscr ``[n, H, C, BD]`` is per-program scratch.
    This is fla's ``fwd_h`` recurrence with a D×D state (u = 0, h0 = I) plus the J accumulation,
    in the dtype of A (float64 for Phase A).
    """
    i_s = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    seg = tl.load(segs + i_s).to(tl.int64)
    bos = tl.load(cu_seg + seg).to(tl.int64)
    eos = tl.load(cu_seg + seg + 1).to(tl.int64)
    n_chunks = tl.cdiv(eos - bos, C)
    rows = tl.arange(0, C)
    offs = tl.arange(0, BK)
    dt = A.dtype.element_ty
    A_base = A + (i_s * H + i_h) * D * D
    J_base = J + (i_s * H + i_h) * D * D
    H_base = Hscr + (i_s * H + i_h) * C * BD
    for i_c in range(n_chunks):
        tok = bos + i_c * C + rows
        valid = tok < eos
        beta = tl.load(BETA + tok * H + i_h, mask=valid, other=0.0).to(dt)
        if not DIAG:
            lac = tl.load(la + tok * H + i_h, mask=valid, other=0.0).to(dt)
            g = tl.cumsum(lac, axis=0)
            g_end = tl.sum(lac, axis=0)
        # Hm = KW A, column block by column block (A is read before any of it is updated)
        for ob in range(0, BD, BK):
            o2 = ob + offs
            hm = tl.zeros([C, BK], dtype=dt)
            for ib in range(0, BD, BK):
                o1 = ib + offs
                kw = tl.load(KW + (tok[:, None] * H + i_h) * D + o1[None, :],
                             mask=valid[:, None] & (o1[None, :] < D), other=0.0).to(dt)
                a = tl.load(A_base + o1[:, None] * D + o2[None, :], mask=(o1[:, None] < D) & (o2[None, :] < D),
                            other=0.0)
                hm += tl.dot(kw, a, input_precision=PREC)
            tl.store(H_base + rows[:, None] * BD + o2[None, :], hm)
        tl.debug_barrier()
        for ib in range(0, BD, BK):
            o1 = ib + offs
            w1 = tl.load(W + (tok[:, None] * H + i_h) * D + o1[None, :], mask=valid[:, None] & (o1[None, :] < D),
                         other=0.0).to(dt)
            if DIAG:
                g1 = tl.cumsum(tl.load(la + (tok[:, None] * H + i_h) * D + o1[None, :],
                                       mask=valid[:, None] & (o1[None, :] < D), other=0.0).to(dt), axis=0)
                g1_end = tl.sum(tl.where(rows[:, None] == C - 1, g1, 0.0), axis=0)
                w1 = tl.exp(g1_end[None, :] - g1) * w1
                dec = tl.exp(g1_end)[:, None]
            else:
                w1 = tl.exp(g_end - g)[:, None] * w1
                dec = tl.exp(g_end)
            h1 = tl.load(H_base + rows[:, None] * BD + o1[None, :])
            h1b = beta[:, None] * h1
            for ob in range(0, BD, BK):
                o2 = ob + offs
                m = (o1[:, None] < D) & (o2[None, :] < D)
                h2 = tl.load(H_base + rows[:, None] * BD + o2[None, :])
                pa = A_base + o1[:, None] * D + o2[None, :]
                pj = J_base + o1[:, None] * D + o2[None, :]
                a = tl.load(pa, mask=m, other=0.0)
                tl.store(pa, dec * a - tl.dot(tl.trans(w1), h2, input_precision=PREC), mask=m)
                jj = tl.load(pj, mask=m, other=0.0)
                tl.store(pj, jj + tl.dot(tl.trans(h1b), h2, input_precision=PREC), mask=m)
        tl.debug_barrier()


def _next_pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


class _Clock:
    """Per-phase device times (CUDA events on a GPU, wall clock elsewhere) into ``out`` when given."""

    def __init__(self, out: dict | None, device: torch.device):
        self.out, self.cuda = out, device.type == "cuda"
        self.marks: list[tuple[str, object]] = []
        self.mark("start")

    def mark(self, name: str) -> None:
        if self.out is None:
            return
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((name, ev))
        else:
            self.marks.append((name, time.perf_counter()))

    def finish(self) -> None:
        if self.out is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        for (_, a), (name, b) in zip(self.marks[:-1], self.marks[1:], strict=True):
            self.out[name] = a.elapsed_time(b) / 1e3 if self.cuda else b - a


def segment_offsets(lay: sc.ScanLayout, NT: int) -> torch.Tensor:
    """Token boundaries of the segments ``[S + 1]`` (int64): a ``cu_seqlens`` whose sequences are the segments."""
    starts = lay.tok[:, 0, 0]
    return torch.cat([starts, starts.new_tensor([NT])])


def substituted_inputs(lay: sc.ScanLayout, linv: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                       log_alpha: torch.Tensor):
    """``(L⁻¹(γ⊙K), L⁻¹V, g)`` packed, from the per-token rows of every chunk's ``L⁻¹`` (``[NT, H', C]``).

    One batched product per chunk; ``g`` is the chunk-local cumulative log-decay ``[NT, H', Da]``.
    ``L⁻¹V`` is None when ``v`` is.  Arithmetic in ``linv``'s dtype.
    """
    NT = k.shape[0]
    Lg = lay.grid(linv, 0.0)  # [n_s, S, H', C, C]
    g = torch.cumsum(lay.grid(log_alpha.to(linv.dtype), 0.0), dim=-2)
    kw = Lg @ (torch.exp(g) * lay.grid(k.to(linv.dtype), 0.0))
    vu = lay.scatter(Lg @ lay.grid(v.to(linv.dtype), 0.0), NT) if v is not None else None
    return lay.scatter(kw, NT), vu, lay.scatter(g, NT)


def phase_a_triton(lay: sc.ScanLayout, q, k, r2, ell2, log_alpha, segs: torch.Tensor, dtype=torch.float64):
    """Phase A on the GPU: segment elements ``(A_s, C_s, J_s, failed)`` of the segments ``segs``.

    1. the covariance kernel from P = 0 over every segment (float64 buffers: the kernel computes in
       its state's dtype, whatever the inputs'): ``C_s`` (its end P), W, and the ``L⁻¹`` rows;
    2. ``β_i = (1 − k_iᵀw_i)/r_i²`` (exact: ``k_iᵀu_i = d_i − r_i²``; in float64 the cancellation
       costs ≈ ε₆₄/(β r²), negligible), and ``L⁻¹(γ⊙K)``;
    3. :func:`scan_track_kernel` over ``segs``: ``A_s``, ``J_s``.
    Packed inputs ``[NT, H', ·]`` as :class:`bayeslayer.ops.scan.ScanCall`'s.  The kernel of step 1
    also runs the last segment of each sequence (whose element is never used): one launch.
    """
    NT, Hf, D = k.shape
    dev, C, S, n = k.device, lay.C, lay.n_segments, segs.numel()
    BD = max(16, _next_pow2(D))
    diag = log_alpha.shape[-1] > 1
    # per-channel decays are accumulated in the kernel without a cast: give them the state's dtype
    la_k = log_alpha.to(dtype).contiguous() if diag else log_alpha[..., 0].contiguous()
    P = torch.zeros(S, Hf, D, D, dtype=dtype, device=dev)
    W = torch.empty(NT, Hf, D, dtype=dtype, device=dev)
    linv = torch.empty(NT, Hf, C, dtype=dtype, device=dev)
    scr = torch.empty(S, Hf, C, BD, dtype=dtype, device=dev)
    scr2 = torch.empty_like(scr)
    cu_seg = segment_offsets(lay, NT)
    A = torch.eye(D, dtype=dtype, device=dev).expand(n, Hf, D, D).contiguous()
    J = torch.zeros(n, Hf, D, D, dtype=dtype, device=dev)
    if NT == 0 or n == 0:
        return A, P[segs], J, torch.zeros(n, Hf, dtype=torch.bool, device=dev)
    ldl_scr, ldl_fail = ldl_scratch(S, Hf, C, dtype, dev)
    bl_chunk_cov_kernel[(S, Hf)](
        q, k, r2, ell2, la_k, cu_seg, P, W, linv, scr, scr2, W, scr, cu_seg, ldl_scr, ldl_fail,
        H=Hf, D=D, C=C, BD=BD, BK=16, DIAG=diag, HAS_ALPHA=True, RETURN_VAR=False, SAVE_CK=False,
        PREC="ieee", CK_EVERY=1, num_warps=8 if C >= 64 else 4,
    )
    beta = (1.0 - (k.to(dtype) * W).sum(-1)) / r2.to(dtype)
    kw, _, _ = substituted_inputs(lay, linv, k, None, log_alpha)
    Hscr = torch.empty(n, Hf, C, BD, dtype=dtype, device=dev)
    scan_track_kernel[(n, Hf)](
        W, kw, beta, la_k, cu_seg, segs, A, J, Hscr, H=Hf, D=D, C=C, BD=BD, BK=16, DIAG=diag, PREC="ieee",
        num_warps=4,
    )
    Cm = P[segs]
    bad = (ldl_fail[segs] != 0) | ~(torch.isfinite(Cm).flatten(-2).all(-1) & torch.isfinite(A).flatten(-2).all(-1)
            & torch.isfinite(J).flatten(-2).all(-1))
    return A, Cm, J, bad


def _default_mean(dtype: torch.dtype):
    if dtype != torch.float64:
        try:
            from ..fla_mean import mean_pass_fla, require_fla

            require_fla()
            return mean_pass_fla
        except RuntimeError:
            pass
    return sc.mean_pass_reference


def forward_scan_triton(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, want_var, *, n_segments=None,
                        segment_chunks=None, mean=None, timings: dict | None = None, phase_a: str = "triton"):
    """The BL forward, covariance pass as a segment scan with Phase C on Triton; mean pass on fla's kernels.

    Same arguments and returns as ``ops/triton/chunk.py::_forward_triton``:
    ``(o [B, T, H, m], variance [B, T, H, G] or None, M [N, H, D, m], P [N, H, D, D] or [N, H, G, D, D])``.
    q, k ``[B, T, H, D]`` (D ≤ 256), v ``[B, T, H, m]``, r2 ``[B, T, H]`` or ``[B, T, H, G]``, ell2
    ``[B, T, H]``, alpha None / ``[B, T, H]`` / ``[B, T, H, D]``; ``cu`` packs sequences (B = 1).
    ``n_segments`` / ``segment_chunks``: see :func:`bayeslayer.ops.scan.prepare_scan`.  ``mean``:
    the mean pass (default fla's kernels when installed, except float64: the PyTorch twin).
    ``timings``: a dict that receives per-phase seconds (``phase_a``, ``phase_b``, ``phase_c``,
    ``substitute``, ``mean``) — it synchronises the device once, at the end.
    ``phase_a``: ``"triton"`` (:func:`phase_a_triton`) or ``"torch"`` (:func:`bayeslayer.ops.scan.phase_a`),
    both float64.  Forward only: no autograd graph is recorded.
    """
    if chunk_size not in SUPPORTED_CHUNK_SIZES or isinstance(chunk_size, bool):
        raise ValueError(f"the Triton path supports chunk_size in {SUPPORTED_CHUNK_SIZES}, got {chunk_size!r}")
    if isinstance(q, torch.Tensor) and q.dim() == 4 and not 1 <= q.shape[-1] <= 256:
        raise ValueError(f"the Triton path supports key dims D in 1..256, got D={q.shape[-1]}")
    with torch.no_grad():
        call = sc.prepare_scan(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, n_segments=n_segments,
                               segment_chunks=segment_chunks)
        clock = _Clock(timings, call.k.device)
        NT, Hf, D = call.k.shape
        cd, dev, C = call.k.dtype, call.k.device, call.C
        lay = sc.scan_layout(call.cu, C, call.segment_chunks, dev)
        diag = call.log_alpha.shape[-1] > 1

        # ---- Phase A (segment elements, float64) and Phase B (segment-start covariances) ----
        last = lay.last_segments
        segs = lay.element_segments  # sized on the host by the layout: no device-to-host sync
        f64 = torch.float64
        if phase_a == "triton":
            A, Cm, J, info_a = phase_a_triton(lay, call.q, call.k, call.r2, call.ell2, call.log_alpha, segs)
        elif phase_a == "torch":
            xa = {name: lay.grid(x, fill).to(f64) for name, x, fill in
                  (("k", call.k, 0.0), ("r2", call.r2, 1.0), ("ell2", call.ell2, 0.0), ("la", call.log_alpha, 0.0))}
            A, Cm, J, info_a = sc.phase_a(lay, xa, segs)
        else:
            raise ValueError(f"phase_a must be 'triton' or 'torch', got {phase_a!r}")
        clock.mark("phase_a")
        P_starts, failed = sc.phase_b(lay, call.P0.to(f64), (A, Cm, J, segs))
        failed.index_put_((lay.seg_seq[segs],), info_a, accumulate=True)
        clock.mark("phase_b")

        # ---- Phase C: the chunk-serial covariance kernel over the segments, from P_s ----
        S = lay.n_segments
        BD = max(16, _next_pow2(D))
        P = P_starts.to(cd).contiguous()  # the kernel writes each segment's end covariance in place
        W = torch.empty(NT, Hf, D, dtype=cd, device=dev)
        linv = torch.empty(NT, Hf, C, dtype=cd, device=dev)
        var = torch.empty(NT, Hf, dtype=cd, device=dev) if want_var else W.new_empty(1)
        Yscr = torch.empty(S, Hf, C, BD, dtype=cd, device=dev)
        Uscr = torch.empty_like(Yscr)
        cu_seg = segment_offsets(lay, NT)
        la_k = call.log_alpha.contiguous() if diag else call.log_alpha[..., 0].contiguous()
        ldl_scr, ldl_fail = ldl_scratch(S, Hf, C, cd, dev)
        if NT > 0:
            bl_chunk_cov_kernel[(S, Hf)](
                call.q, call.k, call.r2, call.ell2, la_k, cu_seg, P, W, linv, Yscr, Uscr, var, Yscr, cu_seg,
                ldl_scr, ldl_fail,
                H=Hf, D=D, C=C, BD=BD, BK=16, DIAG=diag, HAS_ALPHA=True, RETURN_VAR=want_var, SAVE_CK=False,
                PREC="ieee" if cd == f64 else PREC, CK_EVERY=1, num_warps=8 if C >= 64 else 4,
            )
        # a failed LDLᵀ pivot leaves non-finite numbers behind: folded into the same device-side flag
        failed |= ~torch.isfinite(P[last]).flatten(-2).all(-1)
        failed.index_put_((lay.seg_seq,), ldl_fail != 0, accumulate=True)
        clock.mark("phase_c")

        # ---- the substituted tensors of the mean pass ----
        kw, vu, g = substituted_inputs(lay, linv, call.k, call.v, call.log_alpha)
        clock.mark("substitute")
        if mean is None and _default_mean(cd) is not sc.mean_pass_reference:
            # fla's kernels, on operands in the caller's dtype when it is 16-bit (as GDN runs its w, u)
            md = call.dims.dtype if call.dims.dtype in (torch.bfloat16, torch.float16) else cd
            o, M = _default_mean(cd)(call.q.to(md), W.to(md), kw.to(md), vu.to(md), g, call.M0, call.cu, C)
        else:
            o, M = (mean or sc.mean_pass_reference)(call.q, W, kw, vu, g, call.M0, call.cu, C)
        clock.mark("mean")
        clock.finish()
        sc.raise_if_failed(failed, "forward_scan_triton")
        return sc.finish_scan(call, o, var if want_var else None, M, P[last])
