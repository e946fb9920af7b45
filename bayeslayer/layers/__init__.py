"""Token mixers (``nn.Module``): the Bayesian Layer and its baselines, chosen by name.

>>> from bayeslayer.layers import build_mixer
>>> mixer = build_mixer("bayesian", hidden_size=64, num_heads=2, head_dim=16)
>>> import torch
>>> out = mixer(torch.randn(1, 5, 64))
>>> tuple(out.o.shape)
(1, 5, 64)

Every mixer follows the contract in :mod:`bayeslayer.layers.base` (``forward(hidden_states,
attention_mask, state, use_cache, output_variance) -> MixerOutput``).  The recurrent mixers run a
:mod:`bayeslayer.design` filter; none has a recurrence of its own.  A mixer is added with one
:func:`register_mixer` call (:mod:`bayeslayer.layers.registry`).
"""

from __future__ import annotations

from .additive import GatedLinearAttention, LinearAttention
from .attention import Attention
from .base import Mixer, MixerOutput, QKVMixer, RecurrentMixer
from .bayesian import BayesianLayer
from .common import GatedRMSNorm, ShortConvolution
from .delta import DeltaNet, GatedDeltaNet, GatedDeltaNetNoConv
from .mamba2 import Mamba2
from .registry import (
    BUDGET_RULES,
    MIXER_LABELS,
    MIXER_REGISTRY,
    MIXERS,
    RegisteredMixer,
    build_mixer,
    register_mixer,
)

# Each mixer is one registration: its name, class, label in tables and legends, state-budget rule and
# named variants (the same class with other fixed keywords: the conv-free layers).
_NO_CONV = {"use_short_conv": False}
register_mixer("bayesian", BayesianLayer, label="BL", budget="heads",
               variants={"bayesian_noconv": ("BL (no conv)", _NO_CONV)})
register_mixer("gated_deltanet", GatedDeltaNet, label="GDN", budget="heads",
               variants={"gated_deltanet_noconv": ("GDN (no conv)", _NO_CONV)})
register_mixer("deltanet", DeltaNet, label="DeltaNet", budget="heads",
               variants={"deltanet_noconv": ("DeltaNet (no conv)", _NO_CONV)})
register_mixer("linear_attention", LinearAttention, label="LA", budget="heads")
register_mixer("gla", GatedLinearAttention, label="GLA", budget="heads")
register_mixer("mamba2", Mamba2, label="Mamba-2", budget="ssd")
register_mixer("attention", Attention, label="Attention")

__all__ = [
    "BUDGET_RULES", "MIXERS", "MIXER_LABELS", "MIXER_REGISTRY", "Attention", "BayesianLayer", "DeltaNet",
    "GatedDeltaNet", "GatedDeltaNetNoConv", "GatedLinearAttention", "GatedRMSNorm", "LinearAttention", "Mamba2",
    "Mixer", "MixerOutput", "QKVMixer", "RecurrentMixer", "RegisteredMixer", "ShortConvolution", "build_mixer",
    "register_mixer",
]


def __getattr__(name: str):
    # ``GLA`` named both the design model (bayeslayer.design.GLA) and this package's layer; the layer is
    # GatedLinearAttention now (fla's name), and the old name is kept for one release
    if name == "GLA":
        import warnings

        warnings.warn("bayeslayer.layers.GLA is deprecated; the layer is GatedLinearAttention "
                      "(bayeslayer.design.GLA is the design model)", DeprecationWarning, stacklevel=2)
        return GatedLinearAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
