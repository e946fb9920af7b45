"""Context parallelism: one long packed sequence split along T across the ranks of a process group.

Rank ``r`` of ``R`` holds the contiguous slice ``[a_r, b_r)`` (``a_r = r·T // R``) of the global
packed sequence ``cu_seqlens_global`` (B = 1).  Sequences may start and end inside a slice and may
span several ranks.  The filter state crossing the slice boundary ``a_r`` is rebuilt from what the
ranks before it send, exactly (docs/theory.md §6.2-6.3: the segment scan's elements, with a rank's
slice as one segment):

* **Covariance** (Phase A across ranks).  A rank whose slice lies inside one sequence (a
  *pass-through* rank) runs the covariance pass over its slice from ``P = 0`` and keeps its
  filtering element ``(A, C, J)``, three ``D×D`` maps per head: ``P_end = A (I + P_start J)⁻¹
  P_start Aᵀ + C`` for any start ``P_start``.  Any other rank has a sequence boundary inside its
  slice, so the state at its end does not depend on the ranks before it: it sends that end state
  ``C`` (with ``A = J = 0``).
* **Phase B across ranks.**  One all-gather of those elements; rank ``r`` chains those of the ranks
  after the last non-pass-through rank before it (``apply_element``) and has ``P`` at ``a_r``.
* **Mean.**  Given ``P``, the mean is affine in the start mean: ``M_end = T M_start + c``.  A
  pass-through rank runs its slice once with the values ``[v | 0]`` and start mean ``[0 | I]`` per
  group, which gives ``c``, ``T`` (``D×D``) and, per token, the part of the output that the start mean
  contributes (``o_t = o⁰_t + M_startᵀ õ_t``); a second all-gather of ``(T, c)`` and a local chain
  give ``M`` at ``a_r``.  Every other rank sends its end mean.
* **Phase C.**  Each rank finishes its own slice locally: the pass-through rank applies
  ``M_start`` to its outputs; the others run the piece of the sequence that crossed ``a_r``
  from the rebuilt ``(M, P)`` (the pieces after it already ran, from their own initial states,
  before the first all-gather).

Communication per rank per call: two all-gathers of ``S₁ = (3·H'·D² + 1)`` and
``S₂ = (H'·D² + H'·D·m/G + 1)`` float64 numbers (``H' = H·G``), whatever T is; the backward
all-reduces the gradients of the gathered ``[R, S]`` tensors.  :attr:`CPContext.comm_bytes` counts
them.  Autograd flows through the all-gathers, so each rank's backward gives the gradients of its
own slice and its share of the shared parameters (their sum over ranks is the one-process gradient,
as with data parallelism).  Every rank must run the forward and the backward of every call (the
backward runs collectives too).

This is the PyTorch path (:func:`bayeslayer.ops.bayesian_layer.chunk.filter_chunk` for the local work, the segment
scan's :func:`~bayeslayer.ops.bayesian_layer.scan.phase_a` and
:func:`~bayeslayer.ops.bayesian_layer.scan.apply_element` for the elements): scalar, diagonal and identity decay, write
model ``bayes``, G ≥ 1 groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..utils.validation import check_chunk_size, check_cu_seqlens
from . import groups as grp
from .chunk import filter_chunk
from .prepare import FilterOutput, prepare
from .scan import apply_element, phase_a, scan_layout

__all__ = ["CPContext", "build_cp_context", "comm_bytes_per_call", "cp_all_gather", "cp_conv_halo", "filter_chunk_cp"]

ELEMENT_DTYPE = torch.float64  # the elements and the chains across ranks run in float64


@dataclass
class CPContext:
    """Where this rank's slice lies in the global packed sequence (host-side metadata, built once per batch).

    ``bounds``: the ``R + 1`` slice offsets (rank ``r`` holds tokens ``bounds[r] .. bounds[r+1] − 1``);
    ``cu``: the global sequence offsets; ``local_cu``: this rank's sequence offsets inside its slice
    (pieces of global sequences); ``piece_seq``: the global sequence of every local piece;
    ``continues[r]``: rank ``r``'s slice starts inside a sequence (its first piece continues one from
    rank ``r − 1``); ``passthrough[r]``: rank ``r``'s slice lies inside one sequence that continues
    from before it; ``final_seqs``: the global sequences whose last token is on this rank (the final
    states this rank returns, in this order); ``conv_halo``: ``conv1d_kernel_size − 1`` tokens of the
    previous rank the short convolution needs (0 without one).  ``comm_bytes``: bytes this rank handed
    to collectives, by phase (``forward``: the all-gathers' inputs; ``forward_received``: their outputs;
    ``backward``: the all-reduced gradients); :meth:`reset_comm` zeroes them.
    """

    group: object
    rank: int
    world_size: int
    bounds: list[int]
    cu: list[int]
    local_cu: list[int]
    piece_seq: list[int]
    continues: list[bool]
    passthrough: list[bool]
    final_seqs: list[int]
    conv1d_kernel_size: int | None
    comm_bytes: dict = field(default_factory=lambda: {"forward": 0, "forward_received": 0, "backward": 0})

    @property
    def start(self) -> int:
        return self.bounds[self.rank]

    @property
    def local_len(self) -> int:
        return self.bounds[self.rank + 1] - self.bounds[self.rank]

    @property
    def conv_halo(self) -> int:
        return 0 if self.conv1d_kernel_size is None else self.conv1d_kernel_size - 1

    def reset_comm(self) -> None:
        for key in self.comm_bytes:
            self.comm_bytes[key] = 0


def _group_rank(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "build_cp_context: torch.distributed is not initialised (call "
            "torch.distributed.init_process_group first, e.g. under torchrun)"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("build_cp_context: this process is not a member of group (pass the CP group it belongs to)")
    return rank, dist.get_world_size(group)


def build_cp_context(
    cu_seqlens_global: torch.Tensor | None = None,
    *,
    total_len: int | None = None,
    group=None,
    conv1d_kernel_size: int | None = None,
) -> CPContext:
    """The CP context of this rank: call it on every rank of ``group`` with the same arguments.

    ``cu_seqlens_global``: ``[N + 1]`` int offsets of the packed sequences over the whole (global)
    length ``T``; None for one sequence of ``total_len`` tokens.  ``group``: the process group of the
    ranks that share the sequence (None: the default group).  ``conv1d_kernel_size``: the width of
    the short convolution in front of the layer, if any (its halo comes from the previous rank).
    Rank ``r`` of ``R`` holds tokens ``r·T//R .. (r+1)·T//R − 1``.  The ranks check that they agree on
    every argument (one small all-gather): a disagreement raises the same ``ValueError`` on all of them.
    """
    if cu_seqlens_global is None:
        if isinstance(total_len, bool) or not isinstance(total_len, int) or total_len < 1:
            raise ValueError(f"total_len must be a positive int when cu_seqlens_global is None, got {total_len!r}")
        cu_seqlens_global = torch.tensor([0, total_len], dtype=torch.int64)
    elif total_len is not None:
        raise ValueError("pass cu_seqlens_global or total_len, not both")
    if not isinstance(cu_seqlens_global, torch.Tensor):
        raise TypeError(
            f"cu_seqlens_global must be a torch.Tensor of int32/int64, got {type(cu_seqlens_global).__name__}"
        )
    T = int(cu_seqlens_global[-1]) if cu_seqlens_global.numel() else 0
    cu_t = check_cu_seqlens(cu_seqlens_global, 1, T, cu_seqlens_global.device)
    cu = cu_t.tolist()
    if any(b <= a for a, b in zip(cu[:-1], cu[1:], strict=True)):
        raise ValueError(
            "cu_seqlens_global has an empty sequence (two equal offsets); context parallelism "
            "needs every sequence to hold at least one token"
        )
    if conv1d_kernel_size is not None and (
        isinstance(conv1d_kernel_size, bool) or not isinstance(conv1d_kernel_size, int) or conv1d_kernel_size < 1
    ):
        raise ValueError(f"conv1d_kernel_size must be a positive int or None, got {conv1d_kernel_size!r}")
    rank, R = _group_rank(group)
    _check_agreement(cu, conv1d_kernel_size, group, R)
    if T < R:
        raise ValueError(f"the global sequence has T={T} tokens, fewer than the {R} ranks of group")
    bounds = [r * T // R for r in range(R + 1)]
    cu_set = set(cu)
    continues = [bounds[r] not in cu_set for r in range(R)]
    passthrough = [continues[r] and not any(bounds[r] < c < bounds[r + 1] for c in cu) for r in range(R)]
    a, b = bounds[rank], bounds[rank + 1]
    inner = [c - a for c in cu if a < c < b]
    local_cu = [0, *inner, b - a]
    piece_seq = [_seq_of(cu, a + s) for s in local_cu[:-1]]
    final_seqs = [n for n in range(len(cu) - 1) if a < cu[n + 1] <= b]
    halo = 0 if conv1d_kernel_size is None else conv1d_kernel_size - 1
    if rank > 0 and halo > bounds[rank] - bounds[rank - 1]:
        raise ValueError(
            f"the short convolution's halo ({halo} tokens) is longer than rank {rank - 1}'s slice "
            f"({bounds[rank] - bounds[rank - 1]} tokens): use fewer ranks or a longer sequence"
        )
    return CPContext(
        group=group,
        rank=rank,
        world_size=R,
        bounds=bounds,
        cu=cu,
        local_cu=local_cu,
        piece_seq=piece_seq,
        continues=continues,
        passthrough=passthrough,
        final_seqs=final_seqs,
        conv1d_kernel_size=conv1d_kernel_size,
    )


def _seq_of(cu: list[int], t: int) -> int:
    """The sequence that token ``t`` belongs to."""
    lo, hi = 0, len(cu) - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cu[mid] <= t:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _check_agreement(cu: list[int], conv1d_kernel_size: int | None, group, R: int) -> None:
    """Every rank raises the same error when the ranks disagree on ``cu_seqlens_global`` or the kernel size."""
    desc = torch.tensor(
        [len(cu), -1 if conv1d_kernel_size is None else conv1d_kernel_size, hash(tuple(cu)) & ((1 << 62) - 1)],
        dtype=torch.int64,
    )
    got = [torch.empty_like(desc) for _ in range(R)]
    dist.all_gather(got, desc, group=group)
    rows = [g.tolist() for g in got]
    if any(row[0] != rows[0][0] or row[2] != rows[0][2] for row in rows):
        lens = ", ".join(f"rank {r}: {row[0] - 1} sequences" for r, row in enumerate(rows))
        raise ValueError(
            f"build_cp_context: the ranks disagree on cu_seqlens_global ({lens}); every rank "
            "must pass the same global offsets"
        )
    if any(row[1] != rows[0][1] for row in rows):
        sizes = ", ".join(f"rank {r}: {None if row[1] < 0 else row[1]}" for r, row in enumerate(rows))
        raise ValueError(f"build_cp_context: the ranks disagree on conv1d_kernel_size ({sizes})")


class _AllGather(torch.autograd.Function):
    """All-gather of one flat tensor per rank into ``[R, S]``; the backward all-reduces the gradient and keeps
    this rank's row (the sum over ranks of the gradients of its contribution)."""

    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        out = [torch.empty_like(x) for _ in range(cp.world_size)]
        dist.all_gather(out, x.contiguous(), group=cp.group)
        nbytes = x.numel() * x.element_size()
        cp.comm_bytes["forward"] += nbytes
        cp.comm_bytes["forward_received"] += nbytes * cp.world_size
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad):
        cp = ctx.cp
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=cp.group)
        cp.comm_bytes["backward"] += grad.numel() * grad.element_size()
        return grad[cp.rank], None


