"""The MQAR model: token ids → logits through an embedding, mixer blocks and a head.

The model ``bayeslayer mqar`` trains (:mod:`bayeslayer.experiments.mqar`), in one of two layouts::

    h = Embedding(x)                                        x: [B, T] token ids
    stacked (today's default; num_layers mixer blocks, each the same mixer):
        h = h + mixer_l(LayerNorm(h))      ┐ l = 1..num_layers (paper: 2)
        h = h + MLP_l(LayerNorm(h))        ┘ only with mlp_mult > 0 (Zoology's default: none)
    hybrid (Zoology's standard MQAR model; blocks alternate, a short-conv block first):
        s_l = BaseConv (l odd) or mixer (l even)        l = 1..num_layers (Zoology: 2 = conv, mixer)
        h = h + s_l(LayerNorm(h))
        h = h + F_l(LayerNorm(h))          F_l = MLP_l with mlp_mult > 0, else the identity
        BaseConv(u) = conv_3(u) ⊙ (W u + b) + u          depthwise causal conv, kernel 3, with bias
    logits = W_head LayerNorm(h)                            [B, T, V]

The hybrid block is Zoology's ``TransformerBlock`` around ``Hybrid([BaseConv, mixer])``
(``zoology/model.py``, ``mixers/hybrid.py``, ``mixers/base_conv.py``, ``experiments/models_repo.py``):
block ``i`` holds ``configs[i mod 2]``, so ``n_layers = 2`` is one short-conv block then one mixer
block.  Its state mixer is ``torch.nn.Identity`` in the MQAR configs, and its fused residual
(``residual = hidden + residual`` at the next block) therefore adds ``LayerNorm(h)`` to the stream
after every block — reproduced here as ``F_l = identity``.  Not reproduced (the same in both layouts):
Zoology's embedding dropout 0.1, its head tied to the embedding without bias, and its N(0, 0.02)
initialisation.

Each mixer block is a registry mixer (:func:`~bayeslayer.layers.build_mixer`) built with
``config.mixer_kwargs``; what those are for each MQAR mixer name (state budget, output gate) is
:func:`bayeslayer.experiments.common.mqar_setup.model_config`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..checks import check_int
from ..layers import MIXERS, ShortConvolution, build_mixer
from ..ops.flops import FlopCount, Tally

#: the block layouts of :class:`MQARModel` (module docstring)
LAYOUTS = ("stacked", "hybrid")


@dataclass(frozen=True)
class MQARModelConfig:
    """Sizes of an :class:`MQARModel`; ``mixer_kwargs`` go to :func:`~bayeslayer.layers.build_mixer`.

    ``layout``: ``"stacked"`` or ``"hybrid"`` (module docstring); ``conv_size``: the hybrid layout's
    BaseConv kernel.
    """

    mixer: str
    vocab_size: int
    width: int
    num_layers: int = 2
    mlp_mult: int = 0
    mixer_kwargs: dict[str, Any] = field(default_factory=dict)
    layout: str = "stacked"
    conv_size: int = 3

    def __post_init__(self):
        if self.mixer not in MIXERS:
            raise ValueError(f"unknown mixer {self.mixer!r}; known: {sorted(MIXERS)}")
        for name in ("vocab_size", "width", "num_layers", "conv_size"):
            check_int(name, getattr(self, name), minimum=1)
        if not isinstance(self.mlp_mult, int) or isinstance(self.mlp_mult, bool) or self.mlp_mult < 0:
            raise ValueError(f"mlp_mult must be a non-negative integer (0 = no MLP), got {self.mlp_mult!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "hybrid" and self.num_layers < 2:
            raise ValueError(f"the hybrid layout needs num_layers >= 2 (a conv block, then a mixer block), "
                             f"got {self.num_layers}")


class BaseConv(nn.Module):
    """Zoology's short-convolution sequence mixer: ``y = conv_W(u) ⊙ (W u + b) + u``, ``u [B, T, d]``.

    ``conv_W`` is a depthwise causal convolution of width ``W`` (Zoology: 3) with a bias and no
    activation (:class:`~bayeslayer.layers.ShortConvolution`); ``W u + b`` a full ``d × d`` projection;
    the ``+ u`` is the block's own skip, on top of the residual stream's.  Parameters:
    ``d² + d`` (projection) ``+ W·d + d`` (convolution).
    """

    def __init__(self, width: int, kernel_size: int = 3):
        super().__init__()
        self.conv = ShortConvolution(width, kernel_size, bias=True, activation=None)
        self.projection = nn.Linear(width, width)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.conv(u)[0] * self.projection(u) + u

    def flops(self, batch_size: int, seq_len: int) -> FlopCount:
        """The convolution and the projection of a training step (:mod:`bayeslayer.ops.flops`)."""
        B = check_int("batch_size", batch_size, minimum=1)
        T = check_int("seq_len", seq_len, minimum=1)
        t = Tally()
        d = self.projection.in_features
        t.conv(B, d, T, self.conv.kernel_size[0])
        t.linear(B * T, d, d)
        return t.count()


class MQARModel(nn.Module):
    """Token ids ``[B, T]`` → logits ``[B, T, V]``: embedding, the blocks of ``config.layout``, head.

    See the module docstring for the equations.  Parameters: ``2·V·d + V`` (embedding, head) ``+ 2d``
    (final LayerNorm) plus, per block,

    * stacked: the mixer's (each mixer's docstring has its formula) ``+ 2d`` (its LayerNorm), and with
      an MLP ``2·mult·d² + (mult + 1)·d + 2d``;
    * hybrid: ``4d`` (two LayerNorms) plus the mixer's or :class:`BaseConv`'s parameters, and with an MLP
      ``2·mult·d² + (mult + 1)·d``.
    """

    def __init__(self, config: MQARModelConfig):
        super().__init__()
        if not isinstance(config, MQARModelConfig):
            raise TypeError(f"config must be an MQARModelConfig, got {type(config).__name__}")
        self.config = config
        d, L = config.width, config.num_layers
        self.embed = nn.Embedding(config.vocab_size, d)

        def mlp() -> nn.Module:
            hidden = config.mlp_mult * d
            return nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))

        if config.layout == "stacked":
            self.mixer_norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(L))
            self.mixers = nn.ModuleList(
                build_mixer(config.mixer, d, layer_idx=i, **config.mixer_kwargs) for i in range(L))
            if config.mlp_mult:
                self.mlp_norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(L))
                self.mlps = nn.ModuleList(mlp() for _ in range(L))
        else:
            # Zoology's Hybrid picks configs[layer_idx % 2]: even blocks convolve, odd blocks mix
            self.sequence_mixers = nn.ModuleList(
                BaseConv(d, config.conv_size) if i % 2 == 0
                else build_mixer(config.mixer, d, layer_idx=i, **config.mixer_kwargs) for i in range(L))
            self.norms1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(L))
            self.norms2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(L))
            self.state_mixers = nn.ModuleList(mlp() if config.mlp_mult else nn.Identity() for _ in range(L))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, config.vocab_size)

    def recurrent_mixers(self) -> list[nn.Module]:
        """The registry mixers of the model, in order (the hybrid layout's BaseConv blocks left out)."""
        if self.config.layout == "stacked":
            return list(self.mixers)
        return [m for m in self.sequence_mixers if not isinstance(m, BaseConv)]

    def state_size_per_layer(self) -> int:
        """Recurrent-state floats of one mixer layer (all heads)."""
        mixer = self.recurrent_mixers()[0]
        return mixer.state_size_per_head() * mixer.num_heads

    def flops(self, batch_size: int, seq_len: int) -> FlopCount:
        """FLOPs of one training step (forward and backward) on ``[batch_size, seq_len]`` token ids: every
        block's mixer (:meth:`~bayeslayer.layers.Mixer.flops`), BaseConv and MLP, and the head, by
        :mod:`bayeslayer.ops.flops`' convention (embedding lookups and LayerNorms are not counted)."""
        B = check_int("batch_size", batch_size, minimum=1)
        T = check_int("seq_len", seq_len, minimum=1)
        cfg, t = self.config, Tally()
        d = cfg.width
        blocks = self.mixers if cfg.layout == "stacked" else self.sequence_mixers
        count = FlopCount()
        for block in blocks:
            count = count + block.flops(B, T)
            if cfg.mlp_mult:
                t.linear(B * T, d, cfg.mlp_mult * d)
                t.linear(B * T, cfg.mlp_mult * d, d)
        t.linear(B * T, d, cfg.vocab_size)
        return count + t.count()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.int64:
            raise TypeError(f"input_ids must be an int64 tensor of token ids, got "
                            f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}")
        if input_ids.dim() != 2 or 0 in input_ids.shape:
            raise ValueError(f"input_ids must be a non-empty [B, T] tensor, got {tuple(input_ids.shape)}")
        V = self.config.vocab_size
        if bool((input_ids < 0).any()) or bool((input_ids >= V).any()):
            raise ValueError(f"input_ids must lie in [0, vocab_size={V}), got values in "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        h = self.embed(input_ids)
        if self.config.layout == "stacked":
            for i, mixer in enumerate(self.mixers):
                h = h + mixer(self.mixer_norms[i](h)).o
                if self.config.mlp_mult:
                    h = h + self.mlps[i](self.mlp_norms[i](h))
        else:
            for seq, norm1, norm2, state in zip(self.sequence_mixers, self.norms1, self.norms2,
                                                self.state_mixers, strict=True):
                y = seq(norm1(h))
                h = h + (y if isinstance(seq, BaseConv) else y.o)
                h = h + state(norm2(h))
        return self.head(self.norm(h))


__all__ = ["LAYOUTS", "BaseConv", "MQARModel", "MQARModelConfig"]
