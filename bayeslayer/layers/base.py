"""The token-mixer contract and the skeleton every recurrent mixer shares.

A mixer maps ``hidden_states [B, T, hidden]`` to ``o [B, T, hidden]``::

    out = mixer(hidden_states, attention_mask=None, state=None, use_cache=False, output_variance=False)
    out.o, out.state, out.variance            # MixerOutput

``state`` is a per-layer dict of tensors.  Recurrent mixers keep ``{"recurrent": (M, P or None),
"conv": {name: [B, C, W-1]} or None}``; attention keeps its key/value cache.  Feeding a sequence in
pieces with the returned state equals one full forward: a prefill runs the design's chunked path, a
one-token call its ``.step``, each on the mixer's ``backend`` (:mod:`bayeslayer.ops.backend`).

``attention_mask`` is ``[B, T]`` (or the ``[B, S ≥ T]`` mask of everything seen so far, as
``transformers``' ``generate()`` passes it: its last ``T`` columns are used), 1 = real token,
0 = padding.  A padded token is a no-op write: its key is zeroed, its decay is 1 and (for the
Bayesian Layer) its process noise is the smallest positive float, so neither ``M`` nor ``P`` moves;
its output is zero.

``cu_seqlens`` (``[N + 1]`` int offsets, ``B = 1``, as flash-linear-attention's layers take it) packs N
sequences along T with no padding: every sequence starts from its own state (the prior, or row ``n``
of ``state``), short convolutions restart at every sequence start, and with ``use_cache`` the returned
state holds one row per sequence, so decoding continues each one with a batch of N.  The result equals
running the sequences one by one.  ``attention_mask`` and ``cu_seqlens`` are exclusive.

Layers: :class:`Mixer` (interface, input checks), :class:`RecurrentMixer` (drives a
:class:`~bayeslayer.design.DesignModel`: masking, prefill/decode, cache), :class:`QKVMixer`
(q/k/v projections, short convolutions, gated output norm, output projection — the body of GDN,
DeltaNet, linear attention, GLA and the Bayesian Layer).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checks import check_int
from ..design import DesignModel
from ..ops.bayesian_layer.cp import CPContext, cp_conv_halo, filter_chunk_cp
from ..ops.flops import FlopCount, Tally, chunk_flops
from ..ops.utils.validation import check_cu_seqlens, check_tensor, values_checked
from .common import (
    GatedRMSNorm,
    ShortConvolution,
    apply_mask,
    check_positive_float,
    l2norm,
    value_head_dim,
)


class MixerOutput(NamedTuple):
    """What every mixer returns.

    o: ``[B, T, hidden]`` in the input dtype.
    state: the updated per-layer state dict when ``use_cache=True``, else ``None``.
    variance: ``[B, T, H, G]`` predictive variance ``1 + q_tᵀ P_t q_t`` (Bayesian Layer with
        ``output_variance=True``), else ``None``.
    """

    o: torch.Tensor
    state: dict | None
    variance: torch.Tensor | None


def check_hidden_states(x, hidden_size: int) -> torch.Tensor:
    """``[B, T, hidden_size]``, floating point, finite (a NaN is named here, not later as the filter's "q").

    The finiteness test is the ops' (one sum over x; off with :func:`bayeslayer.ops.set_value_checks`).
    """
    x = check_tensor("hidden_states", x)
    if x.dim() != 3 or x.shape[-1] != hidden_size:
        raise ValueError(f"hidden_states must be [B, T, hidden_size={hidden_size}], got {tuple(x.shape)}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"hidden_states has an empty batch or time axis: {tuple(x.shape)}")
    return x


def check_attention_mask(mask, B: int, T: int, device: torch.device) -> torch.Tensor | None:
    """``[B, S]`` with S ≥ T, entries 0/1 (bool, int or float) → bool ``[B, T]`` (its last T columns)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dim() != 2 or mask.shape[0] != B or mask.shape[1] < T:
        raise ValueError(
            f"attention_mask must be [B, T] = {(B, T)} (or [B, S >= T]) with 1 = token, 0 = padding; "
            f"got {tuple(mask.shape)}"
        )
    if mask.device != device:
        raise ValueError(f"attention_mask is on {mask.device} but hidden_states is on {device}")
    mask = mask[:, mask.shape[1] - T:]
    if mask.dtype != torch.bool:
        if values_checked(mask) and bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError("attention_mask must contain only 0 (padding) and 1 (token)")
        mask = mask != 0
    return mask


def check_packing(cu_seqlens, attention_mask, x: torch.Tensor) -> torch.Tensor | None:
    """``cu_seqlens`` checked for a mixer's input ``x [1, T, ·]`` (int64 offsets back), or None."""
    if cu_seqlens is None:
        return None
    if attention_mask is not None:
        raise ValueError("pass attention_mask or cu_seqlens, not both: packed sequences (cu_seqlens) have no "
                         "padding to mask")
    return check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1], x.device)