def cp_all_gather(x: torch.Tensor, ctx: CPContext) -> torch.Tensor:
    """Differentiable all-gather of a flat tensor over ``ctx``'s group: ``[S] -> [R, S]``."""
    if not isinstance(ctx, CPContext):
        raise TypeError(f"ctx must be a CPContext (from build_cp_context), got {type(ctx).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() != 1:
        raise ValueError(f"x must be a 1-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    return _AllGather.apply(_in_graph(x), ctx)


def _in_graph(x: torch.Tensor) -> torch.Tensor:
    """``x``, made part of the autograd graph under grad mode even where nothing it depends on needs a gradient:
    the backward of a collective must run on every rank or on none, and another rank's inputs may need one."""
    if torch.is_grad_enabled() and not x.requires_grad:
        return x.detach().requires_grad_()
    return x


class _Halo(torch.autograd.Function):
    """The last ``h`` tokens of the previous rank's slice (zeros on rank 0); the backward sends their gradient back."""

    @staticmethod
    def forward(ctx, x, cp, h):
        ctx.cp, ctx.h, ctx.shape = cp, h, x.shape
        tail = x[:, x.shape[1] - h :].contiguous()
        got = [torch.empty_like(tail) for _ in range(cp.world_size)]
        dist.all_gather(got, tail, group=cp.group)
        cp.comm_bytes["forward"] += tail.numel() * tail.element_size()
        cp.comm_bytes["forward_received"] += tail.numel() * tail.element_size() * cp.world_size
        return got[cp.rank - 1] if cp.rank > 0 else torch.zeros_like(tail)

    @staticmethod
    def backward(ctx, grad):
        cp, h = ctx.cp, ctx.h
        grad = grad.contiguous()
        got = [torch.empty_like(grad) for _ in range(cp.world_size)]
        dist.all_gather(got, grad, group=cp.group)
        cp.comm_bytes["backward"] += grad.numel() * grad.element_size() * cp.world_size
        gx = grad.new_zeros(ctx.shape)
        if cp.rank + 1 < cp.world_size:
            gx[:, ctx.shape[1] - h :] = got[cp.rank + 1]
        return gx, None, None


def cp_conv_halo(x: torch.Tensor, ctx: CPContext) -> torch.Tensor:
    """``x [B, T_local, ...]`` with the short convolution's halo in front: ``[B, halo + T_local, ...]``.

    The halo is the last ``conv1d_kernel_size − 1`` tokens of the previous rank's slice, or zeros where
    this rank's slice starts a sequence (rank 0 included): a causal convolution of width ``W`` over the
    result, keeping its last ``T_local`` outputs, equals the one-process convolution of the slice.
    Within a slice, sequence boundaries are the caller's (as without CP).  Differentiable.
    """
    if not isinstance(ctx, CPContext):
        raise TypeError(f"ctx must be a CPContext (from build_cp_context), got {type(ctx).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[1] != ctx.local_len:
        raise ValueError(
            f"x must be [B, T_local={ctx.local_len}, ...] (this rank's slice), got "
            f"{getattr(x, 'shape', type(x).__name__)}"
        )
    h = ctx.conv_halo
    if h == 0:
        return x
    halo = _Halo.apply(_in_graph(x), ctx, h)
    # tokens of the halo before the start of the sequence that crosses this rank's start are not its
    # context: zeros there (all of them where a sequence starts here, rank 0 included); kept in the graph
    a = ctx.start
    seq_start = ctx.cu[_seq_of(ctx.cu, a)]
    pos = torch.arange(a - h, a, device=x.device)
    keep = (pos >= seq_start).to(x.dtype).view(1, h, *([1] * (x.dim() - 2)))
    return torch.cat([halo * keep, x], 1)


def _fold_P(P: torch.Tensor, G: int) -> torch.Tensor:
    return P if G == 1 else grp.fold_state_cov(P)


def _select(x, idx: list[int]):
    return None if x is None else x[idx]


def filter_chunk_cp(q, k, v, r2, ell2, *, ctx: CPContext, alpha=None, theta=None, p0=1.0, initial_state=None,
                    output_final_state: bool = False, return_variance: bool = False,
                    chunk_size: int = 64) -> FilterOutput:
    """The Bayesian Layer on this rank's slice of a context-parallel sequence (module docstring).

    q, k ``[1, T_local, H, D]``, v ``[1, T_local, H, m]``, r2 ``[1, T_local, H]`` or ``[.., H, G]``, ell2,
    alpha as :func:`bayeslayer.ops.bl_chunk`, for this rank's tokens only (``ctx.local_len``).
    ``initial_state``: ``(M [N, H, D, m], P [N, H, D, D] or [N, H, G, D, D])`` for all N global
    sequences, the same on every rank (each rank uses those of the sequences that start on it).
    Returns a :class:`FilterOutput` for the slice; its final state holds the sequences that end on this
    rank (``ctx.final_seqs``, in that order).  Outputs, variances and final states equal those of one
    process on the whole sequence up to rounding.
    """
    if not isinstance(ctx, CPContext):
        raise TypeError(f"cp_context must be a CPContext (from build_cp_context), got {type(ctx).__name__}")
    if theta is not None:
        raise ValueError("cp_context: rotations (theta) have no context-parallel path; use scalar or diagonal alpha")
    C = check_chunk_size(chunk_size)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be [1, T_local, H, D], got {getattr(q, 'shape', type(q).__name__)}")
    if q.shape[0] != 1 or q.shape[1] != ctx.local_len:
        raise ValueError(
            f"q must hold this rank's slice, [1, {ctx.local_len}, H, D] (rank {ctx.rank} of "
            f"{ctx.world_size}, tokens {ctx.bounds[ctx.rank]}..{ctx.bounds[ctx.rank + 1] - 1} of "
            f"T={ctx.bounds[-1]}), got {tuple(q.shape)}: was the context built for this group and "
            "batch?"
        )
    n_seq = len(ctx.cu) - 1
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise TypeError(f"initial_state must be a tuple (M, P), got {type(initial_state).__name__}")
        M0g, P0g = initial_state
        if (
            not isinstance(M0g, torch.Tensor)
            or not isinstance(P0g, torch.Tensor)
            or M0g.shape[0] != n_seq
            or P0g.shape[0] != n_seq
        ):
            raise ValueError(
                f"initial_state holds one (M, P) per global sequence (N={n_seq}) along dim 0, on every rank"
            )
    # validation and folding of the whole slice (shapes, positivity, groups) once, as the one-process call does
    pr = prepare(q, k, v, write="bayes", r2=r2, ell2=ell2, alpha=alpha, p0=p0)
    G, cd = pr.G, pr.dims.cdtype
    Hf, D, mg = pr.k.shape[2], pr.k.shape[3], pr.v.shape[3]
    H = Hf // G
    r, R = ctx.rank, ctx.world_size
    lens = [b - a for a, b in zip(ctx.local_cu[:-1], ctx.local_cu[1:], strict=True)]
    n_pieces = len(lens)
    cont, passthrough = ctx.continues[r], ctx.passthrough[r]
    dev = q.device
    kw = dict(chunk_size=C, return_variance=return_variance)
    inputs = dict(q=q, k=k, v=v, r2=r2, ell2=ell2, alpha=alpha)

    def piece_inputs(lo: int, hi: int) -> dict:
        a, b = ctx.local_cu[lo], ctx.local_cu[hi]
        return {name: (x[:, a:b] if isinstance(x, torch.Tensor) and x.dim() >= 3 else x) for name, x in inputs.items()}

    def run(lo: int, hi: int, state) -> FilterOutput:
        """Pieces ``lo .. hi − 1`` from ``state`` (per piece) or the global initial states."""
        x = piece_inputs(lo, hi)
        cu = torch.tensor([c - ctx.local_cu[lo] for c in ctx.local_cu[lo : hi + 1]], dtype=torch.int64, device=dev)
        return filter_chunk(
            x["q"],
            x["k"],
            x["v"],
            write="bayes",
            r2=x["r2"],
            ell2=x["ell2"],
            alpha=x["alpha"],
            p0=p0,
            initial_state=state,
            output_final_state=True,
            cu_seqlens=cu,
            **kw,
        )

    def own_states(lo: int, hi: int):
        if initial_state is None:
            return None
        idx = ctx.piece_seq[lo:hi]
        return (_select(M0g, idx), _select(P0g, idx))

    # -- round 1: covariance elements ---------------------------------------------------------------------------
    err = None
    rest = None
    zero = torch.zeros(Hf, D, D, dtype=ELEMENT_DTYPE, device=dev)
    try:
        if passthrough:
            A_el, C_el, J_el = _element(pr, C)
        else:
            lo = 1 if cont else 0
            rest = run(lo, n_pieces, own_states(lo, n_pieces))
            A_el, J_el = zero, zero
            C_el = _fold_P(rest.state[1][-1:], G)[0].to(ELEMENT_DTYPE)
    except (ValueError, torch.linalg.LinAlgError) as e:  # tell the other ranks instead of leaving them waiting
        err, A_el, C_el, J_el = e, zero, zero, zero
    flag = torch.tensor([0.0 if err is None else 1.0], dtype=ELEMENT_DTYPE, device=dev)
    cov = cp_all_gather(torch.cat([A_el.reshape(-1), C_el.reshape(-1), J_el.reshape(-1), flag]), ctx)
    _raise_if_flagged(cov[:, -1], err, ctx, "the covariance pass")
    elems = cov[:, :-1].reshape(R, 3, Hf, D, D)
    tie = cov.sum() * 0.0  # keeps both all-gathers in every rank's graph, in this order (module docstring)
    P_start = None
    if cont:
        P_start = _chain_cov(elems, ctx) + tie
    # -- round 2: mean transitions ------------------------------------------------------------------------------
    err = None
    zero_T = torch.zeros(Hf, D, D, dtype=ELEMENT_DTYPE, device=dev)
    zero_c = torch.zeros(Hf, D, mg, dtype=ELEMENT_DTYPE, device=dev)
    aug = None
    try:
        if passthrough:
            aug = _augmented_run(pr, inputs, P_start, initial_state, H, G, D, mg, cd, p0, kw)
            T_el, c_el = aug["T"][0].to(ELEMENT_DTYPE), aug["c"][0].to(ELEMENT_DTYPE)
        else:
            T_el = zero_T
            c_el = grp.fold_state_mean(rest.state[0][-1:], G)[0].to(ELEMENT_DTYPE)
    except (ValueError, torch.linalg.LinAlgError) as e:
        err, T_el, c_el = e, zero_T, zero_c
    flag = torch.tensor([0.0 if err is None else 1.0], dtype=ELEMENT_DTYPE, device=dev)
    mean = cp_all_gather(torch.cat([T_el.reshape(-1), c_el.reshape(-1), flag]) + tie, ctx)
    _raise_if_flagged(mean[:, -1], err, ctx, "the mean pass")
    tie = mean.sum() * 0.0
    Ts = mean[:, : Hf * D * D].reshape(R, Hf, D, D)
    cs = mean[:, Hf * D * D : -1].reshape(R, Hf, D, mg)
    M_start = _chain_mean(Ts, cs, ctx) if cont else None
    # -- phase C: this rank's slice from the rebuilt state --------------------------------------------------------
    if passthrough:
        out = _finish_augmented(aug, M_start, H, G, D, mg, cd)
        o, var, gain = out["o"], out["var"], out["gain"]
        finals = [(out["M"], out["P"])] if ctx.final_seqs else []
    else:
        parts, finals = [], []
        if cont:
            M1 = grp.unfold_state_mean(M_start[None].to(cd), G)
            P1 = grp.unfold_state_cov(P_start[None].to(_p_dtype(cd, initial_state)), G)
            first = run(0, 1, (M1, P1))
            parts.append(first)
            finals.append(first.state)
        parts.append(rest)
        n_rest = n_pieces - (1 if cont else 0)
        ends_here = len(ctx.final_seqs) - (1 if cont else 0)
        for i in range(min(ends_here, n_rest)):
            finals.append((rest.state[0][i : i + 1], rest.state[1][i : i + 1]))
        o = torch.cat([p.o for p in parts], 1)
        var = torch.cat([p.variance for p in parts], 1) if return_variance else None
        gain = torch.cat([p.gain for p in parts], 1)
    o = o + tie.to(o.dtype)
    state = None
    if output_final_state:
        if finals:
            state = (
                torch.cat([f[0] for f in finals], 0) + tie.to(finals[0][0].dtype),
                torch.cat([f[1].to(finals[0][1].dtype) for f in finals], 0),
            )
        else:
            Pshape = (0, H, D, D) if G == 1 else (0, H, G, D, D)
            state = (q.new_zeros(0, H, D, mg * G, dtype=cd), q.new_zeros(*Pshape, dtype=cd))
    return FilterOutput(o, var, gain, state)


def _p_dtype(cd: torch.dtype, initial_state) -> torch.dtype:
    """The dtype the one-process call would start the covariance in (float64 when the given P is)."""
    if initial_state is not None and initial_state[1].dtype == torch.float64:
        return torch.float64
    return cd


def _raise_if_flagged(flags: torch.Tensor, err, ctx: CPContext, what: str) -> None:
    bad = [j for j, f in enumerate(flags.tolist()) if f != 0.0]
    if not bad:
        return
    if err is not None:
        raise err
    raise ValueError(
        f"bl_chunk (context parallel): {what} failed on rank(s) {bad} (see the error there); "
        f"rank {ctx.rank} stops with them"
    )


def _element(pr, C: int):
    """Phase A over this rank's whole slice (one segment, from P = 0, in float64): ``(A, C, J)`` ``[H', D, D]``."""
    T = pr.k.shape[1]
    C = min(C, max(T, 1))  # a chunk longer than the slice would only pad it
    n_chunks = -(-T // C)
    lay = scan_layout([0, T], C, n_chunks, pr.k.device)
    la = pr.dyn.log_alpha if pr.dyn.log_alpha is not None else pr.k.new_zeros(*pr.k.shape[:3], 1)
    packed = dict(k=pr.k[0], r2=pr.r2[0], ell2=pr.ell2[0], la=la[0])
    fills = dict(k=0.0, r2=1.0, ell2=0.0, la=0.0)
    xs = {name: lay.grid(x.to(ELEMENT_DTYPE), fills[name]) for name, x in packed.items()}
    A, Cm, J, info = phase_a(lay, xs, torch.zeros(1, dtype=torch.int64, device=pr.k.device))
    if bool(info.any()):
        raise torch.linalg.LinAlgError(
            "bl_chunk (context parallel): a chunk's prior observation covariance is "
            "not positive definite in this rank's covariance element"
        )
    return A[0], Cm[0], J[0]


def _chain_cov(elems: torch.Tensor, ctx: CPContext) -> torch.Tensor:
    """P at this rank's start ``[H', D, D]`` (float64): the last non-pass-through rank's end state, then the
    elements of the pass-through ranks after it (docs/theory.md §6.3, Phase B)."""
    j0 = max(j for j in range(ctx.rank) if not ctx.passthrough[j])
    P = elems[j0, 1]
    for j in range(j0 + 1, ctx.rank):
        P, info = apply_element(elems[j, 0], elems[j, 1], elems[j, 2], P)
        if bool(info.any()):
            raise torch.linalg.LinAlgError(
                f"bl_chunk (context parallel): chaining rank {j}'s covariance element "
                "met a covariance that is not positive definite"
            )
    return P


def _chain_mean(Ts: torch.Tensor, cs: torch.Tensor, ctx: CPContext) -> torch.Tensor:
    """M at this rank's start ``[H', D, m/G]`` (float64): ``M ← T_j M + c_j`` over the pass-through ranks."""
    j0 = max(j for j in range(ctx.rank) if not ctx.passthrough[j])
    M = cs[j0]
    for j in range(j0 + 1, ctx.rank):
        M = Ts[j] @ M + cs[j]
    return M


def _augmented_run(pr, inputs: dict, P_start, initial_state, H: int, G: int, D: int, mg: int, cd, p0, kw) -> dict:
    """A pass-through rank's slice from ``(M = 0, P_start)`` with the values ``[v | 0]`` and the start mean ``[0 | I]``
    per group: the mean's affine map ``M_end = T M_start + c`` and the outputs' ``o_t = o⁰_t + M_startᵀ õ_t``."""
    v = inputs["v"]
    Tl = v.shape[1]
    v_aug = torch.cat([v.reshape(1, Tl, H, G, mg), v.new_zeros(1, Tl, H, G, D)], -1).reshape(1, Tl, H, G * (mg + D))
    eye = torch.eye(D, dtype=cd, device=v.device).expand(H * G, D, D)
    M0f = torch.cat([eye.new_zeros(H * G, D, mg), eye], -1)[None]  # folded [1, H', D, mg + D]
    M0 = grp.unfold_state_mean(M0f, G)
    P0 = grp.unfold_state_cov(P_start[None].to(_p_dtype(cd, initial_state)), G)
    out = filter_chunk(
        inputs["q"],
        inputs["k"],
        v_aug,
        write="bayes",
        r2=inputs["r2"],
        ell2=inputs["ell2"],
        alpha=inputs["alpha"],
        p0=p0,
        initial_state=(M0, P0),
        output_final_state=True,
        **kw,
    )
    o = out.o.reshape(1, Tl, H, G, mg + D)
    Mf = grp.fold_state_mean(out.state[0], G)  # [1, H', D, mg + D]
    return dict(
        o0=o[..., :mg], oI=o[..., mg:], c=Mf[..., :mg], T=Mf[..., mg:], var=out.variance, gain=out.gain, P=out.state[1]
    )


def _finish_augmented(aug: dict, M_start: torch.Tensor, H: int, G: int, D: int, mg: int, cd) -> dict:
    Ms = M_start.to(cd).reshape(H, G, D, mg)
    o0 = aug["o0"]
    o = o0 + torch.einsum("bthgd,hgdm->bthgm", aug["oI"], Ms)
    M_end = aug["T"][0] @ M_start.to(cd) + aug["c"][0]  # [H', D, mg]
    return dict(
        o=o.reshape(*o0.shape[:3], G * mg),
        var=aug["var"],
        gain=aug["gain"],
        M=grp.unfold_state_mean(M_end[None], G),
        P=aug["P"],
    )


def comm_bytes_per_call(H: int, D: int, m: int, G: int, world_size: int) -> dict:
    """The bytes one rank hands to the two all-gathers of one forward (formula of the module docstring).

    ``forward``: its own payload; ``forward_received``: what each all-gather returns to it (``R×``);
    ``backward``: the all-reduced gradients of the gathered tensors (``R×`` the payload).
    """
    Hf = H * G
    s1 = 3 * Hf * D * D + 1
    s2 = Hf * D * D + Hf * D * (m // G) + 1
    nbytes = (s1 + s2) * torch.finfo(ELEMENT_DTYPE).bits // 8
    return {"forward": nbytes, "forward_received": nbytes * world_size, "backward": nbytes * world_size}
