"""The covariance pass as an exact segment scan (docs/theory.md §6.2–6.3), in plain PyTorch.

The chunk-serial covariance pass (:func:`bayeslayer.ops.bayesian_layer.chunk.covariance_pass`) is a chain of
``T/C`` dependent chunk steps per head.  Here each sequence is split into segments of ``n_s``
chunks and the chain runs in three phases (Särkkä & García-Fernández 2021, filtering elements)::

    prep     parallel over chunks:    decays, K̃ = Φᵀk, B k, the P-free C×C base of S, noise terms
    Phase A  parallel over segments:  run the chunk step from P = 0, tracking
                                          H = L⁻¹ K̃ A_run,  A_run ← Φ_C A_run − W̃ᵀ H,  J += Hᵀ diag(β) H
                                      (W̃ = Φ_CΦ_i⁻¹ w_i); the element is (A_s, C_s = P of that run, J_s)
    Phase B  serial over segments:    P_{s+1} = A (I + P_s J)⁻¹ P_s Aᵀ + C in the PSD-preserving form
                                          G = chol(P_s),  R = chol(I + GᵀJG),  Z = A G R⁻ᵀ,  P_{s+1} = Z Zᵀ + C
    Phase C  parallel over segments:  replay the segment's chunks from P_s and write what the mean pass
                                      needs: W = βU, L⁻¹, β, the predictive variance, L⁻¹(γ⊙K), L⁻¹V

Per chunk, Phase A and C run the chunk step of every PyTorch path,
:func:`bayeslayer.ops.bayesian_layer.covariance.covariance_step` (Phase A with ``A_run``, ``J`` tracked).

The scan is exact: in float64 it equals :func:`bayeslayer.ops.bl_chunk` to rounding
(``tests/ops/test_scan.py``).  This module is the plain-PyTorch twin the Triton kernels of
:mod:`bayeslayer.ops.bayesian_layer.scan_triton` are tested against; it is not meant to be fast on a CPU.

Layout.  Tokens are packed ``[NT, H', ...]`` (``NT = B·T``; ``H' = H·G`` with observation-noise
groups folded into heads).  Sequence ``n`` is tokens ``cu[n] .. cu[n+1]-1`` (``cu`` from
``cu_seqlens``, or ``[0, T, 2T, ...]``), split into chunks of ``C`` tokens (the last one ragged)
and its chunks into segments of ``n_s`` chunks: a segment never crosses a sequence boundary.
Ragged chunks and segments are padded with exact no-op tokens (``k = 0``, ``α = 1``, ``ℓ² = 0``,
``r² = 1``), which leave P, A_run and J unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..utils.validation import check_chunk_size, check_cu_seqlens, check_qkv, check_state, split_state
from . import groups as grp
from .covariance import covariance_prework, covariance_step, sym
from .dynamics import ChunkDynamics, unit_lower_inverse
from .prepare import prepare

# Phase A and C run one program per (segment, head).  An H100/H200 has 132 SMs: with at least that many
# (sequence, head) chains one segment per sequence already fills the GPU and Phase A/B would be pure extra work;
# below it, aim at about two waves (TARGET_WAVES programs per SM).
DEFAULT_SMS = 132
TARGET_WAVES = 2
TARGET_PROGRAMS = TARGET_WAVES * DEFAULT_SMS
# up to this many tokens a sequence is one segment: the chain is short and the extra Phase A/B work is not worth it
ONE_SEGMENT_MAX_T = 4096
# no segment shorter than this many chunks (Phase A costs about twice Phase C per chunk)
MIN_SEGMENT_CHUNKS = 4


def device_sms(device) -> int:
    """Streaming multiprocessors of ``device`` (a CUDA device's own count; :data:`DEFAULT_SMS` otherwise)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS


def choose_segment_chunks(n_programs: int, n_chunks: int, T: int, *, sms: int = DEFAULT_SMS) -> int:
    """Chunks per segment for ``n_programs = (sequences)·H'`` chains of ``n_chunks`` chunks (``T`` tokens).

    One segment when ``T ≤ ONE_SEGMENT_MAX_T`` or when the chains alone fill the GPU (``n_programs ≥ sms``,
    its SM count); otherwise ``≈ TARGET_WAVES·sms / n_programs`` segments per sequence (at least one, and
    none shorter than :data:`MIN_SEGMENT_CHUNKS` chunks).
    """
    for name, x in (("n_programs", n_programs), ("n_chunks", n_chunks), ("T", T), ("sms", sms)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ValueError(f"{name} must be a non-negative int, got {x!r}")
    n_chunks = max(n_chunks, 1)
    if T <= ONE_SEGMENT_MAX_T or n_programs >= max(sms, 1):
        return n_chunks
    n_seg = max(1, min(n_chunks // MIN_SEGMENT_CHUNKS, round(TARGET_WAVES * sms / max(n_programs, 1))))
    return math.ceil(n_chunks / n_seg)


@dataclass
class ScanLayout:
    """Where every chunk and segment of a packed batch lies (host-side integers and index tensors).

    ``cu``: sequence offsets (n_seq + 1 ints); ``C``: chunk size; ``n_s``: chunks per segment.
    ``seg_seq[s]``: the sequence of segment s; ``seq_first_seg[n]``, ``seq_n_seg[n]``: its segments
    are ``seq_first_seg[n] .. + seq_n_seg[n] - 1`` in order.  ``tok``: ``[S, n_s, C]`` token index of
    every position of every segment, ``inside``: whether that position is a real token.
    ``phase_b_steps`` (the PyTorch Phase B and B3 twins' serial steps) is built on first use, from the
    host-side segment counts: it holds two index tensors per step (per chunk for a one-chunk-per-segment
    layout), which the layouts that never step over segments (``substituted``, the substitution's adjoint,
    the Triton phases) must not pay for.
    """

    cu: list[int]
    C: int
    n_s: int
    seg_seq: torch.Tensor
    seq_first_seg: torch.Tensor
    seq_n_seg: torch.Tensor
    tok: torch.Tensor
    inside: torch.Tensor
    # host-side bookkeeping, so that no phase needs a device-to-host sync to size its work
    element_segments: torch.Tensor | None = None  # all but the last segment of each sequence
    seg_counts: list[int] = field(default_factory=list)  # host copy of seq_n_seg (sizes work without a sync)
    _phase_b_steps: list | None = field(default=None, repr=False, compare=False)

    @property
    def phase_b_steps(self) -> list:
        """Step ``j`` of a serial pass over segments: ``(sequences with > j + 1 segments, their segment j)``,
        two int64 index tensors on the layout's device; built on first use and kept."""
        if self._phase_b_steps is None:
            first = [0]
            for k in self.seg_counts[:-1]:
                first.append(first[-1] + k)
            i64 = dict(dtype=torch.int64, device=self.tok.device)
            steps = []
            for j in range(max(self.seg_counts, default=1) - 1):
                seqs = [n for n, k in enumerate(self.seg_counts) if k > j + 1]
                steps.append((torch.tensor(seqs, **i64), torch.tensor([first[n] + j for n in seqs], **i64)))
            self._phase_b_steps = steps
        return self._phase_b_steps

    @property
    def last_segments(self) -> torch.Tensor:
        """The last segment of every sequence ``[N]`` (its end state is the sequence's final state)."""
        return self.seq_first_seg + self.seq_n_seg - 1

    @property
    def n_seq(self) -> int:
        return len(self.cu) - 1

    @property
    def n_segments(self) -> int:
        return self.seg_seq.numel()

    def grid(self, x: torch.Tensor, fill: float) -> torch.Tensor:
        """Packed ``[NT, H', ...]`` -> ``[n_s, S, H', C, ...]`` (position-major, no-op ``fill`` outside)."""
        NT = x.shape[0]
        idx = self.tok.clamp(max=max(NT - 1, 0))
        g = x[idx] if NT > 0 else x.new_zeros(*idx.shape, *x.shape[1:])  # [S, n_s, C, H', ...]
        g = g.masked_fill(~self.inside.view(*self.inside.shape, *([1] * (x.dim() - 1))), fill)
        return g.movedim(2, 3).movedim(1, 0).contiguous()

    def scatter(self, g: torch.Tensor, NT: int) -> torch.Tensor:
        """Inverse of :meth:`grid`: ``[n_s, S, H', C, ...]`` -> packed ``[NT, H', ...]`` (real tokens only)."""
        g = g.movedim(0, 1).movedim(3, 2)  # [S, n_s, C, H', ...]
        out = g.new_zeros(NT, *g.shape[3:])
        out[self.tok[self.inside]] = g[self.inside]
        return out


def scan_layout(cu: list[int], C: int, segment_chunks: int, device) -> ScanLayout:
    """Segments of ``segment_chunks`` chunks inside every sequence of ``cu`` (a sequence has ≥ 1 segment)."""
    C = check_chunk_size(C)
    if isinstance(segment_chunks, bool) or not isinstance(segment_chunks, int) or segment_chunks < 1:
        raise ValueError(f"segment_chunks must be a positive int, got {segment_chunks!r}")
    n_s = segment_chunks
    seg_seq, first, nseg, starts, ends = [], [], [], [], []
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        n_chunks = -(-(b - a) // C)
        k = max(1, -(-n_chunks // n_s))
        first.append(len(seg_seq))
        nseg.append(k)
        for j in range(k):
            seg_seq.append(n)
            starts.append(a + j * n_s * C)
            ends.append(b)
    pos = torch.arange(n_s * C, device=device)
    st = torch.tensor(starts, dtype=torch.int64, device=device)
    en = torch.tensor(ends, dtype=torch.int64, device=device)
    tok = st[:, None] + pos[None, :]
    inside = tok < en[:, None]
    i64 = dict(dtype=torch.int64, device=device)
    lay = ScanLayout(
        cu=list(cu), C=C, n_s=n_s, seg_seq=torch.tensor(seg_seq, **i64), seq_first_seg=torch.tensor(first, **i64),
        seq_n_seg=torch.tensor(nseg, **i64), tok=tok.view(-1, n_s, C), inside=inside.view(-1, n_s, C),
        seg_counts=nseg,
    )
    lay.element_segments = torch.tensor([f + j for f, k in zip(first, nseg, strict=True) for j in range(k - 1)],
                                         **i64)
    return lay


class ScanOutput(NamedTuple):
    """What the covariance scan hands the mean pass (packed ``[NT, H', ...]``, compute dtype).

    ``w``: write keys ``βu`` ``[NT, H', D]``; ``beta`` ``[NT, H']``; ``linv``: row ``i`` of its chunk's
    ``L⁻¹`` ``[NT, H', C]``; ``variance`` ``[NT, H']`` or None; ``kw = L⁻¹(γ⊙K)`` ``[NT, H', D]`` and
    ``vu = L⁻¹V`` ``[NT, H', m]`` (fla's ``w`` and ``u``); ``g``: chunk-local cumulative log-decay
    ``[NT, H', Da]``; ``P``: final covariance per sequence ``[N, H', D, D]``; ``P_starts``: P at the
    start of every segment ``[S, H', D, D]`` (the backward's checkpoints); ``failed``: ``[N, H']`` bool,
    a chunk or Phase-B factorisation was not positive definite (a device-side flag, checked once).
    """

    w: torch.Tensor
    beta: torch.Tensor
    linv: torch.Tensor
    variance: torch.Tensor | None
    kw: torch.Tensor
    vu: torch.Tensor
    g: torch.Tensor
    P: torch.Tensor
    P_starts: torch.Tensor
    failed: torch.Tensor


def chunk_prep(k, r2, ell2, log_alpha, q=None):
    """Prep (parallel over chunks): everything of a chunk that does not depend on ``P``.

    Inputs laid out ``[..., C, ·]`` (any leading dims): k ``[..., C, D]``, r2/ell2 ``[..., C]``,
    log_alpha ``[..., C, Da]`` (Da = 1 scalar, D diagonal).  Returns a dict with the dynamics
    ``dyn`` (:class:`~bayeslayer.ops.bayesian_layer.dynamics.ChunkDynamics`), ``kt = Φᵀk``, ``NBk = B k``, ``base``
    (``S − K̃PK̃ᵀ``), ``BC`` (``diag B_C`` ``[..., 1, Da]``), ``b`` (the in-chunk noise ``diag B_j``
    ``[..., C, Da]``), ``g`` (cumulative log-decay) and, with ``q``, ``qt = Φᵀq`` and ``qBq``.
    """
    dyn = ChunkDynamics(log_alpha, None)
    b, kt, NBk, base, BC = covariance_prework(dyn, k, r2, ell2)
    out = dict(dyn=dyn, kt=kt, NBk=NBk, base=base, BC=BC, b=b, g=torch.cumsum(log_alpha, -2))
    if q is not None:
        out["qt"] = dyn.adj(q)
        out["qBq"] = dyn.noise_quad(ell2, q, b)
    return out


def chunk_bounds(cu: list[int], C: int) -> tuple[list[int], list[int], list[int]]:
    """Every chunk of the packed sequences ``cu`` (host lists): ``(bos, eos, first)``.

    Chunk ``c`` is tokens ``bos[c] .. eos[c] − 1`` (``C`` of them, fewer in a sequence's ragged last
    chunk); ``first[n]`` is sequence ``n``'s first chunk (``first[N]`` = the number of chunks).  A
    segment of :func:`scan_layout` is a run of whole chunks of one sequence, so the chunks of ``cu``
    are the chunks of every segment.
    """
    C = check_chunk_size(C)
    bos, eos, first = [], [], []
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        first.append(len(bos))
        for s in range(a, b, C):
            bos.append(s)
            eos.append(min(s + C, b))
    first.append(len(bos))
    return bos, eos, first


def prep_reference(k, r2, ell2, log_alpha, bos, eos, C: int, q=None) -> dict:
    """Plain-PyTorch twin of the prep kernel (``ops/bayesian_layer/kernels_triton.py::bl_chunk_prep_kernel``).

    Packed ``[NT, H', ·]`` inputs (k ``[NT, H', D]``, r2, ell2 ``[NT, H']``, log_alpha ``[NT, H', Da]``,
    q as k or None); ``bos``, ``eos`` the chunks (:func:`chunk_bounds`).  Per chunk, padded to ``C``
    rows with the no-op tokens: ``g``, ``b`` ``[NC, H', C, Da]``, ``base`` ``[NC, H', C, C]`` and, with
    ``q``, ``qBq`` ``[NC, H', C]`` — :func:`chunk_prep` on each chunk.
    """
    C = check_chunk_size(C)
    dev = k.device
    b0 = torch.as_tensor(bos, dtype=torch.int64, device=dev)
    e0 = torch.as_tensor(eos, dtype=torch.int64, device=dev)
    tok = b0[:, None] + torch.arange(C, device=dev)[None, :]  # [NC, C]
    inside = tok < e0[:, None]
    idx = tok.clamp(max=max(k.shape[0] - 1, 0))

    def grid(x, fill):  # [NT, H', ...] -> [NC, H', C, ...]
        g = x[idx].masked_fill(~inside.view(*inside.shape, *([1] * (x.dim() - 1))), fill)
        return g.movedim(1, 2)

    pre = chunk_prep(grid(k, 0.0), grid(r2, 1.0), grid(ell2, 0.0), grid(log_alpha, 0.0),
                     q=grid(q, 0.0) if q is not None else None)
    out = dict(g=pre["g"], b=pre["b"], base=pre["base"])
    if q is not None:
        out["qBq"] = pre["qBq"]
    return out


def ldl_clamped(S: torch.Tensor, floor: torch.Tensor):
    """``S = L diag(d) Lᵀ`` with every pivot clamped from below, ``d_j = max(raw_j, floor_j)``.

    The plain-PyTorch twin of the Triton kernels' blocked factorisation
    (:func:`bayeslayer.ops.utils.ldl_triton.ldl_blocked`): the clamped elimination is the exact
    ``LDLᵀ`` of ``S + diag(δ)`` (δ ≥ 0 what the clamp adds), so blocking does not change it.
    S ``[..., N, N]`` symmetric, floor ``[..., N]``.  Returns ``(L, d, L⁻¹, failed)``; ``failed``
    ``[...]`` is True where a raw pivot was not positive or not finite.
    """
    if not isinstance(S, torch.Tensor) or S.dim() < 2 or S.shape[-1] != S.shape[-2]:
        raise ValueError(f"S must be a [..., N, N] tensor, got {getattr(S, 'shape', type(S).__name__)}")
    if not isinstance(floor, torch.Tensor) or floor.shape != S.shape[:-1]:
        raise ValueError(f"floor must be a tensor of shape {tuple(S.shape[:-1])}, got "
                         f"{getattr(floor, 'shape', type(floor).__name__)}")
    N = S.shape[-1]
    A = sym(S).clone()
    L = torch.zeros_like(A)
    d = torch.zeros_like(A[..., 0])
    failed = torch.zeros(S.shape[:-2], dtype=torch.bool, device=S.device)
    for j in range(N):
        raw = A[..., j, j]
        failed |= ~(raw > 0)
        dj = torch.maximum(raw, floor[..., j])
        d[..., j] = dj
        lj = A[..., :, j] / dj[..., None]
        lj[..., : j + 1] = 0.0
        L[..., :, j] = lj
        A = A - lj[..., :, None] * A[..., j, None, :]
    L = L + torch.eye(N, dtype=S.dtype, device=S.device)
    return L, d, unit_lower_inverse(L), failed


def apply_element(A, Cm, J, P):
    """Phase B step ``P ↦ A (I + P J)⁻¹ P Aᵀ + C`` in the PSD-preserving Cholesky form.

    ``G = chol(P)``, ``R = chol(I + GᵀJG)`` (eigenvalues ≥ 1), ``Z = A G R⁻ᵀ``, result ``Z Zᵀ + C``.
    All ``[..., D, D]``.  Returns ``(P_next, info)``, ``info`` nonzero where a factorisation failed.
    """
    G, i1 = torch.linalg.cholesky_ex(P)
    eye = torch.eye(P.shape[-1], dtype=P.dtype, device=P.device)
    R, i2 = torch.linalg.cholesky_ex(sym(eye + G.transpose(-1, -2) @ J @ G))
    Z = torch.linalg.solve_triangular(R, (A @ G).transpose(-1, -2), upper=False).transpose(-1, -2)
    return sym(Z @ Z.transpose(-1, -2) + Cm), (i1 != 0) | (i2 != 0)


def mark_failed(failed: torch.Tensor, seqs: torch.Tensor, flags: torch.Tensor) -> None:
    """``failed[seqs[i]] |= flags[i]`` in place (several segments may share a sequence), on the device.

    Accumulated in int32, not bool: whether CUDA's accumulating ``index_put_`` (atomic adds) takes
    bool tensors was not checked on a GPU, int32 it does."""
    acc = torch.zeros(failed.shape, dtype=torch.int32, device=failed.device)
    acc.index_put_((seqs,), flags.to(torch.int32), accumulate=True)
    failed |= acc != 0


def _gather(lay: ScanLayout, packed: dict, fills: dict) -> dict:
    return {name: lay.grid(x, fills[name]) if x is not None else None for name, x in packed.items()}


def phase_a(lay: ScanLayout, xs: dict, segs: torch.Tensor):
    """Segment elements ``(A_s, C_s, J_s)`` of the segments ``segs`` (from P = 0), ``[len(segs), H', D, D]``."""
    D = xs["k"].shape[-1]
    Hf = xs["k"].shape[2]
    dt, dev = xs["k"].dtype, xs["k"].device
    n = segs.numel()
    P = torch.zeros(n, Hf, D, D, dtype=dt, device=dev)
    A = torch.eye(D, dtype=dt, device=dev).expand(n, Hf, D, D).clone()
    J = torch.zeros_like(P)
    info = torch.zeros(n, Hf, dtype=torch.bool, device=dev)
    for j in range(lay.n_s):
        pre = chunk_prep(xs["k"][j, segs], xs["r2"][j, segs], xs["ell2"][j, segs], xs["la"][j, segs])
        st = covariance_step(pre["dyn"], pre["kt"], pre["NBk"], pre["base"], pre["BC"], P, A=A, J=J)
        P, A, J = st["P"], st["A"], st["J"]
        info |= st["info"] != 0
    return A, P, J, info


def phase_b(lay: ScanLayout, P0: torch.Tensor, elements):
    """P at the start of every segment ``[S, H', D, D]``: serial over each sequence's segments.

    ``P0`` ``[N, H', D, D]``; ``elements = (A, C, J, segs)`` for the segments that are not last in
    their sequence.  Sequences advance together: step ``j`` moves every sequence with more than
    ``j + 1`` segments from its segment ``j`` to ``j + 1``.  Returns ``(P_starts, failed [N, H'])``.
    """
    A, Cm, J, segs = elements
    S = lay.n_segments
    P_starts = P0.new_zeros(S, *P0.shape[1:])
    P_starts[lay.seq_first_seg] = P0
    failed = torch.zeros(P0.shape[:2], dtype=torch.bool, device=P0.device)
    where = torch.full((S,), -1, dtype=torch.int64, device=P0.device)
    where[segs] = torch.arange(segs.numel(), device=P0.device)
    for seqs, cur in lay.phase_b_steps:
        e = where[cur]
        Pn, info = apply_element(A[e], Cm[e], J[e], P_starts[cur])
        P_starts[cur + 1] = Pn
        failed[seqs] |= info
    return P_starts, failed


def covariance_scan(q, k, v, r2, ell2, log_alpha, P0, cu: list[int], C: int, *, segment_chunks: int,
                    want_var: bool, element_dtype: torch.dtype | None = torch.float64) -> ScanOutput:
    """The segment scan on packed, folded inputs (compute dtype).

    q, k ``[NT, H', D]``, v ``[NT, H', m]``, r2, ell2 ``[NT, H']``, log_alpha ``[NT, H', Da]``
    (Da = 1 scalar, D diagonal), P0 ``[N, H', D, D]`` (N = ``len(cu) − 1`` sequences).

    ``element_dtype``: the arithmetic of Phase A and B (None: the inputs' dtype).  Float64 by
    default: in the stress regime (D = 64, T = 4096, fp32 inputs) an fp32 Phase A leaves the final
    P 6e-5 off float64 (the chunk-serial pass: 1e-5), an fp64 Phase A + B 2.3e-6; β is unaffected
    (``docs/kernels.md``, "Segment scan (v2)").  Phase C always runs in the inputs' dtype.
    """
    NT = k.shape[0]
    lay = scan_layout(cu, C, segment_chunks, k.device)
    xs = _gather(lay, dict(q=q, k=k, v=v, r2=r2, ell2=ell2, la=log_alpha),
                 dict(q=0.0, k=0.0, v=0.0, r2=1.0, ell2=0.0, la=0.0))
    # Phase A: every segment but the last of its sequence (the last one's element is never applied)
    last = lay.last_segments
    segs = lay.element_segments
    ed = element_dtype or k.dtype
    xa = {name: xs[name].to(ed) for name in ("k", "r2", "ell2", "la")}
    A, Cm, J, info_a = phase_a(lay, xa, segs)
    P_starts, failed = phase_b(lay, P0.to(ed), (A, Cm, J, segs))
    P_starts = P_starts.to(k.dtype)
    mark_failed(failed, lay.seg_seq[segs], info_a)
    # Phase C: replay every segment from its start
    P = P_starts
    outs = {name: [] for name in ("W", "beta", "Linv", "kw", "vu", "var", "g")}
    info_c = torch.zeros(lay.n_segments, P0.shape[1], dtype=torch.bool, device=k.device)
    for j in range(lay.n_s):
        pre = chunk_prep(xs["k"][j], xs["r2"][j], xs["ell2"][j], xs["la"][j], q=xs["q"][j] if want_var else None)
        st = covariance_step(pre["dyn"], pre["kt"], pre["NBk"], pre["base"], pre["BC"], P, v=xs["v"][j],
                             q=xs["q"][j] if want_var else None, qt=pre.get("qt"), qBq=pre.get("qBq"))
        P = st["P"]
        info_c |= st["info"] != 0
        for name in ("W", "beta", "Linv", "kw", "vu"):
            outs[name].append(st[name])
        outs["g"].append(pre["g"])
        if want_var:
            outs["var"].append(st["var"])
    mark_failed(failed, lay.seg_seq, info_c)
    P_end = P[last]
    out = {name: lay.scatter(torch.stack(x), NT) for name, x in outs.items() if x}
    return ScanOutput(w=out["W"], beta=out["beta"], linv=out["Linv"], variance=out.get("var"), kw=out["kw"],
                      vu=out["vu"], g=out["g"], P=P_end, P_starts=P_starts, failed=failed)


def mean_pass_reference(q, w, kw, vu, g, M0, cu: list[int], C: int):
    """Plain-PyTorch twin of fla's ``chunk_gated_delta_rule_fwd_h`` + ``chunk_fwd_o`` on the substituted tensors.

    Packed ``[NT, H', ·]``: q, ``w`` (write keys βu: fla's ``k``), ``kw = L⁻¹(γ⊙K)`` (fla's ``w``),
    ``vu = L⁻¹V`` (fla's ``u``), ``g`` chunk-local cumulative log-decay ``[NT, H', Da]`` (natural log),
    M0 ``[N, H', D, m]``.  Per chunk, with ``h`` the state at its start::

        E = vu − kw h ;   o = (γ⊙q) h + A E,   A_ti = q_tᵀ Φ_tΦ_i⁻¹ w_i (i ≤ t) ;   h ← Φ_C h + (Φ_CΦ_i⁻¹ w_i)ᵀ E

    Returns ``(o [NT, H', m], M [N, H', D, m])``.
    """
    NT = q.shape[0]
    n_chunks = max([-(-(b - a) // C) for a, b in zip(cu[:-1], cu[1:], strict=True)] + [1])
    lay = scan_layout(cu, C, n_chunks, q.device)  # one segment per sequence = one chain per sequence
    xs = _gather(lay, dict(q=q, w=w, kw=kw, vu=vu, g=g), dict(q=0.0, w=0.0, kw=0.0, vu=0.0, g=0.0))
    # padded positions of a ragged chunk must carry the chunk's last cumulative decay (α = 1 there)
    la = torch.diff(xs["g"], dim=-2, prepend=torch.zeros_like(xs["g"][..., :1, :]))
    la = la.masked_fill(~lay.inside.movedim(1, 0)[..., None, :, None], 0.0)
    h = M0
    os = []
    for j in range(lay.n_s):
        dyn = ChunkDynamics(la[j], None)
        E = xs["vu"][j] - xs["kw"][j] @ h
        os.append(dyn.adj(xs["q"][j]) @ h + dyn.scores(xs["q"][j], xs["w"][j]) @ E)
        h = dyn.end_rows(h) + dyn.to_end(xs["w"][j]).transpose(-1, -2) @ E
    return lay.scatter(torch.stack(os), NT), h


def _pack(x: torch.Tensor | None) -> torch.Tensor | None:
    # contiguous: the kernels index packed [NT, H', ·] tensors densely (a layer's q, k, v are strided views)
    return None if x is None else x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


class ScanCall(NamedTuple):
    """A validated, folded and packed call (see :func:`prepare_scan`)."""

    B: int
    T: int
    G: int
    dims: object
    cu: list[int]
    C: int
    segment_chunks: int
    q: torch.Tensor  # [NT, H', D] (compute dtype)
    k: torch.Tensor
    v: torch.Tensor  # [NT, H', m/G]
    r2: torch.Tensor  # [NT, H']
    ell2: torch.Tensor
    log_alpha: torch.Tensor  # [NT, H', Da]
    M0: torch.Tensor  # [N, H', D, m/G]
    P0: torch.Tensor  # [N, H', D, D]


def prepare_scan(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, *, n_segments=None,
                 segment_chunks=None) -> ScanCall:
    """Validate (as :func:`bayeslayer.ops.bayesian_layer.prepare.prepare`), fold groups into heads, pack ``[NT, H',
    ...]``, and fix the segment length (``n_segments`` or ``segment_chunks`` override :func:`choose_segment_chunks`)."""
    C = check_chunk_size(chunk_size)
    if n_segments is not None and segment_chunks is not None:
        raise ValueError("pass n_segments or segment_chunks, not both")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, D], got {getattr(q, 'shape', type(q).__name__)}")
    B, T = q.shape[:2]
    cu_t = check_cu_seqlens(cu, B, T, q.device)
    cu_l = cu_t.tolist() if cu_t is not None else [b * T for b in range(B + 1)]
    n_seq = len(cu_l) - 1
    pr = prepare(q, k, v, write="bayes", r2=r2, ell2=ell2, alpha=alpha, p0=p0)
    if pr.dyn.kind == "rotation":
        raise ValueError("the segment scan supports identity, scalar and diagonal decay, not rotations (theta)")
    dims, G = pr.dims, pr.G
    Hf, cd = pr.k.shape[2], dims.cdtype
    if M0 is not None:
        st = check_state((M0, P0), _with_batch(dims, n_seq), G)
        Mi, Pi = grp.fold_state_mean(st[0], G), grp.fold_state_cov(st[1])
    else:
        Mi = pr.M0[:1].expand(n_seq, -1, -1, -1)
        Pi = pr.P0[:1].expand(n_seq, -1, -1, -1)
    la = pr.dyn.log_alpha if pr.dyn.log_alpha is not None else pr.q.new_zeros(*pr.q.shape[:3], 1)
    n_chunks = max(-(-(b - a) // C) for a, b in zip(cu_l[:-1], cu_l[1:], strict=True))
    if segment_chunks is None:
        if n_segments is not None:
            if isinstance(n_segments, bool) or not isinstance(n_segments, int) or n_segments < 1:
                raise ValueError(f"n_segments must be a positive int, got {n_segments!r}")
            segment_chunks = max(1, math.ceil(n_chunks / n_segments))
        else:
            longest = max(b - a for a, b in zip(cu_l[:-1], cu_l[1:], strict=True))
            segment_chunks = choose_segment_chunks(n_seq * Hf, n_chunks, longest, sms=device_sms(q.device))
    return ScanCall(B=B, T=T, G=G, dims=dims, cu=cu_l, C=C, segment_chunks=segment_chunks, q=_pack(pr.q),
                    k=_pack(pr.k), v=_pack(pr.v), r2=_pack(pr.r2), ell2=_pack(pr.ell2), log_alpha=_pack(la),
                    M0=Mi.to(cd).contiguous(), P0=Pi.to(cd).contiguous())


def finish_scan(call: ScanCall, o, var, M, P):
    """Unfold packed results: ``(o [B, T, H, m], variance [B, T, H, G] or None, M, P)`` (final state unfolded)."""
    B, T, G = call.B, call.T, call.G
    Hf = call.k.shape[1]
    o = grp.unfold_values(o.reshape(B, T, Hf, -1), G).to(call.dims.dtype)
    var = grp.unfold_per_token(var.reshape(B, T, Hf), G) if var is not None else None
    return o, var, grp.unfold_state_mean(M, G), grp.unfold_state_cov(P, G)


def raise_if_failed(failed: torch.Tensor, where: str) -> None:
    """The one host sync of a forward: after the whole pass, not per chunk."""
    if bool(failed.any()):
        raise torch.linalg.LinAlgError(
            f"{where}: a chunk's prior observation covariance or a segment-start covariance is not positive "
            "definite (the filter inputs are too extreme for the working precision)"
        )


def forward_scan(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, want_var, *, n_segments=None,
                 segment_chunks=None, mean=None, element_dtype=torch.float64):
    """The Bayesian Layer forward with the covariance pass as a segment scan; plain PyTorch.

    Same arguments and returns as the Triton forward (``ops/bayesian_layer/chunk_triton.py::_forward_triton``):
    ``(o [B, T, H, m], variance [B, T, H, G] or None, M, P)``, the final state unfolded
    (``M [N, H, D, m]``, ``P [N, H, D, D]`` or ``[N, H, G, D, D]``; N = B, or the number of packed
    sequences with ``cu``).  Scalar, diagonal and identity decay (no rotations).
    ``n_segments`` (segments of the longest sequence) or ``segment_chunks`` override
    :func:`choose_segment_chunks`.  ``mean``: the mean pass, ``(q, w, kw, vu, g, M0, cu, C) ->
    (o, M)`` on packed tensors; default :func:`mean_pass_reference` (fla's kernels:
    :func:`bayeslayer.ops.bayesian_layer.mean_pass_fla.mean_pass_fla`).  ``element_dtype``: see :func:`covariance_scan`.
    """
    call = prepare_scan(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, n_segments=n_segments,
                        segment_chunks=segment_chunks)
    sc = covariance_scan(call.q, call.k, call.v, call.r2, call.ell2, call.log_alpha, call.P0, call.cu, call.C,
                         segment_chunks=call.segment_chunks, want_var=want_var, element_dtype=element_dtype)
    raise_if_failed(sc.failed, "forward_scan")
    o, M = (mean or mean_pass_reference)(call.q, sc.w, sc.kw, sc.vu, sc.g, call.M0, call.cu, call.C)
    return finish_scan(call, o, sc.variance, M, sc.P)


def _with_batch(dims, n: int):
    import dataclasses

    return dataclasses.replace(dims, B=n)


def bl_chunk_scan(q, k, v, r2, ell2, alpha=None, theta=None, p0=1.0, initial_state=None,
                  output_final_state: bool = False, return_variance: bool = False, chunk_size: int = 64,
                  cu_seqlens: torch.Tensor | None = None, n_segments: int | None = None):
    """:func:`bayeslayer.ops.bl_chunk`'s contract on :func:`forward_scan` (forward only, no rotations)."""
    if theta is not None:
        raise ValueError("bl_chunk_scan: rotations (theta) are not supported by the segment scan")
    check_qkv(q, k, v)
    M0, P0 = split_state(initial_state)
    o, var, M, P = forward_scan(q, k, v, r2, ell2, alpha, p0, M0, P0, cu_seqlens, chunk_size, return_variance,
                                n_segments=n_segments)
    state = (M, P) if output_final_state else None
    return (o, var, state) if return_variance else (o, state)
