"""Layer swapping for the retrofit experiment (docs/theory.md §8.6): GDN layers → Bayesian Layers.

A Bayesian Layer keeps the Gated DeltaNet layer's projections under the same names
(``q_proj, k_proj, v_proj, a_proj, A_log, dt_bias, {q,k,v}_conv1d, g_proj, o_norm,
o_proj``), so the teacher's weights initialise them; only the write model changes
(GDN's ``β = sigmoid(b_proj x)`` gives way to the Kalman gain from the noise maps
``r2_proj``/``ell2_proj`` and the covariance).
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .modeling import BayesLayerForCausalLM

# The parameters a Gated DeltaNet mixer shares with a Bayesian Layer (by name prefix).
SHARED_PREFIXES = ("q_proj.", "k_proj.", "v_proj.", "a_proj.", "A_log", "dt_bias",
                   "q_conv1d.", "k_conv1d.", "v_conv1d.", "g_proj.", "o_norm.", "o_proj.")
_GDN_MIXERS = ("gated_deltanet", "gated_deltanet_noconv")
_INIT_FROM = ("teacher", "scratch")


def _check_indices(indices: Any, num_layers: int) -> list[int]:
    if isinstance(indices, numbers.Integral) and not isinstance(indices, bool):
        indices = [indices]
    if not isinstance(indices, Iterable) or isinstance(indices, (str, bytes)):
        raise TypeError(f"indices must be an int or a list of ints, got {type(indices).__name__}")
    out = list(indices)
    if not out:
        raise ValueError("indices is empty: name at least one layer to replace")
    bad = [i for i in out if not isinstance(i, numbers.Integral) or isinstance(i, bool)]
    if bad:
        raise TypeError(f"indices must be ints, got {bad!r}")
    out = [int(i) for i in out]
    out_of_range = [i for i in out if not 0 <= i < num_layers]
    if out_of_range:
        raise ValueError(f"layer indices {out_of_range} are out of range for a model of {num_layers} layers")
    if len(set(out)) != len(out):
        raise ValueError(f"indices has duplicates: {out}")
    return sorted(out)


def replace_layers(
    model: BayesLayerForCausalLM,
    indices: int | Iterable[int],
    mixer: str = "bayesian",
    init_from: str = "teacher",
    **mixer_kwargs: Any,
) -> dict[int, list[str]]:
    """Swap the mixers of layers ``indices`` for new ``mixer`` layers (in place).

    The new mixer gets the model's ``num_heads``/``head_dim``, the replaced mixer's
    configured ``expand_v``, ``conv_size``, ``norm_eps`` and ``use_gate`` where the new
    mixer takes them (a ``gated_deltanet_noconv`` teacher gives ``use_short_conv=False``),
    ``config.mixer_kwargs[mixer]``, then ``mixer_kwargs``.  With
    ``init_from="teacher"`` every parameter whose name is in :data:`SHARED_PREFIXES`
    is copied from the replaced mixer (shapes must match); ``"scratch"`` keeps the
    new mixer's own initialisation.  The config is updated so that
    ``save_pretrained``/``from_pretrained`` rebuild the hybrid.

    Returns ``{layer index: [names of the copied parameters]}``.  Other layers, the
    embeddings and all MLPs are untouched.
    """
    from ..layers import MIXER_REGISTRY, MIXERS, build_mixer

    if not isinstance(model, BayesLayerForCausalLM):
        raise TypeError(f"model must be a BayesLayerForCausalLM, got {type(model).__name__}")
    if mixer not in MIXERS:
        raise ValueError(f"unknown mixer {mixer!r}; known mixers: {sorted(MIXERS)}")
    if init_from not in _INIT_FROM:
        raise ValueError(f"init_from must be one of {_INIT_FROM}, got {init_from!r}")
    reserved = {"hidden_size", "layer_idx"} & set(mixer_kwargs)
    if reserved:
        raise ValueError(f"mixer_kwargs may not set {sorted(reserved)}: they come from the model")
    config = model.config
    layers = model.model.layers
    idxs = _check_indices(indices, len(layers))
    names = config.layer_mixers
    if init_from == "teacher":
        not_gdn = {i: names[i] for i in idxs if names[i] not in _GDN_MIXERS}
        if not_gdn:
            raise ValueError(
                f"init_from='teacher' needs Gated DeltaNet layers to copy from; layers {not_gdn} are not"
            )

    copied: dict[int, list[str]] = {}
    new_layer_kwargs: dict[int, dict] = {}
    for i in idxs:
        old = layers[i].attn
        old_name, old_kwargs = config.mixer_arguments(i)
        kwargs = {"num_heads": config.num_heads, "head_dim": config.head_dim}
        if old_name in _GDN_MIXERS:
            inherited = {k: old_kwargs[k] for k in ("expand_v", "conv_size", "norm_eps", "use_gate")
                         if k in old_kwargs}
            inherited.update(MIXER_REGISTRY[old_name].defaults)  # a variant's settings (the conv-free GDN's)
            kwargs.update(_accepted(MIXERS[mixer], inherited))
        kwargs.update(config.mixer_kwargs.get(mixer, {}))
        kwargs.update(mixer_kwargs)
        new = build_mixer(mixer, config.hidden_size, layer_idx=i, **kwargs)
        reference = next(old.parameters(), None)
        if reference is not None:
            new = new.to(device=reference.device, dtype=reference.dtype)
        copied[i] = _copy_shared(old, new, i) if init_from == "teacher" else []
        for part in new.modules():
            part._bayeslayer_mixer_part = True
        new.train(old.training)
        layers[i].attn = new
        layers[i].mixer_name = mixer
        new_layer_kwargs[i] = {k: v for k, v in kwargs.items() if k not in ("num_heads", "head_dim")}

    # Record the hybrid in the config: explicit per-layer names and this call's kwargs.
    for i in idxs:
        names[i] = mixer
    config.mixers = names
    config.mixer_overrides = {}
    config.layer_mixer_kwargs = {**config.layer_mixer_kwargs, **new_layer_kwargs}
    return copied


def _accepted(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``kwargs`` that ``cls.__init__`` names (all of them if it takes ``**kwargs``)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


def _copy_shared(old: nn.Module, new: nn.Module, layer_idx: int) -> list[str]:
    old_params = dict(old.named_parameters())
    new_params = dict(new.named_parameters())
    shared = [n for n in new_params if n.startswith(SHARED_PREFIXES)]
    absent = [n for n in shared if n not in old_params]
    mismatched = [f"{n}: teacher {tuple(old_params[n].shape)} vs new {tuple(new_params[n].shape)}"
                  for n in shared if n in old_params and old_params[n].shape != new_params[n].shape]
    if absent or mismatched:
        raise ValueError(
            f"layer {layer_idx}: cannot initialise from the teacher; missing in the teacher: {absent}; "
            f"shape mismatches: {mismatched} (build the new mixer with the teacher's expand_v/conv settings)"
        )
    with torch.no_grad():
        for n in shared:
            new_params[n].copy_(old_params[n])
    return shared
