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

from .. import scan as sc
from .kernels import bl_chunk_cov_kernel

SUPPORTED_CHUNK_SIZES = (16, 32, 64)
# fp32 tl.dot products of Phase C stay IEEE (a Kalman gain needs fp32; see ops/triton/chunk.py)
PREC = "ieee"


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


def substituted_inputs(lay: sc.ScanLayout, linv: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       log_alpha: torch.Tensor):
    """``(L⁻¹(γ⊙K), L⁻¹V, g)`` packed, from the per-token rows of every chunk's ``L⁻¹`` (``[NT, H', C]``).

    One batched product per chunk; ``g`` is the chunk-local cumulative log-decay ``[NT, H', Da]``.
    """
    NT = k.shape[0]
    Lg = lay.grid(linv, 0.0)  # [n_s, S, H', C, C]
    g = torch.cumsum(lay.grid(log_alpha, 0.0), dim=-2)
    kw = Lg @ (torch.exp(g) * lay.grid(k, 0.0))
    vu = Lg @ lay.grid(v, 0.0)
    return lay.scatter(kw, NT), lay.scatter(vu, NT), lay.scatter(g, NT)


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
                        segment_chunks=None, mean=None, timings: dict | None = None):
    """The BL forward, covariance pass as a segment scan with Phase C on Triton; mean pass on fla's kernels.

    Same arguments and returns as ``ops/triton/chunk.py::_forward_triton``:
    ``(o [B, T, H, m], variance [B, T, H, G] or None, M [N, H, D, m], P [N, H, D, D] or [N, H, G, D, D])``.
    q, k ``[B, T, H, D]`` (D ≤ 256), v ``[B, T, H, m]``, r2 ``[B, T, H]`` or ``[B, T, H, G]``, ell2
    ``[B, T, H]``, alpha None / ``[B, T, H]`` / ``[B, T, H, D]``; ``cu`` packs sequences (B = 1).
    ``n_segments`` / ``segment_chunks``: see :func:`bayeslayer.ops.scan.prepare_scan`.  ``mean``:
    the mean pass (default fla's kernels when installed, except float64: the PyTorch twin).
    ``timings``: a dict that receives per-phase seconds (``phase_a``, ``phase_b``, ``phase_c``,
    ``substitute``, ``mean``) — it synchronises the device once, at the end.
    Forward only: no autograd graph is recorded.
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
        last = lay.seq_first_seg + lay.seq_n_seg - 1
        not_last = torch.ones(lay.n_segments, dtype=torch.bool, device=dev)
        not_last[last] = False
        segs = torch.nonzero(not_last).flatten()  # host-side sizes come from the layout, not from a sync
        f64 = torch.float64
        xa = {name: lay.grid(x, fill).to(f64) for name, x, fill in
              (("k", call.k, 0.0), ("r2", call.r2, 1.0), ("ell2", call.ell2, 0.0), ("la", call.log_alpha, 0.0))}
        A, Cm, J, info_a = sc.phase_a(lay, xa, segs)
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
        if NT > 0:
            bl_chunk_cov_kernel[(S, Hf)](
                call.q, call.k, call.r2, call.ell2, la_k, cu_seg, P, W, linv, Yscr, Uscr, var, Yscr, cu_seg,
                H=Hf, D=D, C=C, BD=BD, BK=16, DIAG=diag, HAS_ALPHA=True, RETURN_VAR=want_var, SAVE_CK=False,
                PREC="ieee" if cd == f64 else PREC, CK_EVERY=1, num_warps=8 if C >= 64 else 4,
            )
        # a failed LDLᵀ pivot leaves non-finite numbers behind: folded into the same device-side flag
        failed |= ~torch.isfinite(P[last]).flatten(-2).all(-1)
        clock.mark("phase_c")

        # ---- the substituted tensors of the mean pass ----
        kw, vu, g = substituted_inputs(lay, linv, call.k, call.v, call.log_alpha)
        clock.mark("substitute")
        o, M = (mean or _default_mean(cd))(call.q, W, kw, vu, g, call.M0, call.cu, C)
        clock.mark("mean")
        clock.finish()
        sc.raise_if_failed(failed, "forward_scan_triton")
        return sc.finish_scan(call, o, var if want_var else None, M, P[last])
