"""Causal softmax attention, the reference mixer (``F.scaled_dot_product_attention``)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checks import check_int
from ..ops.flops import FlopCount, Tally, matmul_flops
from .base import Mixer, MixerOutput, check_attention_mask, check_hidden_states, check_packing, check_state_dict
from .common import apply_mask, check_positive_float


def rotary(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE (rotate-half layout): channels ``c`` and ``c + D/2`` rotate by ``pos·base^(−2c/D)``.

    ``x``: ``[B, T, H, D]``; ``positions``: ``[T]`` or ``[B, T]``.  Computed in fp32 (fp64 for fp64 inputs).
    Rotations compose: ``rotary(rotary(x, a), b) = rotary(x, a + b)`` up to rounding.
    """
    D = x.shape[-1]
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=dt, device=x.device) / D)
    ang = positions.to(dt)[..., None] * inv_freq  # [(B,) T, D/2]
    cos, sin = torch.cos(ang)[..., None, :], torch.sin(ang)[..., None, :]  # [(B,) T, 1, D/2]
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
    cached token, so :meth:`state_size_per_head` reports the per-token figure.  A key is stored rotated
    by its index in the cache row (left padding included), so relative positions hold across calls.

    With ``cu_seqlens`` (``B = 1``, N packed sequences) a token attends only to its own sequence, whose
    positions start at 0 (or after row ``n`` of the given cache); the returned cache has one row per
    sequence, each right-aligned behind left padding, as ``generate()`` lays out a padded batch.
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
                output_variance: bool = False, cu_seqlens: torch.Tensor | None = None) -> MixerOutput:
        x = check_hidden_states(hidden_states, self.hidden_size)
        B, T, _ = x.shape
        cu = check_packing(cu_seqlens, attention_mask, x)
        mask = check_attention_mask(attention_mask, B, T, x.device)
        state = check_state_dict(state, ("k", "v", "mask"))
        H, D = self.num_heads, self.head_dim
        q = self.q_proj(x).unflatten(-1, (H, D))
        k = self.k_proj(x).unflatten(-1, (H, D))
        v = self.v_proj(x).unflatten(-1, (H, D))
        rows = B if cu is None else cu.shape[0] - 1
        past = self._check_cache(state, rows)
        if cu is not None:
            return self._forward_packed(q, k, v, past, cu, use_cache)
        S = 0 if past is None else past[0].shape[1]
        positions = torch.arange(S, S + T, device=x.device)
        q, k = rotary(q, positions, self.rope_base), rotary(k, positions, self.rope_base)
        cur_mask = mask if mask is not None else torch.ones(B, T, dtype=torch.bool, device=x.device)
        if past is not None:
            k = torch.cat((past[0].to(k.dtype), k), dim=1)
            v = torch.cat((past[1].to(v.dtype), v), dim=1)
            key_mask = torch.cat((past[2], cur_mask), dim=1)
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

    def _check_cache(self, state: dict, rows: int):
        """``(k, v, mask bool)`` of a given key/value cache of ``rows`` rows, or None."""
        if state.get("k") is None:
            return None
        H, D = self.num_heads, self.head_dim
        S = state["k"].shape[1] if isinstance(state["k"], torch.Tensor) and state["k"].dim() == 4 else -1
        for name in ("k", "v"):
            t = state.get(name)
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape[::2]) != (rows, H) \
                    or t.shape[3] != D or t.shape[1] != S:
                raise ValueError(f"state['{name}'] must be [B, S, H, D] with B={rows}, H={H}, D={D} (B = the number "
                                 f"of sequences with cu_seqlens), got {None if t is None else tuple(t.shape)}")
        past_mask = state.get("mask")
        if not isinstance(past_mask, torch.Tensor) or tuple(past_mask.shape) != (rows, S):
            raise ValueError(f"state['mask'] must be [B, S] = {(rows, S)} alongside the key/value cache")
        return state["k"], state["v"], past_mask.to(torch.bool)

    def _forward_packed(self, q, k, v, past, cu, use_cache: bool) -> MixerOutput:
        """N sequences packed along T (``B = 1``): each token attends to its own sequence (and that sequence's
        row of the cache), at positions that continue the row."""
        T = q.shape[1]
        N = cu.shape[0] - 1
        dev = q.device
        t = torch.arange(T, device=dev)
        seq = torch.searchsorted(cu[1:], t, right=True).clamp_max(N - 1)
        S = 0 if past is None else past[0].shape[1]
        positions = S + t - cu[seq]
        q, k = rotary(q, positions, self.rope_base), rotary(k, positions, self.rope_base)
        allowed = (seq[None, :] == seq[:, None]) & (t[None, :] <= t[:, None])  # [T (query), T (key)]
        keys, values = k[0], v[0]
        if past is not None:  # every row's cache, flattened: a query sees its own row's real tokens
            row_of = torch.arange(N, device=dev).repeat_interleave(S)
            allowed = torch.cat(((row_of[None, :] == seq[:, None]) & past[2].flatten()[None, :], allowed), dim=1)
            keys = torch.cat((past[0].flatten(0, 1).to(k.dtype), keys))
            values = torch.cat((past[1].flatten(0, 1).to(v.dtype), values))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys[None].transpose(1, 2),
                                           values[None].transpose(1, 2), attn_mask=allowed[None, None])
        o = self.o_proj(o.transpose(1, 2).flatten(-2))
        new_state = self._packed_cache(k[0], v[0], past, cu) if use_cache else None
        return MixerOutput(o, new_state, None)

    def _packed_cache(self, k, v, past, cu) -> dict:
        """One cache row per sequence: ``[left padding, row n of the old cache, sequence n]``, every key
        re-rotated by its padding so that it sits at its index (the layout of a left-padded batch)."""
        N = cu.shape[0] - 1
        dev = k.device
        lengths = cu[1:] - cu[:-1]
        S = 0 if past is None else past[0].shape[1]
        L = S + int(lengths.max())  # the new rows' length: a shape, read on the host
        pad = L - S - lengths  # [N]
        i = torch.arange(L, device=dev)[None, :]
        new_tok = i >= (pad + S)[:, None]
        idx = (cu[:-1, None] + i - pad[:, None] - S).clamp(0, k.shape[0] - 1)
        keys, values = k[idx], v[idx]  # [N, L, H, D]
        mask = new_tok
        if past is not None:
            in_past = (i >= pad[:, None]) & ~new_tok
            col = (i - pad[:, None]).clamp(0, S - 1)
            rows = torch.arange(N, device=dev)[:, None]
            keys = torch.where(in_past[..., None, None], past[0][rows, col].to(k.dtype), keys)
            values = torch.where(in_past[..., None, None], past[1][rows, col].to(v.dtype), values)
            mask = mask | (in_past & past[2][rows, col])
        keys = torch.where(mask[..., None, None], rotary(keys, pad[:, None].expand(N, L), self.rope_base), 0.0)
        values = torch.where(mask[..., None, None], values, 0.0)
        return {"k": keys, "v": values, "mask": mask}

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
