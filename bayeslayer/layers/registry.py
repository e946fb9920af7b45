"""The mixer registry: one table of everything known about a mixer by name, filled by :func:`register_mixer`.

A mixer is registered with one call that carries it all: the class that :func:`build_mixer` constructs,
the label tables and plot legends print (the paper's abbreviation), the constructor keywords the name
fixes (``defaults``), its named variants (the same class with other fixed keywords and a label of their
own: ``gated_deltanet_noconv`` is GDN without its short convolutions) and its state-budget rule
(``budget``: how :mod:`bayeslayer.models.state_budget` sizes it at a per-layer state budget).
:data:`MIXERS` (name -> class) and :data:`MIXER_LABELS` (name -> label) are read-only views of the
same table, so they can never disagree or list different names.

>>> from bayeslayer.layers import MIXER_LABELS, MIXER_REGISTRY, MIXERS
>>> MIXERS["bayesian"].__name__, MIXER_LABELS["bayesian"], MIXER_REGISTRY["bayesian"].budget
('BayesianLayer', 'BL', 'heads')
>>> MIXER_REGISTRY["gated_deltanet_noconv"].base, dict(MIXER_REGISTRY["gated_deltanet_noconv"].defaults)
('gated_deltanet', {'use_short_conv': False})
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch.nn as nn

#: the state-budget rules a mixer can carry (:mod:`bayeslayer.models.state_budget`): ``heads`` — the model
#: width is split over heads of key dim ``D`` and the value dim fills the budget (every key-projection
#: mixer); ``ssd`` — Mamba-2's shape, heads of ``head_dim`` channels over ``expand·width`` with ``d_state``
#: filling the budget.  A mixer without a rule (``budget=None``: attention) is not sized.
BUDGET_RULES = ("heads", "ssd")


class RegisteredMixer(NamedTuple):
    """One registry entry.

    Attributes:
        cls: the class :func:`build_mixer` builds.
        label: the name in tables and legends.
        defaults: constructor keywords this name fixes (a caller passing another value is refused).
        budget: the state-budget rule (:data:`BUDGET_RULES`), or ``None``.
        base: the mixer this entry is a variant of (``None`` for a mixer registered on its own).
    """

    cls: type[nn.Module]
    label: str
    defaults: Mapping[str, Any] = MappingProxyType({})
    budget: str | None = None
    base: str | None = None


#: the one table of registered mixers, in registration order (a mixer's variants right after it);
#: fill it with :func:`register_mixer`
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


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name must be a mixer name (letters, digits, underscores), got {name!r}")
    if name in MIXER_REGISTRY:
        raise ValueError(f"mixer {name!r} is already registered ({MIXER_REGISTRY[name].cls.__name__})")


def _check_label(label: Any, taken: dict[str, str], what: str = "label") -> None:
    if not isinstance(label, str) or not label.strip():
        raise ValueError(f"{what} must be a non-empty string, got {label!r}")
    if label in taken:
        raise ValueError(f"{what} {label!r} is already the label of mixer {taken[label]!r}")


def _check_keywords(what: str, keywords: Any) -> dict[str, Any]:
    if keywords is None:
        return {}
    if not isinstance(keywords, Mapping) or not all(isinstance(k, str) and k.isidentifier() for k in keywords):
        raise TypeError(f"{what} must be a mapping of constructor keyword names to values, got {keywords!r}")
    return dict(keywords)


def register_mixer(name: str, cls: type[nn.Module], *, label: str, defaults: Mapping[str, Any] | None = None,
                   variants: Mapping[str, tuple[str, Mapping[str, Any]]] | None = None,
                   budget: str | None = None) -> type[nn.Module]:
    """Register mixer class ``cls`` as ``name``, shown as ``label`` in tables and legends; returns ``cls``.

    Args:
        name: the mixer's name (an identifier).
        cls: a ``torch.nn.Module`` subclass taking ``(hidden_size, **keywords)``.
        label: its name in tables and legends (unique: two mixers with one legend entry could not be told
            apart).
        defaults: constructor keywords the name fixes; :func:`build_mixer` passes them and refuses a
            caller's other value for one of them.
        variants: ``{variant name: (label, keywords)}``: further names for ``cls`` with these keywords
            fixed on top of ``defaults`` (``{"bayesian_noconv": ("BL (no conv)", {"use_short_conv": False})}``),
            registered right after ``name`` with its ``budget`` rule.
        budget: the state-budget rule (:data:`BUDGET_RULES`: ``"heads"`` or ``"ssd"``), or ``None`` for a
            mixer the state-budget solver does not size.  With a rule, the solver counts the mixer's state
            with its class's ``design.state_size`` and ``bayeslayer mqar`` sizes and builds it.

    From then on :func:`build_mixer`, the language model's per-layer ``mixer`` names and every
    command-line ``--mixer`` find it (and its variants) by name.  A name or a label already taken raises
    ``ValueError``; nothing is registered unless every entry of the call is valid.
    """
    _check_name(name)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"cls must be a torch.nn.Module subclass, got {cls!r}")
    taken = {entry.label: other for other, entry in MIXER_REGISTRY.items()}
    _check_label(label, taken)
    defaults = _check_keywords("defaults", defaults)
    if budget is not None and budget not in BUDGET_RULES:
        raise ValueError(f"budget must be one of {BUDGET_RULES} or None, got {budget!r}")
    if variants is not None and not isinstance(variants, Mapping):
        raise TypeError(f"variants must be a mapping {{name: (label, keywords)}}, got {type(variants).__name__}")
    entries = {name: RegisteredMixer(cls, label, MappingProxyType(defaults), budget)}
    taken[label] = name
    for variant, spec in (variants or {}).items():
        _check_name(variant)
        if variant in entries:
            raise ValueError(f"variant {variant!r} repeats the mixer's name")
        if not isinstance(spec, tuple) or len(spec) != 2:
            raise TypeError(f"variants[{variant!r}] must be a (label, keywords) pair, got {spec!r}")
        variant_label, keywords = spec
        _check_label(variant_label, taken, f"variants[{variant!r}] label")
        keywords = _check_keywords(f"variants[{variant!r}] keywords", keywords)
        entries[variant] = RegisteredMixer(cls, variant_label, MappingProxyType({**defaults, **keywords}), budget,
                                           base=name)
        taken[variant_label] = variant
    MIXER_REGISTRY.update(entries)
    return cls


def build_mixer(name: str, hidden_size: int, **kwargs) -> nn.Module:
    """Build the mixer registered as ``name`` (see :data:`MIXERS`) with its constructor's keywords.

    The keywords the name fixes (its ``defaults``, a variant's settings) are passed along; another value
    for one of them raises ``ValueError`` naming the mixer the caller may want instead."""
    if not isinstance(name, str) or name not in MIXER_REGISTRY:
        raise ValueError(f"unknown mixer {name!r}; known mixers: {sorted(MIXER_REGISTRY)}")
    entry = MIXER_REGISTRY[name]
    clash = {k: kwargs[k] for k, v in entry.defaults.items() if k in kwargs and kwargs[k] != v}
    if clash:
        instead = f"; use {entry.base} instead" if entry.base is not None else ""
        fixed = ", ".join(f"{k}={entry.defaults[k]!r}" for k in clash)
        got = ", ".join(f"{k}={v!r}" for k, v in clash.items())
        raise ValueError(f"mixer {name!r} fixes {fixed}, got {got}{instead}")
    return entry.cls(hidden_size, **{**kwargs, **entry.defaults})


__all__ = ["BUDGET_RULES", "MIXERS", "MIXER_LABELS", "MIXER_REGISTRY", "RegisteredMixer", "build_mixer",
           "register_mixer"]
