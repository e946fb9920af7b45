"""The covariance-reset family as token mixers: Gated DeltaNet and DeltaNet (docs/theory.md §3).

Both run the reset design ``M_t = A_t M_{t-1} + β_t k_t (v_t − (A_t M_{t-1})ᵀ k_t)ᵀ`` of
:mod:`bayeslayer.design` with the gain given directly (``gain = β``); no recurrence is written here.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..checks import check_int
from ..design import DELTANET, GATED_DELTANET
from .base import QKVMixer
from .common import decay_log, gate_dtype, init_decay_, positive


class _DeltaRule(QKVMixer):
    """What DeltaNet and Gated DeltaNet share: ``l2``-normalised queries and keys, and the write strength
    ``β_t = sigmoid(b_proj(x_t))`` (× 2 with ``allow_neg_eigval``) as the reset design's gain."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, *, allow_neg_eigval: bool,
                 **kwargs) -> None:
        super().__init__(hidden_size, num_heads, head_dim, qk_norm="l2", **kwargs)
        # β ∈ (0, 2) lets the transition I − β k kᵀ have a negative eigenvalue (Grazzi et al. 2024)
        self.allow_neg_eigval = bool(allow_neg_eigval)

    def beta(self, x: torch.Tensor) -> torch.Tensor:
        """``β_t`` ``[B, T, H]`` of the inputs ``x`` ``[B, T, d]`` (``self.b_proj`` is the subclass's)."""
        beta = positive(torch.sigmoid(self.b_proj(x).to(gate_dtype(x))))
        return 2 * beta if self.allow_neg_eigval else beta


class GatedDeltaNet(_DeltaRule):
    """Gated DeltaNet (Yang et al. 2024), flash-linear-attention's ``fla.layers.GatedDeltaNet``.

    Same parameter names, shapes, defaults and math, so an fla GDN layer's ``state_dict`` loads with
    ``strict=True``::

        q, k, v = SiLU(conv(W_q x)), SiLU(conv(W_k x)), SiLU(conv(W_v x))     (SiLU alone without conv)
        q, k    = l2norm(q)·D^-1/2, l2norm(k)
        β_t     = sigmoid(b_proj(x_t))  (× 2 with allow_neg_eigval)          [B, T, H]
        g_t     = −exp(A_log)·softplus(a_proj(x_t) + dt_bias),  α_t = exp(g_t)  [B, T, H]
        o_t     = GATED_DELTANET filter (gain = β_t, alpha = α_t)             [B, T, H, m]
        y_t     = o_proj(o_norm(o_t, g_proj(x_t)))

    Parameter count (``d`` hidden, ``H`` heads, ``K = H·D``, ``V = H·m``, ``m = D·expand_v``,
    ``W`` conv size, convolutions without bias):
    ``d·(2K + 3V) + 2·d·H + 2H + m + [use_short_conv]·W·(2K + V)`` — without the gate
    (``use_gate=False``) one ``d·V`` less.  At ``K = 0.75 d``, ``V = 1.5 d`` this is ``≈ 6 d²``.

    Recurrent state per head: ``D·m`` floats.
    """

    design = GATED_DELTANET

    def __init__(self, hidden_size: int, num_heads: int = 4, head_dim: int = 128, *, expand_v: float = 2.0,
                 use_short_conv: bool = True, conv_size: int = 4, conv_bias: bool = False,
                 use_gate: bool = True, allow_neg_eigval: bool = False, norm_eps: float = 1e-5,
                 chunk_size: int = 64, layer_idx: int | None = None) -> None:
        super().__init__(hidden_size, num_heads, head_dim, expand_v=expand_v, use_short_conv=use_short_conv,
                         conv_size=conv_size, conv_bias=conv_bias, use_gate=use_gate, norm_eps=norm_eps,
                         chunk_size=chunk_size, layer_idx=layer_idx, allow_neg_eigval=allow_neg_eigval)
        d, H = self.hidden_size, self.num_heads
        self.a_proj = nn.Linear(d, H, bias=False)
        self.b_proj = nn.Linear(d, H, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H))
        init_decay_(self.A_log, self.dt_bias)

    def write_arguments(self, x: torch.Tensor) -> dict:
        beta = self.beta(x)  # before alpha: the order of the graph fixes the order gradients are summed in
        alpha = torch.exp(decay_log(self.a_proj(x), self.A_log, self.dt_bias)[..., 0])
        return {"gain": beta, "alpha": alpha}

    def write_argument_flops(self, tally, tokens: int) -> None:
        for _ in ("b_proj", "a_proj"):
            tally.linear(tokens, self.hidden_size, self.num_heads)

    def num_parameters_formula(self) -> int:
        return self._body_parameters() + 2 * self.hidden_size * self.num_heads + 2 * self.num_heads


