"""Causal softmax attention, the reference mixer (``F.scaled_dot_product_attention``)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checks import check_int
from ..ops.flops import FlopCount, Tally, matmul_flops
from .base import Mixer, MixerOutput, check_attention_mask, check_hidden_states, check_state_dict
from .common import apply_mask, check_positive_float


def rotary(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE (rotate-half layout): channels ``c`` and ``c + D/2`` rotate by ``pos·base^(−2c/D)``.

    ``x``: ``[B, T, H, D]``; ``positions``: ``[T]``.  Computed in fp32 (fp64 for fp64 inputs).
    """
    D = x.shape[-1]
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=dt, device=x.device) / D)
    ang = positions.to(dt)[:, None] * inv_freq  # [T, D/2]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]  # [T, 1, D/2]
    x1, x2 = x.to(dt).chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(Mixer):
    """Multi-head causal softmax attention with rotary position embeddings.

    ::

        q, k, v = RoPE(W_q x), RoPE(W_k x), W_v x          [B, T, H, D]
        o_t     = softmax(q_t k_{≤t}ᵀ / √D) v_{≤t}           (padded keys masked out)
        y_t     = o_proj(o_t)

    Parameter count: ``4·d·H·D`` (``+ 3·H·D`` with ``qkv_bias``).  The state is the key/value cache
    ``{"k": [B, S, H, D], "v": [B, S, H, D], "mask": [B, S] bool}``: ``2·D`` floats per head and
    cached token, so :meth:`state_size_per_head` reports the per-token figure.
    """

    def __init__(self, hidden_size: int, num_heads: int = 4, head_dim: int = 128, *, qkv_bias: bool = False,
                 rope_base: float = 10000.0, layer_idx: int | None = None) -> None:
        super().__init__()
        self.hidden_size = check_int("hidden_size", hidden_size, minimum=1)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        if self.head_dim % 2 != 0:
            raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
        self.rope_base = check_positive_float("rope_base", rope_base)
        self.qkv_bias = bool(qkv_bias)
        self.layer_idx = layer_idx
        d, K = self.hidden_size, self.num_heads * self.head_dim
        self.q_proj = nn.Linear(d, K, bias=self.qkv_bias)
        self.k_proj = nn.Linear(d, K, bias=self.qkv_bias)
        self.v_proj = nn.Linear(d, K, bias=self.qkv_bias)
        self.o_proj = nn.Linear(K, d, bias=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                state: dict | None = None, use_cache: bool = False,
                output_variance: bool = False) -> MixerOutput:
        x = check_hidden_states(hidden_states, self.hidden_size)
        B, T, _ = x.shape
        mask = check_attention_mask(attention_mask, B, T, x.device)
        state = check_state_dict(state, ("k", "v", "mask"))
        H, D = self.num_heads, self.head_dim
        q = self.q_proj(x).unflatten(-1, (H, D))
        k = self.k_proj(x).unflatten(-1, (H, D))
        v = self.v_proj(x).unflatten(-1, (H, D))
        past = state.get("k")
        S = 0 if past is None else past.shape[1]
        if past is not None:
            for name in ("k", "v"):
                t = state.get(name)
                if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape[::2]) != (B, H) \
                        or t.shape[3] != D or t.shape[1] != S:
                    raise ValueError(f"state['{name}'] must be [B, S, H, D] with B={B}, H={H}, D={D}, "
                                     f"got {None if t is None else tuple(t.shape)}")
        positions = torch.arange(S, S + T, device=x.device)
        q, k = rotary(q, positions, self.rope_base), rotary(k, positions, self.rope_base)
        cur_mask = mask if mask is not None else torch.ones(B, T, dtype=torch.bool, device=x.device)
        past_mask = state.get("mask")
        if past is not None:
            k = torch.cat((state["k"].to(k.dtype), k), dim=1)
            v = torch.cat((state["v"].to(v.dtype), v), dim=1)
            if past_mask is None or tuple(past_mask.shape) != (B, S):
                raise ValueError(f"state['mask'] must be [B, S] = {(B, S)} alongside the key/value cache")
            key_mask = torch.cat((past_mask.to(torch.bool), cur_mask), dim=1)
        else:
            key_mask = cur_mask
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if S == 0 and mask is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        else:
            i = torch.arange(T, device=x.device)[:, None] + S
            j = torch.arange(S + T, device=x.device)[None, :]
            allowed = (j <= i)[None] & key_mask[:, None, :]
            # a padded query with no real key before it attends to itself (its output is zeroed below)
            allowed = allowed | (j == i)[None]
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed[:, None])
        o = self.o_proj(o.transpose(1, 2).flatten(-2))
        o = apply_mask(o, mask)
        new_state = {"k": k, "v": v, "mask": key_mask} if use_cache else None
        return MixerOutput(o, new_state, None)

    def state_size_per_head(self) -> int:
        """Floats per head **per cached token** (``2·D``); the cache grows with the sequence."""
        return 2 * self.head_dim

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, rope_base={self.rope_base:g}"

    def flops(self, batch_size: int, seq_len: int) -> FlopCount:
        """q/k/v/o projections and the attention's two products ``QKᵀ`` and ``P V`` over the full ``T × T``
        score matrix (PyTorch's flop counter does not halve it for causal attention; neither does this); the
        backward recomputes the scores (flash attention), five products."""
        B = check_int("batch_size", batch_size, minimum=1)
        T = check_int("seq_len", seq_len, minimum=1)
        d, H, D = self.hidden_size, self.num_heads, self.head_dim
        t = Tally()
        for _ in range(3):
            t.linear(B * T, d, H * D)
        t.matmul(B * H, T, D, T)
        t.matmul(B * H, T, T, D)
        t.backward += B * H * matmul_flops(T, D, T)  # the scores again
        t.linear(B * T, H * D, d)
        return t.count()

    def num_parameters_formula(self) -> int:
        K = self.num_heads * self.head_dim
        return 4 * self.hidden_size * K + (3 * K if self.qkv_bias else 0)
