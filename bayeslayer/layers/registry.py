"""The mixer registry: one table of ``name -> (class, label)``, filled by :func:`register_mixer`.

A mixer is registered with one call that carries everything known about it by name: the class that
:func:`build_mixer` constructs and the label tables and plot legends print (the paper's abbreviation).
:data:`MIXERS` (name -> class) and :data:`MIXER_LABELS` (name -> label) are read-only views of the
same table, so the two can never disagree or list different names.

>>> from bayeslayer.layers import MIXER_LABELS, MIXERS
>>> MIXERS["bayesian"].__name__, MIXER_LABELS["bayesian"]
('BayesianLayer', 'BL')
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch.nn as nn


class RegisteredMixer(NamedTuple):
    """One registry entry: the class :func:`build_mixer` builds, and its name in tables and legends."""

    cls: type[nn.Module]
    label: str


#: the one table of registered mixers, in registration order; fill it with :func:`register_mixer`
MIXER_REGISTRY: dict[str, RegisteredMixer] = {}


class _RegistryView(Mapping):
    """A read-only ``{name: field}`` view of :data:`MIXER_REGISTRY` (register with :func:`register_mixer`)."""

    def __init__(self, field: str, what: str) -> None:
        self._field = field
        self._what = what

    def __getitem__(self, name: str) -> Any:
        return getattr(MIXER_REGISTRY[name], self._field)

    def __iter__(self) -> Iterator[str]:
        return iter(MIXER_REGISTRY)

    def __len__(self) -> int:
        return len(MIXER_REGISTRY)

    def __repr__(self) -> str:
        return f"<{self._what}: {dict(self)!r}>"


#: ``{name: mixer class}`` of every registered mixer (a read-only view of :data:`MIXER_REGISTRY`)
MIXERS: Mapping[str, type[nn.Module]] = _RegistryView("cls", "registered mixers")
#: ``{name: label}``: each registered mixer's name in tables and plot legends (the paper's abbreviations);
#: experiments that run something other than a registered mixer label it themselves
MIXER_LABELS: Mapping[str, str] = _RegistryView("label", "mixer labels")


def register_mixer(name: str, cls: type[nn.Module], *, label: str) -> type[nn.Module]:
    """Register mixer class ``cls`` as ``name``, shown as ``label`` in tables and legends; returns ``cls``.

    From then on :func:`build_mixer`, the language model's per-layer ``mixer`` names and every
    command-line ``--mixer`` find it by name.  A name or a label already taken raises ``ValueError``
    (two mixers with one legend entry could not be told apart).
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name must be a mixer name (letters, digits, underscores), got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"cls must be a torch.nn.Module subclass, got {cls!r}")
    if not isinstance(label, str) or not label.strip():
        raise ValueError(f"label must be a non-empty string, got {label!r}")
    if name in MIXER_REGISTRY:
        raise ValueError(f"mixer {name!r} is already registered ({MIXER_REGISTRY[name].cls.__name__})")
    taken = [other for other, entry in MIXER_REGISTRY.items() if entry.label == label]
    if taken:
        raise ValueError(f"label {label!r} is already the label of mixer {taken[0]!r}")
    MIXER_REGISTRY[name] = RegisteredMixer(cls, label)
    return cls


def build_mixer(name: str, hidden_size: int, **kwargs) -> nn.Module:
    """Build the mixer registered as ``name`` (see :data:`MIXERS`) with its constructor's keywords."""
    if not isinstance(name, str) or name not in MIXER_REGISTRY:
        raise ValueError(f"unknown mixer {name!r}; known mixers: {sorted(MIXER_REGISTRY)}")
    return MIXER_REGISTRY[name].cls(hidden_size, **kwargs)


__all__ = ["MIXERS", "MIXER_LABELS", "MIXER_REGISTRY", "RegisteredMixer", "build_mixer", "register_mixer"]
