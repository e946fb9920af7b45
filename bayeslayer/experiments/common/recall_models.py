"""Recurrent-core-only models for the learned collision studies (docs/theory.md §8.2–8.3).

The task's *address* is fed directly as key **and** query of every layer and every
head; there is no learned key or query projection, so a model cannot rotate a
collision away: two addresses with overlap ρ reach the filter with overlap ρ.
Everything else a token carries (WRITE/QUERY marker, value) reaches the filter
only through learned maps from the residual stream:

* value      ``v_t = W_v h_t``                                        ``[B, T, H, m]``
* BL low-rank ``bayesian_lowrank<r>``: the same maps, the low-rank-plus-diagonal precision design
  :func:`~bayeslayer.design.lowrank_diagonal` of rank ``r`` (conservative projection) in place of the
  dense covariance (not in the default model list)
* BL         exact Kalman write, ``r_t² = softplus(·) + 1e-4``, ``ℓ_t² = softplus(·) + 1e-6``,
  ``A_t = I`` (as in the deterministic study, docs/theory.md §8.1: process noise is the only forgetting)
* Delta      covariance-reset write ``M_t = M_{t-1} + β_t k_t (v_t − M_{t-1}ᵀ k_t)ᵀ``,
  ``β_t = σ(·)``, ``A_t = I`` (the DeltaNet design)
* GDN        the same reset write after a scalar decay ``A_t = α_t I`` (the Gated DeltaNet design),
  ``β_t = σ(·)`` as Delta's, ``α_t = exp(−A_h·softplus(a_t + b_h))`` with ``a_t`` a bias-free map of the
  residual stream (GDN's gate), initialised near ``α = 1`` (:data:`GDN_INIT_STEP`; not in the default model list)
* LA         latent-input write ``M_t = M_{t-1} + ω_t k_t v_tᵀ``, ``ω_t = σ(·)``, ``A_t = I``
* GLA        latent-input write with ``A_t = diag(α_t)``, ``log α_t = logσ(·)/16`` (GLA's gate)
* ``bayesian_paper`` / ``delta_paper`` (``--core paper``, the paper's cores): BL with one learnable scalar per
  head for each of ``r²`` and ``ℓ²``; the reset write with ``λ = ℓ² = 0.05`` fixed and one learnable ``r²``
  per head (gain ``η_h = λ/(r_h² + λ‖k‖²)``)

Each mixer runs its design model's chunked path from :mod:`bayeslayer.design`;
the output is the readout ``y_t = M_tᵀ q_t`` with ``q_t = k_t = address_t``.

Model (docs/theory.md §8.2: 2 layers, width 64, 4 heads × 16 dims)::

    h = W_in x                                    x: [B, T, input_dim]
    h = h + W_o · mixer(LN(h), address)   ┐ per layer
    h = h + MLP(LN(h))                    ┘ (MLP width 2·width, GELU)
    logits = W_head LN(h)                         [B, T, num_classes]

Parameters (recall sizes: 33 inputs, 16 classes): 54.7k BL, 54.2k Delta/LA, 54.7k GDN, 62.5k GLA
(its decay map is per channel); the memory state is ``H·D·m`` (+ ``H·D²`` for BL) per layer.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...checks import check_int
from ...design import BAYESIAN, DELTANET, GATED_DELTANET, GLA, LINEAR_ATTENTION, lowrank_diagonal
from ...layers.common import decay_log
from ...ops.flops import FlopCount, Tally, chunk_flops

CORE_KINDS = ("bayesian", "delta", "linear_attention", "gla")
# cores beyond the paper's four: selectable, not run by default
EXTRA_CORE_KINDS = ("gated_deltanet",)
# the low-rank-plus-diagonal BL at these ranks (head_dim 16); selectable, not run by default
LOWRANK_RANKS = (0, 1, 2, 4, 8, 16)
LOWRANK_KINDS = tuple(f"bayesian_lowrank{r}" for r in LOWRANK_RANKS)
# The paper's cores (``--core paper``): BL and the reset (Delta) core with per-head learnable scalar noise
# levels instead of our per-token maps from the residual stream; see :class:`CoreMixer`.
PAPER_CORE_KINDS = {"bayesian": "bayesian_paper", "delta": "delta_paper"}
PAPER_RESET_LAM = 0.05  # the reset core's fixed prior λ = ℓ² (the paper's appendix value)
# The GDN core's step size Δ = softplus(dt_bias) at initialisation (with A = 1): α ≈ exp(−1e-5) per token, so the
# core starts as the Delta core (A_t = I, where BL and Delta stay) and keeps ≈ 98% of a target over the ≈ 2,100
# tokens between its write and its query at n_f = 256.  GDN's language-model initialisation (A ~ U(0, 16),
# Δ log-uniform in [1e-3, 0.1], so α from ≈ 0.2 to ≈ 1) would start it forgetting the targets over the long
# distractor runs, the failure that made BL's core go without decay (see CoreMixer).  The gate stays learnable.
GDN_INIT_STEP = 1e-5
ALL_KINDS = CORE_KINDS + EXTRA_CORE_KINDS + LOWRANK_KINDS + tuple(PAPER_CORE_KINDS.values())
# labels of the recurrent-core kinds (no q/k projections), not of registry mixers (bayeslayer.layers.MIXER_LABELS)
CORE_LABELS = {"bayesian": "BL", "delta": "Delta-style", "linear_attention": "LA-style", "gla": "GLA-style",
               "gated_deltanet": "GDN-style",
               **{f"bayesian_lowrank{r}": f"BL r={r}" for r in LOWRANK_RANKS},
               "bayesian_paper": "BL (paper)", "delta_paper": "Delta (paper)"}


def paper_core_kind(kind: str) -> str:
    """The ``--core paper`` version of ``kind`` (``bayesian`` → ``bayesian_paper``, ``delta`` → ``delta_paper``)."""
    if kind not in PAPER_CORE_KINDS:
        raise ValueError(f"--core paper has a paper core only for {sorted(PAPER_CORE_KINDS)}, got model {kind!r}")
    return PAPER_CORE_KINDS[kind]


def _softplus_inverse(y: float) -> float:
    return math.log(math.expm1(y))


@dataclass(frozen=True)
class CoreModelConfig:
    """Sizes of a recurrent-core-only model.

    ``address_start`` / ``address_dim``: where the address sits in the input features
    (``x[..., address_start : address_start + address_dim]``); ``address_dim`` must equal
    ``head_dim`` because the address *is* the key and query of every head.
    """

    kind: str
    input_dim: int
    num_classes: int
    address_start: int
    address_dim: int = 16
    num_layers: int = 2
    width: int = 64
    num_heads: int = 4
    head_dim: int = 16
    p0: float = 1.0
    chunk_size: int = 16  # measured fastest on CPU for these short heads (D = m = 16)

    def __post_init__(self):
        if self.kind not in ALL_KINDS:
            raise ValueError(f"kind must be one of {ALL_KINDS}, got {self.kind!r}")
        if self.kind in LOWRANK_KINDS and int(self.kind[len("bayesian_lowrank"):]) > self.head_dim:
            raise ValueError(f"kind {self.kind!r}: rank must be <= head_dim = {self.head_dim}")
        for name in ("input_dim", "num_classes", "address_dim", "num_layers", "width", "num_heads",
                     "head_dim", "chunk_size"):
            check_int(name, getattr(self, name), minimum=1)
        if self.address_dim != self.head_dim:
            raise ValueError(
                f"address_dim ({self.address_dim}) must equal head_dim ({self.head_dim}): the address is "
                "the key and query of every head, with no projection"
            )
        if not (0 <= self.address_start and self.address_start + self.address_dim <= self.input_dim):
            raise ValueError(
                f"address slice [{self.address_start}, {self.address_start + self.address_dim}) does not fit "
                f"in input_dim={self.input_dim}"
            )
        if not (self.p0 > 0):
            raise ValueError(f"p0 must be > 0, got {self.p0}")


class CoreMixer(nn.Module):
    """One recurrent core: keys = queries = the address; value and noise/decay maps are learned."""

    def __init__(self, cfg: CoreModelConfig):
        super().__init__()
        self.kind = cfg.kind
        self.H, self.D, self.m = cfg.num_heads, cfg.head_dim, cfg.head_dim
        self.p0 = cfg.p0
        self.chunk_size = cfg.chunk_size
        W, H = cfg.width, cfg.num_heads
        self.value = nn.Linear(W, H * self.m)
        self.out = nn.Linear(H * self.m, W)
        self.design = BAYESIAN
        if self.kind in LOWRANK_KINDS:
            self.design = lowrank_diagonal(int(self.kind[len("bayesian_lowrank"):]))
        if self.kind in PAPER_CORE_KINDS.values():
            self._init_paper_core(H)
        elif self.kind.startswith("bayesian"):
            self.r2 = nn.Linear(W, H)
            self.ell2 = nn.Linear(W, H)
            # No decay: a learned α_t I with α ≈ 0.98 at init forgot targets over the long distractor
            # runs of the tests (0.98^512 ≈ 3e-5) in a first trial; ℓ² alone restores plasticity.
            nn.init.constant_(self.r2.bias, -1.0)  # softplus(-1) ≈ 0.31
            nn.init.constant_(self.ell2.bias, -4.0)  # softplus(-4) ≈ 0.018
        elif self.kind == "gla":
            self.coef = nn.Linear(W, H)
            self.decay = nn.Linear(W, H * self.D)
        elif self.kind == "gated_deltanet":
            self.coef = nn.Linear(W, H)
            # GDN's gate: a bias-free map, then α = exp(−exp(A_log)·softplus(· + dt_bias)), per head
            self.a_proj = nn.Linear(W, H, bias=False)
            self.A_log = nn.Parameter(torch.zeros(H))  # A = 1
            self.dt_bias = nn.Parameter(torch.full((H,), _softplus_inverse(GDN_INIT_STEP)))
            self.A_log._no_weight_decay = True  # the recurrence's own parameters, as in the GDN layer
            self.dt_bias._no_weight_decay = True
        else:
            self.coef = nn.Linear(W, H)

    def _init_paper_core(self, H: int) -> None:
        """The paper's cores: one learnable scalar per head for each noise level, the same for every token.

        ``bayesian_paper``: ``r_h² = softplus(a_h) + 1e-4``, ``ℓ_h² = softplus(b_h) + 1e-6`` (initialised at
        our per-token maps' initial values, 0.31 and 0.018).  ``delta_paper``: the reset write with its
        prior fixed at ``λ = ℓ² = 0.05`` and a learnable ``r_h² = softplus(a_h) + 1e-4``, so its gain is
        ``η_h = λ/(r_h² + λ‖k‖²)`` (initialised at ``r² = 0.05``: gain 0.5 for a unit key).
        """
        if self.kind == "bayesian_paper":
            self.r2_head = nn.Parameter(torch.full((H,), -1.0))  # softplus(-1) ≈ 0.31
            self.ell2_head = nn.Parameter(torch.full((H,), -4.0))  # softplus(-4) ≈ 0.018
        else:
            self.r2_head = nn.Parameter(torch.full((H,), _softplus_inverse(PAPER_RESET_LAM - 1e-4)))

    def _paper_noise(self, h: torch.Tensor) -> dict[str, torch.Tensor]:
        B, T, _ = h.shape
        r2 = (F.softplus(self.r2_head) + 1e-4).expand(B, T, self.H)
        if self.kind == "delta_paper":
            return {"r2": r2, "lam": torch.full_like(r2, PAPER_RESET_LAM)}
        return {"r2": r2, "ell2": (F.softplus(self.ell2_head) + 1e-6).expand(B, T, self.H)}

    def _noise(self, h: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.kind == "bayesian_paper":
            return self._paper_noise(h)
        return {"r2": F.softplus(self.r2(h)) + 1e-4, "ell2": F.softplus(self.ell2(h)) + 1e-6}

    def predictive_variance(self, h: torch.Tensor, address: torch.Tensor) -> torch.Tensor:
        """The BL kinds' predictive variance ``1 + q_tᵀ P_t q_t`` ``[B, T, H]`` for the inputs of :meth:`forward`
        (the filter run again with ``return_variance``; the output is unchanged)."""
        if not self.kind.startswith("bayesian"):
            raise ValueError(f"kind {self.kind!r} has no covariance and so no predictive variance")
        B, T, _ = h.shape
        qk = address.unsqueeze(2).expand(B, T, self.H, self.D)
        v = self.value(h).view(B, T, self.H, self.m)
        out = self.design.chunk(qk, qk, v, **self._noise(h), p0=self.p0, chunk_size=self.chunk_size,
                                return_variance=True)
        return out.variance.reshape(B, T, self.H, -1).mean(-1)

    def flops(self, batch_size: int, seq_len: int) -> FlopCount:
        """FLOPs of a training step through this core (:mod:`bayeslayer.ops.flops`): the value, noise or gain
        maps, the filter (the address is a fixed input: keys and queries need no gradient) and ``out``."""
        t = Tally()
        tokens, W = batch_size * seq_len, self.value.in_features
        t.linear(tokens, W, self.H * self.m)
        maps = [mod for mod in (getattr(self, name, None) for name in ("r2", "ell2", "coef", "decay", "a_proj"))
                if isinstance(mod, nn.Linear)]
        for mod in maps:
            t.linear(tokens, W, mod.out_features)
        t.linear(tokens, self.H * self.m, W)
        if self.kind.startswith("bayesian"):
            write, dynamics = self.design.write, "identity"
        elif self.kind in ("delta", "delta_paper"):
            write, dynamics = "reset", "identity"
        elif self.kind == "gated_deltanet":
            write, dynamics = "reset", "scalar"
        else:
            write, dynamics = "latent", "diagonal" if self.kind == "gla" else "identity"
        return t.count() + chunk_flops(write, dynamics, batch_size=batch_size, seq_len=seq_len, num_heads=self.H,
                                       key_dim=self.D, value_dim=self.m, chunk_size=self.chunk_size,
                                       rank=self.design.rank if write == "lowrank" else None, qk_grad=False)

    def forward(self, h: torch.Tensor, address: torch.Tensor) -> torch.Tensor:
        """``h``: ``[B, T, width]``, ``address``: ``[B, T, D]`` (unit rows) → ``[B, T, width]``."""
        B, T, _ = h.shape
        qk = address.unsqueeze(2).expand(B, T, self.H, self.D)
        v = self.value(h).view(B, T, self.H, self.m)
        if self.kind.startswith("bayesian"):
            out = self.design.chunk(qk, qk, v, **self._noise(h), p0=self.p0, chunk_size=self.chunk_size)
        elif self.kind == "delta_paper":
            out = DELTANET.chunk(qk, qk, v, **self._paper_noise(h), chunk_size=self.chunk_size)
        elif self.kind == "delta":
            beta = torch.sigmoid(self.coef(h)).clamp(min=1e-6)
            out = DELTANET.chunk(qk, qk, v, gain=beta, chunk_size=self.chunk_size)
        elif self.kind == "gated_deltanet":
            beta = torch.sigmoid(self.coef(h)).clamp(min=1e-6)
            alpha = torch.exp(decay_log(self.a_proj(h), self.A_log, self.dt_bias)[..., 0])  # [B, T, H]
            out = GATED_DELTANET.chunk(qk, qk, v, gain=beta, alpha=alpha, chunk_size=self.chunk_size)
        elif self.kind == "linear_attention":
            omega = torch.sigmoid(self.coef(h)).clamp(min=1e-6)
            out = LINEAR_ATTENTION.chunk(qk, qk, v, gain=omega, chunk_size=self.chunk_size)
        else:
            omega = torch.sigmoid(self.coef(h)).clamp(min=1e-6)
            # GLA's gate: log α = logσ(z)/16 keeps decays near 1 at initialisation.
            alpha = torch.exp(F.logsigmoid(self.decay(h)) / 16.0).view(B, T, self.H, self.D)
            out = GLA.chunk(qk, qk, v, gain=omega, alpha=alpha, chunk_size=self.chunk_size)
        return self.out(out.o.reshape(B, T, self.H * self.m))


class CoreBlock(nn.Module):
    def __init__(self, cfg: CoreModelConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.width)
        self.mixer = CoreMixer(cfg)
        self.norm2 = nn.LayerNorm(cfg.width)
        W = cfg.width
        self.mlp = nn.Sequential(nn.Linear(W, 2 * W), nn.GELU(), nn.Linear(2 * W, W))

    def forward(self, h: torch.Tensor, address: torch.Tensor) -> torch.Tensor:
        h = h + self.mixer(self.norm1(h), address)
        return h + self.mlp(self.norm2(h))

    def flops(self, batch_size: int, seq_len: int) -> FlopCount:
        t = Tally()
        W = self.mlp[0].in_features
        t.linear(batch_size * seq_len, W, 2 * W)
        t.linear(batch_size * seq_len, 2 * W, W)
        return self.mixer.flops(batch_size, seq_len) + t.count()


class CoreModel(nn.Module):
    """Input features ``[B, T, input_dim]`` → logits ``[B, T, num_classes]``; see the module docstring."""

    def __init__(self, cfg: CoreModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Linear(cfg.input_dim, cfg.width)
        self.blocks = nn.ModuleList(CoreBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() != 3 or x.shape[-1] != cfg.input_dim:
            raise ValueError(f"x must be [B, T, input_dim={cfg.input_dim}], got {tuple(x.shape)}")
        address = x[..., cfg.address_start : cfg.address_start + cfg.address_dim]
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, address)
        return self.head(self.norm(h))

    def config_dict(self) -> dict:
        return asdict(self.cfg)

    def flops(self, batch_size: int, seq_len: int) -> FlopCount:
        """FLOPs of one training step (forward and backward) on ``[batch_size, seq_len]`` inputs: the input map
        (its input needs no gradient), every block and the head, by :mod:`bayeslayer.ops.flops`' convention."""
        B = check_int("batch_size", batch_size, minimum=1)
        T = check_int("seq_len", seq_len, minimum=1)
        cfg, t = self.cfg, Tally()
        t.linear(B * T, cfg.input_dim, cfg.width, grad_input=False)
        t.linear(B * T, cfg.width, cfg.num_classes)
        count = t.count()
        for block in self.blocks:
            count = count + block.flops(B, T)
        return count


def build_core_model(
    kind: str, *, input_dim: int, num_classes: int, address_start: int, **sizes
) -> CoreModel:
    """Build a :class:`CoreModel` (``sizes``: any other :class:`CoreModelConfig` field)."""
    return CoreModel(CoreModelConfig(kind=kind, input_dim=input_dim, num_classes=num_classes,
                                     address_start=address_start, **sizes))
