"""Pieces every token mixer shares: short causal convolution with its cache, gated RMSNorm, gates.

The parameter layouts follow flash-linear-attention so that its checkpoints load 1:1:
:class:`ShortConvolution` is a depthwise ``nn.Conv1d`` (``weight [C, 1, W]``, optional ``bias [C]``),
:class:`GatedRMSNorm` holds one ``weight [d]``.  Everything here is plain PyTorch.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checks import check_int

# GDN/Mamba-2 initialisation of the step size Δ = softplus(a + dt_bias): log-uniform in [1e-3, 0.1].
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 0.1, 1e-4
# Decays below exp(-60) ≈ 1e-26 are zero for every practical purpose; the clamp keeps α > 0 (the ops
# reject α = 0, which exp() of a very negative log-decay would give in fp32).
MIN_LOG_DECAY = -60.0


# -- argument checks used by every mixer's constructor (integers: bayeslayer.checks.check_int) -----
_FLOAT32_MAX = torch.finfo(torch.float32).max


def check_positive_float(name: str, value, *, allow_zero: bool = False) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    val = float(value)
    if not math.isfinite(val) or not (val >= 0 if allow_zero else val > 0):
        raise ValueError(f"{name} must be finite and {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    if val > _FLOAT32_MAX:  # the layers keep these in float32 buffers and parameters
        raise ValueError(f"{name} must be at most {_FLOAT32_MAX:.4g} (the largest float32), got {value!r}")
    return val


def value_head_dim(head_dim: int, expand_v) -> int:
    """``head_dim · expand_v`` as an integer, or a ValueError (``nn.Linear`` needs whole sizes)."""
    expand_v = check_positive_float("expand_v", expand_v)
    m = head_dim * expand_v
    if not math.isclose(m, round(m), rel_tol=0, abs_tol=1e-6) or round(m) < 1:
        raise ValueError(
            f"expand_v={expand_v} gives a non-integer value head dim "
            f"head_dim·expand_v = {head_dim}·{expand_v} = {m}"
        )
    return int(round(m))


# -- small functions -------------------------------------------------------------------------------
def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """``x`` with ``softplus(x) = y`` (y > 0), stable for small y."""
    return y + torch.log(-torch.expm1(-y))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(‖x‖² + eps)`` over the last dim (flash-linear-attention's convention, eps = 1e-6)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gate_dtype(x: torch.Tensor) -> torch.dtype:
    """Gates and noise maps are computed in fp32 (fp64 for fp64 inputs), like the filter arithmetic."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def positive(x: torch.Tensor) -> torch.Tensor:
    """Clamp a gate that is positive in exact arithmetic (sigmoid, softplus) away from underflow to 0."""
    return x.clamp_min(torch.finfo(x.dtype).tiny)


