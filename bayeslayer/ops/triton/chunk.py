"""``bl_chunk_triton``: the chunked Bayesian Layer on Triton kernels (SPEC §3.3).

Forward: one fused Triton kernel (:mod:`.kernels`), one program per (sequence,
head·group), chunk-sequential inside the program.  Backward: **recompute**, not
fused — :class:`_BLChunkTriton` re-runs the forward through the PyTorch chunk path
(:func:`bayeslayer.ops.chunk.filter_chunk`) under autograd and differentiates
that.  The gradients are therefore exactly the PyTorch path's; the cost of a
backward is one PyTorch chunked forward plus its autograd backward.
Rotations (``theta``) run entirely on the PyTorch path.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from .. import groups as grp
from ..checks import check_state
from ..chunk import filter_chunk
from ..prepare import prepare

SUPPORTED_CHUNK_SIZES = (16, 32, 64)


def triton_available() -> bool:
    """True when Triton imports and can run here: a CUDA device, or ``TRITON_INTERPRET=1`` (CPU)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_num_warps(chunk_size: int) -> int:
    """Warps per program: a 64×64 fp32 tile needs 8 warps to stay (mostly) in registers."""
    return 8 if chunk_size >= 64 else 4


def _next_pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def tile_sizes(D: int, m: int) -> tuple[int, int, int]:
    """``(BD, BK, BV)``: padded key dim, key-dim tile, value-dim tile of the chunk kernels.

    BK = 16, BV ≤ 32: with 64-wide tiles the sm_90 build of the covariance kernel
    spills heavily at C = 64 (``benchmarks/gpu.py --compile-only``); at 16/32 it
    fits in registers (covariance: no spill; mean: ≤ 56 bytes).
    """
    BD = max(16, _next_pow2(D))
    return BD, 16, min(max(16, _next_pow2(m)), 32)


def check_cu_seqlens(cu_seqlens, batch: int, total: int, device: torch.device) -> torch.Tensor | None:
    """``cu_seqlens``: 1-D integer tensor ``[N + 1]``, 0 first, ``T`` last, non-decreasing; needs B = 1."""
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor of int32/int64, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must have dtype int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be 1-D with at least 2 entries [0, ..., T], got shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {device}")
    if batch != 1:
        raise ValueError(
            f"with cu_seqlens the sequences are packed along T, so the batch size must be 1, got B={batch}"
        )
    cu = cu_seqlens.to(torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != total:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at T={total}, got {int(cu[0])} .. {int(cu[-1])}"
        )
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    return cu


def _check_chunk_size(chunk_size) -> int:
    if isinstance(chunk_size, bool) or chunk_size not in SUPPORTED_CHUNK_SIZES:
        raise ValueError(
            f"the Triton path supports chunk_size in {SUPPORTED_CHUNK_SIZES}, got {chunk_size!r}"
        )
    return int(chunk_size)


def _slice_time(x, bos: int, eos: int):
    return x[:, bos:eos] if isinstance(x, torch.Tensor) and x.dim() >= 3 else x


def _torch_reference(q, k, v, r2, ell2, alpha, theta, p0, M0, P0, cu, chunk_size, want_var):
    """The PyTorch chunk path on the same arguments (per packed sequence when ``cu`` is given).

    Returns ``(o, variance or None, M, P)``; this is what the backward differentiates.
    """
    state = None if M0 is None else (M0, P0)
    if cu is None:
        out = filter_chunk(q, k, v, write="bayes", r2=r2, ell2=ell2, alpha=alpha, theta=theta, p0=p0,
                           initial_state=state, output_final_state=True, return_variance=want_var,
                           chunk_size=chunk_size)
        return out.o, out.variance, out.state[0], out.state[1]
    os_, vs, Ms, Ps = [], [], [], []
    for n in range(cu.numel() - 1):
        bos, eos = int(cu[n]), int(cu[n + 1])
        st = None if M0 is None else (M0[n:n + 1], P0[n:n + 1])
        out = filter_chunk(
            _slice_time(q, bos, eos), _slice_time(k, bos, eos), _slice_time(v, bos, eos), write="bayes",
            r2=_slice_time(r2, bos, eos), ell2=_slice_time(ell2, bos, eos),
            alpha=_slice_time(alpha, bos, eos), theta=_slice_time(theta, bos, eos), p0=p0,
            initial_state=st, output_final_state=True,
            return_variance=want_var, chunk_size=chunk_size,
        )
        os_.append(out.o)
        vs.append(out.variance)
        Ms.append(out.state[0])
        Ps.append(out.state[1])
    var = torch.cat(vs, 1) if want_var else None
    return torch.cat(os_, 1), var, torch.cat(Ms, 0), torch.cat(Ps, 0)