def check_state_dict(state, keys: tuple[str, ...]) -> dict:
    if state is None:
        return {}
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict (a mixer's returned state) or None, got "
                        f"{type(state).__name__}")
    unknown = set(state) - set(keys)
    if unknown:
        raise ValueError(f"state has unknown entries {sorted(unknown)}; expected keys {list(keys)}")
    return state


class Mixer(nn.Module):
    """Base class: the interface of every token mixer (see the module docstring)."""

    hidden_size: int
    num_heads: int

    def state_size_per_head(self) -> int:
        """Floats of recurrent state per head (attention: per head and cached token)."""
        raise NotImplementedError

    def num_parameters_formula(self) -> int:
        """The parameter count from the formula in the class docstring (tests check it against the module)."""
        raise NotImplementedError

    def flops(self, batch_size: int, seq_len: int) -> FlopCount:
        """FLOPs of one training step's forward and backward through this mixer on ``[batch_size, seq_len]``
        inputs that need a gradient (:mod:`bayeslayer.ops.flops`' convention: products, convolutions and
        factorizations; the tests hold it within 10% of ``FlopCounterMode`` on the PyTorch path)."""
        raise NotImplementedError

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                state: dict | None = None, use_cache: bool = False,
                output_variance: bool = False, cu_seqlens: torch.Tensor | None = None) -> MixerOutput:
        raise NotImplementedError