def decay_log(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """GDN/Mamba-2 log-decay ``g = −exp(A_log)·softplus(a + dt_bias)`` (so ``α = exp(g) ∈ (0, 1]``).

    ``a``: ``[B, T, H·Da]`` from ``a_proj``; ``A_log``: ``[H]``; ``dt_bias``: ``[H·Da]``.  Returns
    ``[B, T, H, Da]`` in fp32 (fp64 for fp64 inputs), clamped at :data:`MIN_LOG_DECAY`.
    """
    H = A_log.shape[0]
    dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
    dt = F.softplus(a.to(dtype) + dt_bias.to(dtype))
    dt = dt.unflatten(-1, (H, -1))
    return (-torch.exp(A_log.to(dtype))[:, None] * dt).clamp_min(MIN_LOG_DECAY)


def init_decay_(A_log: torch.Tensor, dt_bias: torch.Tensor,
                A_range: tuple[float, float] = (0.0, 16.0)) -> None:
    """GDN's initialisation: ``A ~ U(A_range)``, ``Δ = softplus(dt_bias)`` log-uniform in [1e-3, 0.1]."""
    with torch.no_grad():
        A = torch.empty_like(A_log, dtype=torch.float32).uniform_(*A_range).clamp_min(1e-4)
        A_log.copy_(torch.log(A))
        dt = torch.exp(torch.rand_like(dt_bias, dtype=torch.float32) * (math.log(DT_MAX) - math.log(DT_MIN))
                       + math.log(DT_MIN)).clamp_min(DT_FLOOR)
        dt_bias.copy_(inverse_softplus(dt))
    A_log._no_weight_decay = True
    dt_bias._no_weight_decay = True


def apply_mask(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Zero the padded tokens of ``x [B, T, ...]`` (``mask [B, T]`` bool, True = real token)."""
    if mask is None:
        return x
    return x * mask.reshape(mask.shape + (1,) * (x.dim() - 2)).to(x.dtype)


# -- modules ---------------------------------------------------------------------------------------
class ShortConvolution(nn.Conv1d):
    """Depthwise causal convolution of width ``W`` over time, then SiLU (or nothing).

    ``y_t[c] = act(Σ_{j<W} weight[c, 0, j] · x_{t−W+1+j}[c] + bias[c])``, with zeros before the
    first token.  Parameters: ``weight [C, 1, W]`` (+ ``bias [C]``), the layout of
    flash-linear-attention's ``ShortConvolution``.

    The cache is the last ``W − 1`` inputs, ``[B, C, W − 1]``; feeding a sequence in pieces with the
    returned cache gives the same outputs as one call.  With ``cu_seqlens`` (``[N + 1]`` offsets, B = 1)
    the window restarts at every sequence start, so no sequence sees another's inputs; the cache then
    holds one row per sequence, ``[N, C, W − 1]``, in and out.
    """

    def __init__(self, hidden_size: int, kernel_size: int = 4, bias: bool = False,
                 activation: str | None = "silu") -> None:
        hidden_size = check_int("hidden_size", hidden_size, minimum=1)
        kernel_size = check_int("conv_size", kernel_size, minimum=1)
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"activation must be 'silu', 'swish' or None, got {activation!r}")
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, padding=0, bias=bias)
        self.hidden_size = hidden_size
        self.activation = activation

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None,
                output_final_state: bool = False,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x [B, T, C]`` → ``(y [B, T, C], new cache [B, C, W−1] or None)``; with ``cu_seqlens``
        (int64 offsets ``[N + 1]``, already checked by the caller) ``B = 1`` and the caches are ``[N, C, W−1]``."""
        if cu_seqlens is not None:
            return self._forward_packed(x, cache, output_final_state, cu_seqlens)
        B, T, C = x.shape
        W = self.kernel_size[0]
        xt = x.transpose(1, 2)
        if cache is None:
            past = xt.new_zeros(B, C, W - 1)
        else:
            if tuple(cache.shape) != (B, C, W - 1):
                raise ValueError(
                    f"conv cache must be [B, C, W-1] = {(B, C, W - 1)}, got {tuple(cache.shape)}"
                )
            past = cache.to(xt.dtype)
        full = torch.cat((past, xt), dim=-1)  # [B, C, W-1+T]
        y = F.conv1d(full, self.weight, self.bias, groups=C).transpose(1, 2)
        if self.activation is not None:
            y = F.silu(y)
        new_cache = full[..., full.shape[-1] - (W - 1):] if output_final_state else None
        return y, new_cache

    def _forward_packed(self, x, cache, output_final_state, cu):
        """Each sequence ``n`` of the packed ``x [1, T, C]`` sees ``cache[n]`` (or zeros) before its first token.

        Token ``t`` of sequence ``n`` (``cu[n] ≤ t < cu[n+1]``) reads tap ``j`` at ``s = t − W + 1 + j``:
        ``x[s]`` when ``s ≥ cu[n]``, else column ``W − 1 + s − cu[n]`` of sequence ``n``'s cache.  All
        gathers: no offset is read on the host, so this also runs inside ``torch.compile``.
        """
        _, T, C = x.shape
        W = self.kernel_size[0]
        N = cu.shape[0] - 1
        if cache is not None and tuple(cache.shape) != (N, C, W - 1):
            raise ValueError(f"with cu_seqlens the conv cache holds one row per sequence, [N, C, W-1] = "
                             f"{(N, C, W - 1)}, got {tuple(cache.shape)}")
        dev = x.device
        t = torch.arange(T, device=dev)
        seq = torch.searchsorted(cu[1:], t, right=True).clamp_max(N - 1)  # the sequence of each token
        start = cu[seq]
        taps = torch.arange(W, device=dev) - (W - 1)  # s − t per tap
        src = t[:, None] + taps  # [T, W]
        own = src >= start[:, None]
        xs = x[0].index_select(0, src.clamp_min(0).flatten()).view(T, W, C)
        past = self._past(cache, seq[:, None].expand(T, W), src - start[:, None], x)  # [T, W, C] or None
        xs = torch.where(own[..., None], xs, xs.new_zeros(()) if past is None else past)
        y = torch.einsum("twc,cw->tc", xs, self.weight[:, 0, :].to(xs.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        if self.activation is not None:
            y = F.silu(y)
        if not output_final_state:
            return y[None], None
        # sequence n's cache: its last W − 1 inputs, reaching back into its own cache (or zeros)
        ends = cu[1:, None] + torch.arange(W - 1, device=dev) - (W - 1)  # [N, W-1] positions
        own = ends >= cu[:-1, None]
        last = x[0].index_select(0, ends.clamp(0, max(T - 1, 0)).flatten()).view(N, W - 1, C)
        past = self._past(cache, torch.arange(N, device=dev)[:, None].expand(N, W - 1), ends - cu[:-1, None], x)
        new = torch.where(own[..., None], last, last.new_zeros(()) if past is None else past)
        return y[None], new.transpose(1, 2)

    @staticmethod
    def _past(cache, rows, offset, x):
        """``cache[rows, :, W − 1 + offset]`` as ``[..., C]`` (offset < 0 reaches back into the cache), or None."""
        W1 = 0 if cache is None else cache.shape[-1]
        if W1 == 0:  # no cache, or width 1: nothing before a sequence's first token but zeros
            return None
        cols = (offset + W1).clamp(0, W1 - 1)
        return cache.to(x.dtype).transpose(1, 2)[rows, cols]
class GatedRMSNorm(nn.Module):
    """RMSNorm with an optional SiLU output gate (flash-linear-attention's ``FusedRMSNormGated``).

    ``norm_before_gate=True`` (GDN): ``y = x / rms(x) · weight · silu(g)``;
    ``norm_before_gate=False`` (Mamba-2): ``y = x·silu(g) / rms(x·silu(g)) · weight``;
    ``rms`` over groups of ``group_size`` channels (default: the whole last dim), in fp32.
    Without a gate it is a plain RMSNorm.  Parameter: ``weight [hidden_size]``, flagged
    ``_no_weight_decay`` like every normalisation gain.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, norm_before_gate: bool = True,
                 group_size: int | None = None) -> None:
        super().__init__()
        self.hidden_size = check_int("hidden_size", hidden_size, minimum=1)
        self.eps = check_positive_float("norm_eps", eps)
        self.group_size = hidden_size if group_size is None else check_int("group_size", group_size, minimum=1)
        if hidden_size % self.group_size != 0:
            raise ValueError(f"group_size={group_size} must divide hidden_size={hidden_size}")
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.weight._no_weight_decay = True  # a gain whose neutral value is 1: decay would pull it to 0

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        dtype = x.dtype
        up = torch.float64 if dtype == torch.float64 else torch.float32
        x = x.to(up)
        if gate is not None and not self.norm_before_gate:
            x = x * F.silu(gate.to(up))
        xg = x.unflatten(-1, (-1, self.group_size))
        x = (xg * torch.rsqrt(xg.square().mean(-1, keepdim=True) + self.eps)).flatten(-2)
        y = x * self.weight.to(up)
        if gate is not None and self.norm_before_gate:
            y = y * F.silu(gate.to(up))
        return y.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, norm_before_gate={self.norm_before_gate}"