def _forward_triton(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, want_var):
    """Validate, fold groups into heads, launch the covariance then the mean kernel, unfold -> (o, var, M, P)."""
    import triton

    from .kernels import bl_chunk_cov_kernel, bl_chunk_mean_kernel

    B, T = q.shape[:2]
    pr = prepare(q, k, v, write="bayes", r2=r2, ell2=ell2, alpha=alpha, p0=p0)
    dims, G = pr.dims, pr.G
    cd = dims.cdtype
    Hf = pr.q.shape[2]
    D, mg = dims.D, dims.m // G
    if cu is None:
        n_seq = B
        cu_k = torch.arange(0, B * T + 1, T if T > 0 else 1, device=dims.device, dtype=torch.int64)[: B + 1]
    else:
        n_seq = cu.numel() - 1
        cu_k = cu
    if M0 is not None:
        st = check_state((M0, P0), dataclasses.replace(dims, B=n_seq), G)
        M = grp.fold_state_mean(st[0], G).contiguous().clone()
        P = grp.fold_state_cov(st[1]).contiguous().clone()
    else:
        M = pr.M0.expand(n_seq, -1, -1, -1).contiguous()
        P = pr.P0[:1].expand(n_seq, -1, -1, -1).contiguous()
    kind = pr.dyn.kind
    diag = kind == "diagonal"
    has_alpha = kind != "identity"
    la = pr.dyn.log_alpha
    if la is None:
        la = pr.q.new_zeros(1)
    elif not diag:
        la = la[..., 0]
    NT = B * T
    qf = pr.q.reshape(NT, Hf, D).contiguous()
    kf = pr.k.reshape(NT, Hf, D).contiguous()
    vf = pr.v.reshape(NT, Hf, mg).contiguous()
    r2f = pr.r2.reshape(NT, Hf).contiguous()
    l2f = pr.ell2.reshape(NT, Hf).contiguous()
    laf = la.reshape(NT, Hf, -1).contiguous() if has_alpha else la
    C = chunk_size
    BD, BK, BV = tile_sizes(D, mg)
    o = torch.empty(NT, Hf, mg, dtype=dims.dtype, device=dims.device)
    var = torch.empty(NT, Hf, dtype=cd, device=dims.device) if want_var else o.new_empty(1, dtype=cd)
    w = torch.empty(NT, Hf, D, dtype=cd, device=dims.device)  # write keys β_t u_t
    Yscr = torch.empty(n_seq, Hf, C, BD, dtype=cd, device=dims.device)
    Uscr = torch.empty_like(Yscr)
    if NT > 0:
        shape = dict(H=Hf, D=D, C=C, BD=BD, BK=BK, DIAG=diag, HAS_ALPHA=has_alpha, PREC="ieee")
        bl_chunk_cov_kernel[(n_seq, Hf)](
            qf, kf, r2f, l2f, laf, cu_k, P, w, Yscr, Uscr, var,
            RETURN_VAR=want_var, num_warps=default_num_warps(C), **shape,
        )
        bl_chunk_mean_kernel[(triton.cdiv(mg, BV), n_seq, Hf)](
            qf, kf, vf, w, laf, cu_k, M, o, MV=mg, BV=BV, num_warps=default_num_warps(C), **shape,
        )
    o = grp.unfold_values(o.reshape(B, T, Hf, mg), G)
    var_out = grp.unfold_per_token(var.reshape(B, T, Hf), G) if want_var else None
    M_out = grp.unfold_state_mean(M, G)
    P_out = grp.unfold_state_cov(P, G)
    return o, var_out, M_out, P_out


