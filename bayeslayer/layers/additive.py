"""The latent-input (additive) family as token mixers: linear attention and gated linear attention (docs/theory.md §3).

Both run the latent-input design ``M_t = A_t M_{t-1} + ω_t k_t v_tᵀ`` of :mod:`bayeslayer.design`
with ``ω_t = 1`` (the write coefficient given directly as ``gain``); no recurrence is written here.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checks import check_int
from ..design import GLA, LINEAR_ATTENTION
from .base import QKVMixer
from .common import MIN_LOG_DECAY, gate_dtype


def unit_gain(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    return torch.ones(x.shape[:2] + (num_heads,), dtype=gate_dtype(x), device=x.device)


class LinearAttention(QKVMixer):
    """Causal linear attention (Katharopoulos et al. 2020) on the latent-input design, ``A_t = I``.

    ::

        q, k, v = φ(W_q x), φ(W_k x), W_v x       φ = SiLU (after the short conv when enabled)
        q, k    = l2norm(q)·D^-1/2, l2norm(k)    (bounded features; the sum is not normalised,
                                                  the output RMSNorm fixes its scale)
        o_t     = Σ_{i≤t} v_i k_iᵀ q_t           (LINEAR_ATTENTION filter, gain = 1)
        y_t     = o_proj(o_norm(o_t [, g_proj(x_t)]))

    Defaults: ``expand_v = 1``, no short convolution, no output gate (fla's ``LinearAttention``
    ends in a plain RMSNorm too).  Parameter count:
    ``d·(2K + V) + [use_gate]·d·V + V·d + m + [use_short_conv]·W·(2K + V)``.
    Recurrent state per head: ``D·m``.
    """

    design = LINEAR_ATTENTION

    def __init__(self, hidden_size: int, num_heads: int = 4, head_dim: int = 128, *, expand_v: float = 1.0,
                 use_short_conv: bool = False, conv_size: int = 4, conv_bias: bool = False,
                 use_gate: bool = False, norm_eps: float = 1e-5, chunk_size: int = 64,
                 layer_idx: int | None = None) -> None:
        super().__init__(hidden_size, num_heads, head_dim, expand_v=expand_v, use_short_conv=use_short_conv,
                         conv_size=conv_size, conv_bias=conv_bias, use_gate=use_gate, norm_eps=norm_eps,
                         qk_norm="l2", chunk_size=chunk_size, layer_idx=layer_idx)

    def write_arguments(self, x: torch.Tensor) -> dict:
        return {"gain": unit_gain(x, self.num_heads)}

    def write_argument_flops(self, tally, tokens: int) -> None:
        """No projection: the write coefficient is 1."""

    def num_parameters_formula(self) -> int:
        return self._body_parameters()


class GatedLinearAttention(QKVMixer):
    """Gated linear attention (Yang et al. 2023), shaped like ``fla.layers.GatedLinearAttention``.

    ::

        q, k, v = W_q x, W_k x, W_v x             (SiLU after the optional short conv)
        log α_t = logsigmoid(gk_proj(x_t)) / 16   [B, T, H, D], gk_proj low-rank d → 16 → K
        o_t     = GLA filter (A_t = diag(α_t), gain = 1) on q·D^-1/2, k
        y_t     = o_proj(o_norm(o_t, g_proj(x_t)))

    Defaults follow fla: ``expand_v = 2`` (fla's ``expand_k = 0.5``, ``expand_v = 1``), no short conv,
    output gate on.  Parameter count:
    ``d·(2K + 3V) + d·r + r·K + K + m + [use_short_conv]·W·(2K + V)`` with ``r = gate_low_rank_dim``
    (16) and without the gate one ``d·V`` less.  Recurrent state per head: ``D·m``.
    """

    design = GLA

    def __init__(self, hidden_size: int, num_heads: int = 4, head_dim: int = 128, *, expand_v: float = 2.0,
                 use_short_conv: bool = False, conv_size: int = 4, conv_bias: bool = False,
                 use_gate: bool = True, norm_eps: float = 1e-5, gate_low_rank_dim: int = 16,
                 gate_logit_normalizer: float = 16.0, chunk_size: int = 64,
                 layer_idx: int | None = None) -> None:
        super().__init__(hidden_size, num_heads, head_dim, expand_v=expand_v, use_short_conv=use_short_conv,
                         conv_size=conv_size, conv_bias=conv_bias, use_gate=use_gate, norm_eps=norm_eps,
                         qk_norm=None, activation_without_conv=False, chunk_size=chunk_size,
                         layer_idx=layer_idx)
        self.gate_low_rank_dim = check_int("gate_low_rank_dim", gate_low_rank_dim, minimum=1)
        if not gate_logit_normalizer > 0:
            raise ValueError(f"gate_logit_normalizer must be > 0, got {gate_logit_normalizer!r}")
        self.gate_logit_normalizer = float(gate_logit_normalizer)
        self.gk_proj = nn.Sequential(nn.Linear(self.hidden_size, self.gate_low_rank_dim, bias=False),
                                     nn.Linear(self.gate_low_rank_dim, self.key_dim, bias=True))

    def write_arguments(self, x: torch.Tensor) -> dict:
        log_alpha = F.logsigmoid(self.gk_proj(x).to(gate_dtype(x))) / self.gate_logit_normalizer
        alpha = torch.exp(log_alpha.clamp_min(MIN_LOG_DECAY)).unflatten(-1, (self.num_heads, self.head_dim))
        return {"gain": unit_gain(x, self.num_heads), "alpha": alpha}

    def write_argument_flops(self, tally, tokens: int) -> None:
        tally.linear(tokens, self.hidden_size, self.gate_low_rank_dim)  # gk_proj, low rank
        tally.linear(tokens, self.gate_low_rank_dim, self.key_dim)

    def num_parameters_formula(self) -> int:
        r, K = self.gate_low_rank_dim, self.key_dim
        return self._body_parameters() + self.hidden_size * r + r * K + K