class RecurrentMixer(Mixer):
    """A mixer whose memory is a :class:`DesignModel` filter.

    Subclasses provide :meth:`features` (``q, k [B, T, H, D]``, ``v [B, T, H, m]``, the design's
    per-token write arguments and the new conv cache) and :meth:`readout` (filter output →
    ``[B, T, hidden]``); this class masks padded writes, runs the design's chunked path for a
    sequence (training, prefill) or its ``step`` for a single token (decoding), and assembles the
    state dict.
    """

    design: DesignModel
    chunk_size: int = 64
    # "auto" | "torch" | "triton" (bayeslayer.ops.backend); mixers with a Triton kernel take it as an argument
    backend: str = "auto"

    def features(self, x: torch.Tensor, mask: torch.Tensor | None, conv_state: dict | None,
                 cu_seqlens: torch.Tensor | None = None):
        """``(q, k, v, write, new_conv_state, extra)``: filter inputs ``[B, T, H, ·]``, the design's
        write arguments (``gain``/``alpha``/``theta``/``r2``/``ell2``), the conv cache to return and
        whatever :meth:`readout` needs besides ``x``.  With ``cu_seqlens`` (checked int64 offsets) any
        convolution over time restarts at every sequence start."""
        raise NotImplementedError

    def readout(self, o: torch.Tensor, x: torch.Tensor, extra) -> torch.Tensor:
        raise NotImplementedError

    def initial_state(self, batch_size: int, dtype: torch.dtype, device) -> tuple:
        """The memory before the first token: ``(M = 0, P = p0·I or None)``."""
        return self.design.initial_state(batch_size, self.num_heads, self.head_dim, self.head_v_dim,
                                         dtype=dtype, device=device)

    def filter_p0(self):
        """``P_0 = p0·I`` for designs with a covariance (ignored by the others)."""
        return 1.0

    @staticmethod
    def mask_writes(k: torch.Tensor, write: dict, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Make padded tokens no-op writes: ``k = 0``, ``α = 1``, ``θ = 0``, ``ℓ² = tiny``."""
        k = apply_mask(k, mask)
        out = dict(write)
        for name in ("alpha", "theta", "ell2"):
            val = write.get(name)
            if val is None:
                continue
            m = mask.reshape(mask.shape + (1,) * (val.dim() - 2))
            if name == "alpha":
                out[name] = torch.where(m, val, torch.ones_like(val))
            elif name == "theta":
                out[name] = torch.where(m, val, torch.zeros_like(val))
            else:
                out[name] = torch.where(m, val, torch.full_like(val, torch.finfo(val.dtype).tiny))
        return k, out

    def cp_unsupported(self) -> str | None:
        """Why this mixer cannot run context-parallel (``cp_context``), or None when it can."""
        return "it has no context-parallel path"

    def filter_flops(self, batch_size: int, seq_len: int) -> FlopCount:
        """FLOPs of the design's chunked filter in a training step (:func:`bayeslayer.ops.flops.chunk_flops`)."""
        design = self.design
        return chunk_flops(design.write, getattr(self, "dynamics", design.dynamics), batch_size=batch_size,
                           seq_len=seq_len, num_heads=self.num_heads, key_dim=self.head_dim,
                           value_dim=self.head_v_dim, chunk_size=self.chunk_size, groups=getattr(self, "groups", 1),
                           rank=design.rank, projection=design.projection)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                state: dict | None = None, use_cache: bool = False,
                output_variance: bool = False, cp_context=None,
                cu_seqlens: torch.Tensor | None = None) -> MixerOutput:
        x = check_hidden_states(hidden_states, self.hidden_size)
        B, T, _ = x.shape
        if cp_context is not None:
            if cu_seqlens is not None:
                raise ValueError("with cp_context, pass the global cu_seqlens to build_cp_context, not cu_seqlens")
            return self._forward_cp(x, attention_mask, state, use_cache, output_variance, cp_context)
        cu = check_packing(cu_seqlens, attention_mask, x)
        mask = check_attention_mask(attention_mask, B, T, x.device)
        state = check_state_dict(state, ("recurrent", "conv"))
        # a subclass written before packing may take three arguments: pass the offsets only when packing
        q, k, v, write, conv_state, extra = (self.features(x, mask, state.get("conv")) if cu is None
                                             else self.features(x, mask, state.get("conv"), cu))
        if mask is not None:
            k, write = self.mask_writes(k, write, mask)
        rec = state.get("recurrent")
        if T == 1 and cu is None:
            # decoding: one step (design.step: the fused Triton step kernel or the recurrent oracle)
            if rec is None:
                rec = self.initial_state(B, torch.float64 if x.dtype == torch.float64 else torch.float32,
                                         x.device)
            out = self.design.step(q[:, 0], k[:, 0], v[:, 0], state=rec, backend=self.backend,
                                   **{name: val[:, 0] for name, val in write.items()})
            o = out.o[:, None]
            variance = out.variance[:, None] if output_variance and out.variance is not None else None
        else:
            out = self.design.chunk(q, k, v, p0=self.filter_p0(), initial_state=rec,
                                    output_final_state=use_cache, return_variance=output_variance,
                                    chunk_size=self.chunk_size, backend=self.backend, cu_seqlens=cu, **write)
            o, variance = out.o, out.variance if output_variance else None
        o = self.readout(o, x, extra)
        o = apply_mask(o, mask)
        new_state = {"recurrent": out.state, "conv": conv_state} if use_cache else None
        return MixerOutput(o, new_state, variance)

    def _forward_cp(self, x, attention_mask, state, use_cache, output_variance, ctx) -> MixerOutput:
        """This rank's slice of a context-parallel sequence (:mod:`bayeslayer.ops.bayesian_layer.cp`); x ``[1, T_local,
        d]``."""
        reason = self.cp_unsupported()
        if reason is not None:
            raise ValueError(f"{type(self).__name__} cannot run with cp_context: {reason}")
        if attention_mask is not None or state is not None or use_cache:
            raise ValueError("with cp_context, pass no attention_mask, state or use_cache: the context holds the "
                             "sequence layout and the state crosses ranks inside the op")
        q, k, v, write, _, extra = self.features(x, None, ctx)
        out = filter_chunk_cp(q, k, v, ctx=ctx, p0=self.filter_p0(), return_variance=output_variance,
                              chunk_size=self.chunk_size, **write)
        o = self.readout(out.o, x, extra)
        return MixerOutput(o, None, out.variance if output_variance else None)