class GatedDeltaNetNoConv(GatedDeltaNet):
    """Deprecated: the registry's ``gated_deltanet_noconv`` is :class:`GatedDeltaNet` with
    ``use_short_conv=False`` (``build_mixer("gated_deltanet_noconv", ...)``); this subclass builds the same
    layer and warns.
    """

    def __init__(self, hidden_size: int, num_heads: int = 4, head_dim: int = 128, **kwargs) -> None:
        import warnings

        warnings.warn("GatedDeltaNetNoConv is deprecated; use build_mixer('gated_deltanet_noconv', ...) or "
                      "GatedDeltaNet(..., use_short_conv=False)", DeprecationWarning, stacklevel=2)
        if kwargs.pop("use_short_conv", False):
            raise ValueError("gated_deltanet_noconv has no short convolution; use gated_deltanet instead")
        super().__init__(hidden_size, num_heads, head_dim, use_short_conv=False, **kwargs)


class DeltaNet(_DeltaRule):
    """DeltaNet (Schlag et al. 2021; Yang et al. 2024), shaped like ``fla.layers.DeltaNet``.

    ::

        q, k, v = SiLU(conv(W_q x)), SiLU(conv(W_k x)), SiLU(conv(W_v x))
        q, k    = l2norm(q)·D^-1/2, l2norm(k) ;   β_t = sigmoid(b_proj(x_t))  (× 2: allow_neg_eigval)
        o_t     = DELTANET filter (A_t = I, gain = β_t)
        y_t     = o_proj(o_norm(o_t [, g_proj(x_t)]))

    Defaults follow fla: ``expand_v = 1``, no output gate, short convolution on.
    Parameter count: ``d·(2K + V) + [use_gate]·d·V + V·d + d·H + m + [use_short_conv]·W·(2K + V)``.
    Recurrent state per head: ``D·m``.
    """

    design = DELTANET

    def __init__(self, hidden_size: int, num_heads: int = 4, head_dim: int = 128, *, expand_v: float = 1.0,
                 use_short_conv: bool = True, conv_size: int = 4, conv_bias: bool = False,
                 use_gate: bool = False, allow_neg_eigval: bool = False, norm_eps: float = 1e-5,
                 chunk_size: int = 64, layer_idx: int | None = None) -> None:
        super().__init__(hidden_size, num_heads, head_dim, expand_v=expand_v, use_short_conv=use_short_conv,
                         conv_size=conv_size, conv_bias=conv_bias, use_gate=use_gate, norm_eps=norm_eps,
                         chunk_size=chunk_size, layer_idx=layer_idx, allow_neg_eigval=allow_neg_eigval)
        self.b_proj = nn.Linear(self.hidden_size, check_int("num_heads", num_heads, minimum=1), bias=False)

    def write_arguments(self, x: torch.Tensor) -> dict:
        return {"gain": self.beta(x)}

    def write_argument_flops(self, tally, tokens: int) -> None:
        tally.linear(tokens, self.hidden_size, self.num_heads)  # b_proj

    def num_parameters_formula(self) -> int:
        return self._body_parameters() + self.hidden_size * self.num_heads