class _BLChunkTriton(torch.autograd.Function):
    """Triton forward; backward by recomputing the PyTorch chunk path under autograd."""

    @staticmethod
    def forward(ctx, q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, want_var):
        o, var, M, P = _forward_triton(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, chunk_size, want_var)
        inputs = (q, k, v, r2, ell2, alpha, p0, M0, P0)
        ctx.save_for_backward(*[x if isinstance(x, torch.Tensor) else None for x in inputs])
        ctx.plain = [None if isinstance(x, torch.Tensor) else x for x in inputs]
        ctx.cu, ctx.chunk_size, ctx.want_var = cu, chunk_size, want_var
        if var is None:
            var = o.new_zeros(0)
            ctx.mark_non_differentiable(var)
        return o, var, M, P

    @staticmethod
    def backward(ctx, d_o, d_var, d_M, d_P):
        saved = ctx.saved_tensors
        args = [s if s is not None else p for s, p in zip(saved, ctx.plain, strict=True)]
        with torch.enable_grad():
            leaves = []
            for i, x in enumerate(args):
                if isinstance(x, torch.Tensor) and ctx.needs_input_grad[i]:
                    x = x.detach().requires_grad_(True)
                    args[i] = x
                    leaves.append((i, x))
            q, k, v, r2, ell2, alpha, p0, M0, P0 = args
            o, var, M, P = _torch_reference(
                q, k, v, r2, ell2, alpha, None, p0, M0, P0, ctx.cu, ctx.chunk_size, ctx.want_var
            )
            outs, grads = [], []
            for out, g in ((o, d_o), (var, d_var), (M, d_M), (P, d_P)):
                if out is not None and g is not None and out.requires_grad:
                    outs.append(out)
                    grads.append(g.to(out.dtype))
            result = [None] * 12
            if leaves and outs:
                gs = torch.autograd.grad(outs, [x for _, x in leaves], grads, allow_unused=True)
                for (i, _), gx in zip(leaves, gs, strict=True):
                    result[i] = gx
        return tuple(result)


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
):
    """The Bayesian Layer, chunked, on Triton: same contract and results as :func:`bayeslayer.ops.bl_chunk`.

    Shapes: q, k ``[B, T, H, D]`` (D = 16..256; padded to a power of two inside),
    v ``[B, T, H, m]``, r2 ``[B, T, H]`` or ``[B, T, H, G]``, ell2 ``[B, T, H]``,
    alpha None / ``[B, T, H]`` (scalar decay) / ``[B, T, H, D]`` (diagonal decay),
    theta (rotations) ``[B, T, H, D/2]`` — rotations run on the PyTorch chunk path.
    ``cu_seqlens`` ``[N + 1]`` (int32/int64, B = 1) packs N sequences along T, like
    flash-linear-attention; ``initial_state`` and the final state are then per
    sequence, ``M [N, H, D, m]``, ``P [N, H, D, D]`` (``[N, H, G, D, D]`` with groups).

    Output ``o_t = M_tᵀ q_t`` in the input dtype; filter arithmetic in fp32 (fp64
    for fp64 inputs).  Returns ``(o, state)`` or, with ``return_variance``,
    ``(o, variance [B, T, H, G], state)``; ``state`` is None unless
    ``output_final_state``.  ``chunk_size`` ∈ {16, 32, 64}.

    Gradients: the backward recomputes the forward through the PyTorch chunk path
    under autograd (see module docstring); it is not a fused Triton backward.
    """
    C = _check_chunk_size(chunk_size)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a [B, T, H, D] tensor, got {getattr(q, 'shape', type(q).__name__)}")
    if not 1 <= q.shape[-1] <= 256:
        raise ValueError(f"the Triton path supports key dims D in 1..256, got D={q.shape[-1]}")
    cu = check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[1], q.device)
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise TypeError(f"initial_state must be a tuple (M, P), got {type(initial_state).__name__}")
        M0, P0 = initial_state
    else:
        M0 = P0 = None
    if theta is not None or q.shape[1] == 0:
        o, var, M, P = _torch_reference(q, k, v, r2, ell2, alpha, theta, p0, M0, P0, cu, C, return_variance)
    else:
        o, var, M, P = _BLChunkTriton.apply(q, k, v, r2, ell2, alpha, p0, M0, P0, cu, C, return_variance)
    state = (M, P) if output_final_state else None
    if return_variance:
        return o, var, state
    return o, state
