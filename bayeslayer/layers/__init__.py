"""Token mixers (``nn.Module``): the Bayesian Layer and its baselines, chosen by name.

>>> from bayeslayer.layers import build_mixer
>>> mixer = build_mixer("bayesian", hidden_size=64, num_heads=2, head_dim=16)
>>> import torch
>>> out = mixer(torch.randn(1, 5, 64))
>>> tuple(out.o.shape)
(1, 5, 64)

Every mixer follows the contract in :mod:`bayeslayer.layers.base` (``forward(hidden_states,
attention_mask, state, use_cache, output_variance) -> MixerOutput``).  The recurrent mixers run a
:mod:`bayeslayer.design` filter; none has a recurrence of its own.
"""

from __future__ import annotations

import torch.nn as nn

from .additive import GLA, LinearAttention
from .attention import Attention
from .base import Mixer, MixerOutput, QKVMixer, RecurrentMixer
from .bayesian import BayesianLayer
from .common import GatedRMSNorm, ShortConvolution
from .delta import DeltaNet, GatedDeltaNet, GatedDeltaNetNoConv
from .mamba2 import Mamba2

MIXERS: dict[str, type[Mixer]] = {
    "bayesian": BayesianLayer,
    "gated_deltanet": GatedDeltaNet,
    "gated_deltanet_noconv": GatedDeltaNetNoConv,
    "deltanet": DeltaNet,
    "linear_attention": LinearAttention,
    "gla": GLA,
    "mamba2": Mamba2,
    "attention": Attention,
}
#: each registry mixer's name in tables and plot legends (the paper's abbreviations); experiments that
#: run something other than a registry mixer label it themselves
MIXER_LABELS: dict[str, str] = {
    "bayesian": "BL",
    "gated_deltanet": "GDN",
    "gated_deltanet_noconv": "GDN (no conv)",
    "deltanet": "DeltaNet",
    "linear_attention": "LA",
    "gla": "GLA",
    "mamba2": "Mamba-2",
    "attention": "Attention",
}


def build_mixer(name: str, hidden_size: int, **kwargs) -> nn.Module:
    """Build the mixer registered as ``name`` (see :data:`MIXERS`) with its constructor's keywords."""
    if not isinstance(name, str) or name not in MIXERS:
        raise ValueError(f"unknown mixer {name!r}; known mixers: {sorted(MIXERS)}")
    return MIXERS[name](hidden_size, **kwargs)


__all__ = [
    "GLA", "MIXERS", "MIXER_LABELS", "Attention", "BayesianLayer", "DeltaNet", "GatedDeltaNet", "GatedDeltaNetNoConv",
    "GatedRMSNorm", "LinearAttention", "Mamba2", "Mixer", "MixerOutput", "QKVMixer", "RecurrentMixer",
    "ShortConvolution", "build_mixer",
]
