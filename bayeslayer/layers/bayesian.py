"""The Bayesian Layer token mixer (docs/theory.md §1.3, §2): a GDN-shaped layer whose memory is a Kalman filter."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checks import check_int
from ..design import BAYESIAN, DIAGONAL_COVARIANCE, lowrank_diagonal
from ..ops.backend import BackendError, backend_unsupported, check_backend
from ..ops.bayesian_layer.lowrank import check_rank
from .base import QKVMixer
from .common import (
    check_positive_float,
    decay_log,
    gate_dtype,
    init_decay_,
    inverse_softplus,
)

DYNAMICS = ("scalar", "diagonal", "rotation", "identity")
COVARIANCES = ("dense", "diagonal", "lowrank")


class BayesianLayer(QKVMixer):
    """Bayesian Layer: memory ``(M_t, P_t)`` written by exact Kalman filtering (docs/theory.md §2.1).

    Per token ``x_t`` and head (key dim ``D``, value dim ``m = D·expand_v``, ``G`` noise groups)::

        q, k, v = SiLU(conv(W_q x)), SiLU(conv(W_k x)), SiLU(conv(W_v x))   (SiLU alone without conv)
        q, k    = l2norm(q), l2norm(k)                        unit query and key
        r_t²    = r2_floor   + softplus(r2_proj(x_t) + r2_bias)      [B, T, H, G] observation noise
        ℓ_t²    = ell2_floor + softplus(ell2_proj(x_t) + ell2_bias)  [B, T, H]    process noise
        α_t     = exp(−exp(A_log)·softplus(a_proj(x_t) + dt_bias))   [B, T, H] or [B, T, H, D]
        θ_t     = theta_proj(x_t) + theta_bias                       [B, T, H, D/2] (rotation only)
        P̄_t = A_t P_{t-1} A_tᵀ + ℓ_t² Σ ;  u_t = P̄_t k_t ;  β_t = 1/(r_t² + k_tᵀu_t)
        M_t = A_t M_{t-1} + β_t u_t (v_t − (A_t M_{t-1})ᵀ k_t)ᵀ ;  P_t = P̄_t − β_t u_t u_tᵀ
        o_t = M_tᵀ q_t ;  variance_t = 1 + q_tᵀ P_t q_t
        y_t = o_proj(o_norm(o_t, g_proj(x_t)))

    ``M_0 = 0``, ``P_0 = p0·I``.  The recurrence is :data:`bayeslayer.design.BAYESIAN` (chunked
    ``bl_chunk`` for training and prefill, ``bl_step`` for decoding); ``covariance="diagonal"``
    swaps in the diagonal-covariance ablation; ``covariance="lowrank", rank=r`` the
    low-rank-plus-diagonal precision ``diag(υ) + W Wᵀ`` (:func:`bayeslayer.design.lowrank_diagonal`,
    conservative projection: never more certain than the dense filter; ``r = head_dim`` is dense BL;
    it trains through a token-by-token covariance pass and the chunked mean pass).

    Dynamics ``A_t``: ``scalar`` ``α_t I`` (GDN's parametrisation: ``a_proj [H, d]``, ``A_log [H]``,
    ``dt_bias [H]``, so a GDN layer's weights can initialise it), ``diagonal`` ``diag(α_t)``
    (``a_proj [H·D, d]``, ``dt_bias [H·D]``, KDA-like), ``rotation`` (channel pairs ``(2c, 2c+1)``
    rotate by ``θ_t`` and shrink by the scalar ``α_t``; ``theta_bias`` starts at RoPE frequencies
    ``10000^(−2c/D)`` and process noise enters the even (real) channels only), ``identity``.

    Initial values: ``r² ≈ r2_init = 1`` and ``p0 = 1`` make the first write's gain ``p0/(p0 + r²) =
    0.5`` (GDN's ``β = sigmoid(0)``); ``ℓ² ≈ ell2_init = 0.1`` keeps the steady gain of a repeated key
    near ``0.27`` (docs/theory.md §4.3) so memory never freezes.  The floors bound ``β ≤ 1/r2_floor``.

    Parameter count (``d`` hidden, ``H`` heads, ``K = H·D``, ``V = H·m``, ``W`` conv size, gate on,
    convolutions without bias; ``Da`` = 0 identity, 1 scalar/rotation, ``D`` diagonal)::

        d·(2K + 3V) + m + [use_short_conv]·W·(2K + V)           q, k, v, g, o projections, norm, convs
        + (d + 1)·H·(Da + G + 1 + [rotation]·D/2) + [Da > 0]·H  a/r2/ell2/theta maps, their biases, A_log

    (one ``d·V`` less without the gate).  ``p0 [H]`` is a buffer, not a parameter.

    Recurrent state per head: ``D·m + G·D²`` floats (``D·m + G·D`` with ``covariance="diagonal"``,
    ``D·m + G·D·(r + 1)`` with ``covariance="lowrank"``).

    ``backend``: ``"auto"`` (default: the Triton kernels — chunked forward for sequences, the fused
    step kernel for one-token decoding — on CUDA tensors when Triton is installed and the layer's
    configuration has a kernel; PyTorch otherwise), ``"torch"``, or ``"triton"`` (always the kernels;
    a configuration without one — ``covariance="diagonal"`` or ``"lowrank"``, ``dynamics="rotation"``, ``head_dim >
    256``, a ``chunk_size`` outside 16/32/64 — raises ``BackendError`` here, and a device that cannot
    run Triton raises at the forward).  See :mod:`bayeslayer.ops.backend`.
    """

    def __init__(self, hidden_size: int, num_heads: int = 4, head_dim: int = 128, *, expand_v: float = 2.0,
                 groups: int = 1, p0: float = 1.0, dynamics: str = "scalar", covariance: str = "dense",
                 use_short_conv: bool = True, conv_size: int = 4, conv_bias: bool = False,
                 use_gate: bool = True, norm_eps: float = 1e-5, r2_init: float = 1.0, ell2_init: float = 0.1,
                 r2_floor: float = 1e-3, ell2_floor: float = 1e-4, rope_base: float = 10000.0,
                 chunk_size: int = 64, backend: str = "auto", layer_idx: int | None = None,
                 rank: int | None = None) -> None:
        if dynamics not in DYNAMICS:
            raise ValueError(f"dynamics must be one of {DYNAMICS}, got {dynamics!r}")
        if covariance not in COVARIANCES:
            raise ValueError(f"covariance must be one of {COVARIANCES}, got {covariance!r}")
        if covariance == "lowrank":
            if rank is None:
                raise ValueError("covariance='lowrank' needs rank (an integer in [0, head_dim])")
            rank = check_rank(rank, check_int("head_dim", head_dim, minimum=1))
            if dynamics == "rotation":
                raise ValueError("covariance='lowrank' does not support dynamics='rotation' (a rotation does "
                                 "not keep the diagonal precision diagonal); use scalar, diagonal or identity")
        elif rank is not None:
            raise ValueError(f"rank applies only to covariance='lowrank', got covariance={covariance!r}")
        check_int("head_dim", head_dim, minimum=1)
        if dynamics == "rotation" and head_dim % 2 != 0:
            raise ValueError(
                f"dynamics='rotation' rotates channel pairs and needs an even head_dim, got {head_dim}"
            )
        super().__init__(hidden_size, num_heads, head_dim, expand_v=expand_v, use_short_conv=use_short_conv,
                         conv_size=conv_size, conv_bias=conv_bias, use_gate=use_gate, norm_eps=norm_eps,
                         qk_norm="l2", q_scale=1.0, chunk_size=chunk_size, layer_idx=layer_idx)
        self.groups = check_int("groups", groups, minimum=1)
        if self.head_v_dim % self.groups != 0:
            raise ValueError(
                f"groups={groups} must divide the value head dim m = head_dim·expand_v = {self.head_v_dim}"
            )
        self.dynamics = dynamics
        self.covariance = covariance
        self.rank = rank
        self.design = {"dense": BAYESIAN, "diagonal": DIAGONAL_COVARIANCE}.get(covariance) or lowrank_diagonal(rank)
        self.r2_floor = check_positive_float("r2_floor", r2_floor)
        self.ell2_floor = check_positive_float("ell2_floor", ell2_floor)
        for name, init, floor in (("r2_init", r2_init, r2_floor), ("ell2_init", ell2_init, ell2_floor)):
            if check_positive_float(name, init) <= floor:
                raise ValueError(f"{name}={init} must exceed its floor {floor}")
        p0 = check_positive_float("p0", p0)
        self.backend = check_backend(backend)
        reason = backend_unsupported(self.backend, "chunk", write=self.design.write, rotation=dynamics == "rotation",
                                     head_dim=self.head_dim, chunk_size=self.chunk_size)
        if reason is not None:
            raise BackendError(f"BayesianLayer(backend={self.backend!r}) cannot run this layer: {reason}")

        d, H, D = self.hidden_size, self.num_heads, self.head_dim
        self.decay_dim = {"identity": 0, "scalar": 1, "rotation": 1, "diagonal": D}[dynamics]
        if self.decay_dim:
            self.a_proj = nn.Linear(d, H * self.decay_dim, bias=False)
            self.A_log = nn.Parameter(torch.empty(H))
            self.dt_bias = nn.Parameter(torch.empty(H * self.decay_dim))
            init_decay_(self.A_log, self.dt_bias)
        self.r2_proj = nn.Linear(d, H * self.groups, bias=False)
        self.r2_bias = nn.Parameter(inverse_softplus(torch.full((H * self.groups,), r2_init - r2_floor)))
        self.ell2_proj = nn.Linear(d, H, bias=False)
        self.ell2_bias = nn.Parameter(inverse_softplus(torch.full((H,), ell2_init - ell2_floor)))
        for p in (self.r2_bias, self.ell2_bias):
            p._no_weight_decay = True
        if dynamics == "rotation":
            self.theta_proj = nn.Linear(d, H * D // 2, bias=False)
            nn.init.zeros_(self.theta_proj.weight)  # start as a data-independent RoPE-like rotation
            freqs = rope_base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
            self.theta_bias = nn.Parameter(freqs.float().repeat(H))
            self.theta_bias._no_weight_decay = True
        self.register_buffer("p0", torch.full((H,), p0))

    # -- the design's arguments ------------------------------------------------------------------
    def write_arguments(self, x: torch.Tensor) -> dict:
        dt = gate_dtype(x)
        H = self.num_heads
        r2 = self.r2_floor + F.softplus(self.r2_proj(x).to(dt) + self.r2_bias.to(dt))
        r2 = r2.unflatten(-1, (H, self.groups))
        if self.groups == 1:
            r2 = r2[..., 0]
        ell2 = self.ell2_floor + F.softplus(self.ell2_proj(x).to(dt) + self.ell2_bias.to(dt))
        args = {"r2": r2, "ell2": ell2}
        if self.decay_dim:
            alpha = torch.exp(decay_log(self.a_proj(x), self.A_log, self.dt_bias))  # [B, T, H, Da]
            args["alpha"] = alpha[..., 0] if self.decay_dim == 1 else alpha
        if self.dynamics == "rotation":
            theta = self.theta_proj(x).to(dt) + self.theta_bias.to(dt)
            args["theta"] = theta.unflatten(-1, (H, self.head_dim // 2))
        return args

    def write_argument_flops(self, tally, tokens: int) -> None:
        d, H = self.hidden_size, self.num_heads
        tally.linear(tokens, d, H * self.groups)  # r2_proj
        tally.linear(tokens, d, H)  # ell2_proj
        if self.decay_dim:
            tally.linear(tokens, d, H * self.decay_dim)  # a_proj
        if self.dynamics == "rotation":
            tally.linear(tokens, d, H * self.head_dim // 2)  # theta_proj

    def filter_p0(self) -> torch.Tensor:
        return self.p0.float()

    def cp_unsupported(self) -> str | None:
        if self.covariance != "dense":
            return f"covariance={self.covariance!r} has no context-parallel path (only the dense covariance)"
        if self.dynamics == "rotation":
            return "rotations have no context-parallel path (identity, scalar or diagonal decay)"
        return None

    def initial_state(self, batch_size: int, dtype: torch.dtype, device) -> tuple:
        M, P = self.design.initial_state(batch_size, self.num_heads, self.head_dim, self.head_v_dim,
                                         groups=self.groups, dtype=dtype, device=device)
        if self.covariance == "lowrank":
            # F = [υ, W]: υ_0 = 1/p0 per head, W_0 = 0
            P[..., 0] = 1.0 / self.p0.to(dtype).reshape((1, -1) + (1,) * (P.dim() - 3))
            return M, P
        scale = self.p0.to(dtype).reshape((1, -1) + (1,) * (P.dim() - 2))
        return M, P * scale

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, dynamics={self.dynamics}, covariance={self.covariance}, "
                f"groups={self.groups}, backend={self.backend}"
                + (f", rank={self.rank}" if self.rank is not None else ""))

    # -- sizes -------------------------------------------------------------------------------------
    def state_size_per_head(self) -> int:
        return self.design.state_size(self.head_dim, self.head_v_dim, self.groups)

    def num_parameters_formula(self) -> int:
        d, H, D, G = self.hidden_size, self.num_heads, self.head_dim, self.groups
        rot = D // 2 if self.dynamics == "rotation" else 0
        return (self._body_parameters() + (d + 1) * H * (self.decay_dim + G + 1 + rot)
                + (H if self.decay_dim else 0))