class QKVMixer(RecurrentMixer):
    """Projections, short convolutions and gated output norm around a design filter.

    Per token (``x`` the input, ``H`` heads of key dim ``D`` and value dim ``m = D·expand_v``)::

        q, k, v = act(conv(W_q x)), act(conv(W_k x)), act(conv(W_v x))   (act = SiLU)
        q, k    = l2norm(q)·scale, l2norm(k)             (when qk_norm == "l2")
        o_t     = filter(q, k, v, design-specific write arguments)   ([B, T, H, m])
        y       = W_o · GatedRMSNorm(o_t, W_g x)         (plain RMSNorm without the gate)

    Parameter names are flash-linear-attention's: ``q_proj, k_proj, v_proj, {q,k,v}_conv1d,
    g_proj, o_norm, o_proj``.  Parameters here: ``d·(2K + (2 if gate else 1)·V) + V·d + m``
    plus ``W·(2K + V)`` convolution weights (``K = H·D``, ``V = H·m``, ``W = conv_size``;
    ``+ (2K + V)`` with ``conv_bias``).
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, *, expand_v: float,
                 use_short_conv: bool, conv_size: int = 4, conv_bias: bool = False, use_gate: bool = True,
                 norm_eps: float = 1e-5, qk_norm: str | None = "l2", q_scale: float | None = None,
                 activation_without_conv: bool = True, chunk_size: int = 64,
                 layer_idx: int | None = None) -> None:
        super().__init__()
        self.hidden_size = check_int("hidden_size", hidden_size, minimum=1)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        self.head_v_dim = value_head_dim(self.head_dim, expand_v)
        self.expand_v = expand_v
        self.key_dim = self.num_heads * self.head_dim
        self.value_dim = self.num_heads * self.head_v_dim
        self.use_short_conv = bool(use_short_conv)
        self.conv_size = check_int("conv_size", conv_size, minimum=1)
        self.conv_bias = bool(conv_bias)
        self.use_gate = bool(use_gate)
        if qk_norm not in ("l2", None):
            raise ValueError(f"qk_norm must be 'l2' or None, got {qk_norm!r}")
        self.qk_norm = qk_norm
        self.q_scale = self.head_dim ** -0.5 if q_scale is None else check_positive_float("q_scale", q_scale)
        self.activation_without_conv = activation_without_conv
        self.chunk_size = check_int("chunk_size", chunk_size, minimum=1)
        self.layer_idx = layer_idx

        d, K, V = self.hidden_size, self.key_dim, self.value_dim
        self.q_proj = nn.Linear(d, K, bias=False)
        self.k_proj = nn.Linear(d, K, bias=False)
        self.v_proj = nn.Linear(d, V, bias=False)
        if self.use_short_conv:
            self.q_conv1d = ShortConvolution(K, self.conv_size, bias=self.conv_bias)
            self.k_conv1d = ShortConvolution(K, self.conv_size, bias=self.conv_bias)
            self.v_conv1d = ShortConvolution(V, self.conv_size, bias=self.conv_bias)
        if self.use_gate:
            self.g_proj = nn.Linear(d, V, bias=False)
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(V, d, bias=False)

    # -- pieces --------------------------------------------------------------------------------------
    def _body_parameters(self) -> int:
        d, K, V, m, W = self.hidden_size, self.key_dim, self.value_dim, self.head_v_dim, self.conv_size
        n = d * (2 * K + (2 if self.use_gate else 1) * V) + V * d + m
        if self.use_short_conv:
            n += W * (2 * K + V) + ((2 * K + V) if self.conv_bias else 0)
        return n

    def _conv(self, name: str, x: torch.Tensor, cache, new: dict, cu_seqlens=None) -> torch.Tensor:
        conv = getattr(self, f"{name}_conv1d")
        if isinstance(cache, CPContext):  # context parallel: the previous rank's last W - 1 inputs
            if cache.conv1d_kernel_size != self.conv_size:
                raise ValueError(f"cp_context was built with conv1d_kernel_size={cache.conv1d_kernel_size}, but "
                                 f"this layer's short convolution has width {self.conv_size}")
            halo = cp_conv_halo(x, cache)[:, : self.conv_size - 1]
            y, _ = conv(x, halo.transpose(1, 2))
            return y
        y, new[name] = conv(x, None if cache is None else cache.get(name), output_final_state=True,
                            cu_seqlens=cu_seqlens)
        return y

    def project_qkv(self, x: torch.Tensor, mask: torch.Tensor | None, conv_state: dict | None,
                    cu_seqlens: torch.Tensor | None = None):
        """``(q, k [B, T, H, D], v [B, T, H, m], new conv cache or None)``; the short convolutions restart
        at every start of a packed sequence (``cu_seqlens``)."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        new_conv = None
        if self.use_short_conv:
            if conv_state is not None and not isinstance(conv_state, (dict, CPContext)):
                raise TypeError(f"state['conv'] must be a dict of conv caches, got "
                                f"{type(conv_state).__name__}")
            # padded inputs are zeroed before the convolution so they never leak into a real token's window
            q, k, v = apply_mask(q, mask), apply_mask(k, mask), apply_mask(v, mask)
            new_conv = {}
            q = self._conv("q", q, conv_state, new_conv, cu_seqlens)
            k = self._conv("k", k, conv_state, new_conv, cu_seqlens)
            v = self._conv("v", v, conv_state, new_conv, cu_seqlens)
        elif self.activation_without_conv:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_heads, self.head_v_dim))
        if self.qk_norm == "l2":
            q, k = l2norm(q), l2norm(k)
        return q * self.q_scale, k, v, new_conv

    def write_arguments(self, x: torch.Tensor) -> dict:
        """The design's per-token write arguments (``gain``, ``alpha``, ``r2``, ...), ``[B, T, H, ...]``."""
        raise NotImplementedError

    def write_argument_flops(self, tally: Tally, tokens: int) -> None:
        """Add the FLOPs of :meth:`write_arguments`' projections on ``tokens`` tokens to ``tally``."""
        raise NotImplementedError

    def flops(self, batch_size: int, seq_len: int) -> FlopCount:
        """The q/k/v (and gate, output) projections, the short convolutions, the write arguments' projections
        and the filter (see :meth:`Mixer.flops`)."""
        B = check_int("batch_size", batch_size, minimum=1)
        T = check_int("seq_len", seq_len, minimum=1)
        d, K, V, tokens = self.hidden_size, self.key_dim, self.value_dim, B * T
        t = Tally()
        for width in (K, K, V):
            t.linear(tokens, d, width)
            if self.use_short_conv:
                t.conv(B, width, T, self.conv_size)
        self.write_argument_flops(t, tokens)
        if self.use_gate:
            t.linear(tokens, d, V)
        t.linear(tokens, V, d)
        return t.count() + self.filter_flops(B, T)

    def features(self, x, mask, conv_state, cu_seqlens=None):
        q, k, v, new_conv = self.project_qkv(x, mask, conv_state, cu_seqlens)
        return q, k, v, self.write_arguments(x), new_conv, None

    def readout(self, o: torch.Tensor, x: torch.Tensor, extra) -> torch.Tensor:
        gate = self.g_proj(x).unflatten(-1, (self.num_heads, self.head_v_dim)) if self.use_gate else None
        o = self.o_norm(o, gate)
        return self.o_proj(o.flatten(-2))

    def state_size_per_head(self) -> int:
        return self.design.state_size(self.head_dim, self.head_v_dim)

    def extra_repr(self) -> str:
        return (f"design={self.design.name}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"head_v_dim={self.head_v_dim}, use_short_conv={self.use_short_conv}, "
                f"use_gate={self.use_gate}, chunk_size={self.chunk_size}")
