"""A Mamba-2 mixer whose SSD core is the latent-input design ``MAMBA2`` (docs/theory.md §3)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checks import check_int
from ..design import MAMBA2
from ..ops.flops import FlopCount, Tally, chunk_flops
from .base import RecurrentMixer
from .common import (
    MIN_LOG_DECAY,
    GatedRMSNorm,
    ShortConvolution,
    apply_mask,
    gate_dtype,
    init_decay_,
    positive,
)


class Mamba2(RecurrentMixer):
    """Mamba-2 (Dao & Gu 2024), a compact version of ``fla.layers.Mamba2`` with the same parameter names.

    ``I = H·P`` inner channels (``H`` heads of ``P = head_dim`` channels), ``N = state_size``,
    ``n = n_groups`` (B and C shared by ``H/n`` heads)::

        z, xBC, dt = in_proj(x_t)                            [I], [I + 2nN], [H]
        x, B, C    = SiLU(conv1d(xBC))                       [H, P], [H, N], [H, N]
        Δ_t        = softplus(dt + dt_bias) ;  a_t = exp(−exp(A_log)·Δ_t)
        h_t        = a_t h_{t-1} + Δ_t B_t x_tᵀ ;  o_t = h_tᵀ C_t      [N × P] per head
        y_t        = out_proj(norm(o_t + D·x_t, gate z))     (RMSNorm of (·)·SiLU(z), per group)

    The SSD recurrence is the :data:`bayeslayer.design.MAMBA2` latent-input filter with key ``B_t``,
    value ``x_t``, query ``C_t``, write coefficient ``gain = Δ_t`` and ``alpha = a_t``.

    Parameter count (``d`` hidden, ``W`` conv size, conv bias on, no projection bias):
    ``d·(2I + 2nN + H) + (W + 1)·(I + 2nN) + 3H + I + I·d`` — in_proj, conv1d, dt_bias/A_log/D,
    norm, out_proj.  Recurrent state per head: ``N·P`` floats.
    """

    design = MAMBA2

    def __init__(self, hidden_size: int, num_heads: int = 4, head_dim: int = 128, *, state_size: int = 128,
                 n_groups: int = 1, conv_size: int = 4, conv_bias: bool = True, norm_eps: float = 1e-5,
                 A_init_range: tuple[float, float] = (1.0, 16.0), chunk_size: int = 64,
                 layer_idx: int | None = None) -> None:
        super().__init__()
        self.hidden_size = check_int("hidden_size", hidden_size, minimum=1)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        self.state_size = check_int("state_size", state_size, minimum=1)
        self.n_groups = check_int("n_groups", n_groups, minimum=1)
        if self.num_heads % self.n_groups != 0:
            raise ValueError(f"num_heads={num_heads} must be divisible by n_groups={n_groups}")
        if not (len(A_init_range) == 2 and 0 < A_init_range[0] <= A_init_range[1]):
            raise ValueError(f"A_init_range must be (low, high) with 0 < low <= high, got {A_init_range!r}")
        self.conv_size = check_int("conv_size", conv_size, minimum=1)
        self.conv_bias = bool(conv_bias)
        self.chunk_size = check_int("chunk_size", chunk_size, minimum=1)
        self.layer_idx = layer_idx
        self.intermediate_size = self.num_heads * self.head_dim
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * self.state_size

        d, H, inner = self.hidden_size, self.num_heads, self.intermediate_size
        self.in_proj = nn.Linear(d, inner + self.conv_dim + H, bias=False)
        self.conv1d = ShortConvolution(self.conv_dim, self.conv_size, bias=self.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.A_log = nn.Parameter(torch.empty(H))
        init_decay_(self.A_log, self.dt_bias, A_range=A_init_range)
        self.D = nn.Parameter(torch.ones(H))
        self.D._no_weight_decay = True
        self.norm = GatedRMSNorm(inner, eps=norm_eps, norm_before_gate=False,
                                 group_size=inner // self.n_groups)
        self.out_proj = nn.Linear(inner, d, bias=False)

    def features(self, x, mask, conv_state, cu_seqlens=None):
        inner, H, N, n = self.intermediate_size, self.num_heads, self.state_size, self.n_groups
        z, xBC, dt = self.in_proj(x).split([inner, self.conv_dim, H], dim=-1)
        if conv_state is not None and not isinstance(conv_state, dict):
            raise TypeError(f"state['conv'] must be a dict of conv caches, got {type(conv_state).__name__}")
        xBC, cache = self.conv1d(apply_mask(xBC, mask), None if conv_state is None else conv_state.get("xBC"),
                                 output_final_state=True, cu_seqlens=cu_seqlens)
        xs, Bk, Cq = xBC.split([inner, n * N, n * N], dim=-1)
        xs = xs.unflatten(-1, (H, self.head_dim))
        Bk = Bk.unflatten(-1, (n, N)).repeat_interleave(H // n, dim=-2)
        Cq = Cq.unflatten(-1, (n, N)).repeat_interleave(H // n, dim=-2)
        cd = gate_dtype(x)
        delta = positive(F.softplus(dt.to(cd) + self.dt_bias.to(cd)))  # step size Δ_t
        log_a = (-torch.exp(self.A_log.to(cd)) * delta).clamp_min(MIN_LOG_DECAY)
        write = {"gain": delta, "alpha": torch.exp(log_a)}
        return Cq, Bk, xs, write, {"xBC": cache}, (xs, z)

    def readout(self, o, x, extra):
        xs, z = extra
        y = o + self.D.to(o.dtype)[:, None] * xs
        return self.out_proj(self.norm(y.flatten(-2), z))

    def initial_state(self, batch_size: int, dtype: torch.dtype, device) -> tuple:
        return self.design.initial_state(batch_size, self.num_heads, self.state_size, self.head_dim,
                                         dtype=dtype, device=device)

    def state_size_per_head(self) -> int:
        return self.design.state_size(self.state_size, self.head_dim)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, state_size={self.state_size}, "
                f"n_groups={self.n_groups}, chunk_size={self.chunk_size}")

    def filter_flops(self, batch_size: int, seq_len: int) -> FlopCount:
        """The SSD core: the latent write, scalar decay, keys ``B_t`` of size ``N``, values ``x_t`` of size ``P``."""
        return chunk_flops("latent", "scalar", batch_size=batch_size, seq_len=seq_len, num_heads=self.num_heads,
                           key_dim=self.state_size, value_dim=self.head_dim, chunk_size=self.chunk_size)

    def flops(self, batch_size: int, seq_len: int) -> FlopCount:
        """in_proj, the short convolution over ``x, B, C``, the SSD core and out_proj (see ``Mixer.flops``)."""
        B = check_int("batch_size", batch_size, minimum=1)
        T = check_int("seq_len", seq_len, minimum=1)
        d, inner, tokens = self.hidden_size, self.intermediate_size, B * T
        t = Tally()
        t.linear(tokens, d, inner + self.conv_dim + self.num_heads)
        t.conv(B, self.conv_dim, T, self.conv_size)
        t.linear(tokens, inner, d)
        return t.count() + self.filter_flops(B, T)

    def num_parameters_formula(self) -> int:
        d, H, inner, W = self.hidden_size, self.num_heads, self.intermediate_size, self.conv_size
        return (d * (inner + self.conv_dim + H) + W * self.conv_dim + (self.conv_dim if self.conv_bias else 0)
                + 3 * H + inner + inner * d)
