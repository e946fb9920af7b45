"""State-budget matching: head configurations whose recurrent state fits a per-layer float budget (docs/theory.md §8.4).

The MQAR comparison holds the recurrent state of every mixer layer to one
budget (8,192 floats in the paper), counted per layer as

====================================================  ==============================
mixer                                                 state floats per layer
====================================================  ==============================
``bayesian``                                          ``H·(D·m + G·D²)`` (mean + G covariances)
``diagonal_covariance``                               ``H·(D·m + G·D)``
``bayesian_lowrank`` (``rank=r``)                     ``H·(D·m + G·D·(r + 1))`` (mean + G precision
                                                      factors ``[υ, W]``, :mod:`bayeslayer.ops.bayesian_layer.lowrank`)
``deltanet``, ``gated_deltanet``,                     ``H·D·m``
``gated_deltanet_noconv``, ``kda``,
``linear_attention``, ``retnet``, ``gla``
``mamba2``                                            ``H·d_state·head_dim``
====================================================  ==============================

(short-convolution caches are not recurrent memory and are not counted.)

The rule, the same for every width and budget:

1. Key-projection mixers (all but ``mamba2``) split the model width over the
   heads: ``D = width / H`` for a head count ``H`` dividing ``width`` (or the
   given ``num_heads``).  The value dim is then the largest that fits:
   ``m = ⌊budget/(H·D)⌋`` for the ``H·D·m`` family — Gated DeltaNet *widens* its
   value dim to fill the budget — and, for the Bayesian Layer, the largest
   multiple of ``G`` with ``H·(D·m + G·D²) ≤ budget`` (the covariance is paid
   first, the mean gets the rest).
2. ``mamba2`` keeps its inner width ``expand·width`` (``expand = 2``) split into
   heads of ``head_dim`` channels, and fills the budget with the state size
   ``d_state = ⌊budget/(expand·width)⌋``.  In the design-model reading its key
   dim is ``d_state`` and its value dim ``head_dim``: :class:`HeadConfig` stores
   ``key_dim = d_state`` and ``value_dim = head_dim``.
3. Among admissible configurations the largest state wins; ties go to the head
   dim closest (in ratio) to ``target_head_dim`` (64), then to the larger one.
   Under this rule the state does not depend on ``H`` at all, only on whether
   ``H`` leaves room for ``m ≥ G``: since ``⌊⌊b/H⌋/(D·G)⌋ = ⌊b/(H·D·G)⌋``, every
   key-projection mixer carries ``width·G·⌊budget/(width·G)⌋`` floats
   (``G = 1`` without a covariance: the Bayesian Layer's covariance is paid for
   by a narrower value dim, not by a smaller state) and Mamba-2 carries
   ``d_inner·⌊budget/d_inner⌋``.  So the head count is set by the head-dim
   preference among the head counts that fit, and the usage is known in
   closed form: at the paper's 8,192 and any power-of-two width ≤ 4,096
   the budget is filled exactly, for every mixer.
4. The state must fit (``≤ budget``) and use at least ``min_usage`` (90%) of it;
   otherwise :func:`solve_state_budget` raises ``ValueError`` naming the budget,
   the mixer and the best it found.

>>> cfg = solve_state_budget(8192, 64, "bayesian")
>>> (cfg.num_heads, cfg.key_dim, cfg.value_dim, cfg.groups, cfg.state_size)
(1, 64, 64, 1, 8192)
>>> solve_state_budget(8192, 64, "gated_deltanet").value_dim  # D = 64 widened to m = 128
128
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from ..checks import check_int
from ..design import DesignModel, get_design, lowrank_diagonal
from ..layers import MIXER_REGISTRY

#: the mixers ``bayeslayer state-budget`` sizes by default, in its table's order: registry mixers with a
#: state-budget rule (``register_mixer(..., budget=)``) and the design models of :data:`SIZED_DESIGNS`
BUDGET_MIXERS = ("bayesian", "diagonal_covariance", "deltanet", "gated_deltanet", "gated_deltanet_noconv", "kda",
                 "linear_attention", "retnet", "gla", "mamba2")
#: design models with no layer of their own that the solver sizes as a key-projection layer of that design
SIZED_DESIGNS = ("diagonal_covariance", "kda", "retnet")
LOWRANK_MIXER = "bayesian_lowrank"
#: the paper's per-layer state budget in floats (a state size; the experiments' training budgets are steps)
PAPER_STATE_BUDGET = 8192
COVARIANCE_FORMS = ("bayes", "diagonal", "lowrank")  # the forms whose design carries a covariance (G counts)

_FORMULAS = {
    "bayes": "H·(D·m + G·D²)",
    "diagonal": "H·(D·m + G·D)",
    "lowrank": "H·(D·m + G·D·(r+1))",
    "mean": "H·D·m",
    "ssd": "H·d_state·head_dim",
}


def mixer_design(mixer: str, rank: int | None = None) -> DesignModel:
    """The design model whose ``state_size`` counts ``mixer``'s recurrent state: the registry layer's
    design (:data:`bayeslayer.layers.MIXERS`), else the design of that name
    (:func:`bayeslayer.design.get_design`); ``bayesian_lowrank`` is :func:`~bayeslayer.design.lowrank_diagonal`
    of ``rank``."""
    if mixer == LOWRANK_MIXER:
        return lowrank_diagonal(rank)
    entry = MIXER_REGISTRY.get(mixer)
    design = getattr(entry.cls, "design", None) if entry is not None else None
    return design if isinstance(design, DesignModel) else get_design(mixer)


def budget_rule(mixer) -> str | None:
    """How the solver sizes ``mixer``: ``"heads"`` (the width split over key-projection heads), ``"ssd"``
    (Mamba-2's shape) or ``"lowrank"`` (``bayesian_lowrank``); ``None`` for a name it does not size.  A
    registry mixer's rule is the one it was registered with (``register_mixer(..., budget=)``)."""
    if not isinstance(mixer, str):
        return None
    if mixer == LOWRANK_MIXER:
        return "lowrank"
    if mixer in MIXER_REGISTRY:
        return MIXER_REGISTRY[mixer].budget
    return "heads" if mixer in SIZED_DESIGNS else None


def sized_mixers() -> tuple[str, ...]:
    """Every name the solver sizes: :data:`BUDGET_MIXERS`, then any other registry mixer with a rule
    (the conv-free variants, a mixer registered later), then ``bayesian_lowrank``."""
    rest = tuple(n for n, entry in MIXER_REGISTRY.items() if entry.budget is not None and n not in BUDGET_MIXERS)
    return (*BUDGET_MIXERS, *rest, LOWRANK_MIXER)


def _known(mixer) -> bool:
    return budget_rule(mixer) is not None


def _form(mixer: str) -> str:
    """How the module table writes ``mixer``'s state: its write model with a covariance, ``mean``, or ``ssd``."""
    if budget_rule(mixer) == "ssd":
        return "ssd"
    design = mixer_design(mixer, 0)
    return design.write if design.has_covariance else "mean"


@dataclass(frozen=True)
class HeadConfig:
    """A mixer's head configuration and the recurrent state it carries.

    Attributes:
        mixer: mixer name (one of :func:`sized_mixers`).
        budget: the per-layer budget in floats.
        width: the model width it was solved for.
        num_heads: ``H``.
        key_dim: ``D`` per head (``mamba2``: ``d_state``).
        value_dim: ``m`` per head (``mamba2``: ``head_dim``).
        groups: ``G`` observation-noise groups (covariance blocks) per head; 1 without a covariance.
        rank: ``r`` of ``bayesian_lowrank`` (``None`` for every other mixer).
    """

    mixer: str
    budget: int
    width: int
    num_heads: int
    key_dim: int
    value_dim: int
    groups: int = 1
    rank: int | None = None

    @property
    def form(self) -> str:
        """``bayes``, ``diagonal``, ``lowrank``, ``mean`` or ``ssd``: the row of the module table."""
        return _form(self.mixer)

    @property
    def state_size(self) -> int:
        """Recurrent state floats per layer: ``H`` times the design model's ``state_size`` per head."""
        design = mixer_design(self.mixer, self.rank)
        return self.num_heads * design.state_size(self.key_dim, self.value_dim, self.groups)

    @property
    def usage(self) -> float:
        """``state_size / budget``."""
        return self.state_size / self.budget

    @property
    def value_expand(self) -> float:
        """``m / D``: how much the value dim is widened over the key dim (fla's ``expand_v``)."""
        return self.value_dim / self.key_dim

    @property
    def inner_width(self) -> int:
        """``H·D`` (key width), or ``H·head_dim`` (Mamba-2's ``d_inner = expand·width``)."""
        return self.num_heads * (self.value_dim if self.form == "ssd" else self.key_dim)

    def summary(self) -> str:
        """One line: sizes, the formula with numbers, and the budget used."""
        H, D, m, G = self.num_heads, self.key_dim, self.value_dim, self.groups
        if self.form == "ssd":
            sizes = f"H={H:<4} d_state={D:<4} head_dim={m:<4} expand={self.inner_width // self.width}"
            count = f"{H}·{D}·{m}"
        else:
            sizes = f"H={H:<4} D={D:<4} m={m:<4} G={G}"
            count = {
                "bayes": f"{H}·({D}·{m} + {G}·{D}²)",
                "diagonal": f"{H}·({D}·{m} + {G}·{D})",
                "lowrank": f"{H}·({D}·{m} + {G}·{D}·({self.rank}+1))",
                "mean": f"{H}·{D}·{m}",
            }[self.form]
        return (f"{self.mixer:<22} {sizes:<40} state {_FORMULAS[self.form]} = {count} = "
                f"{self.state_size} / {self.budget} ({100 * self.usage:.1f}%)")

    def to_dict(self) -> dict:
        """Fields plus ``state_size`` and ``usage``, for JSON results."""
        d = asdict(self)
        if self.rank is None:
            del d["rank"]  # only the low-rank BL has one
        return {**d, "state_size": self.state_size, "usage": self.usage}


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, in O(√n) steps (``n`` up to :data:`MAX_WIDTH`·expand)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


# The widest layer the search takes: far beyond any model, and small enough that the O(√width) search
# over head counts ends in well under a second.
MAX_WIDTH = 2**40


# -- candidates --------------------------------------------------------------------------------------
def _candidates(mixer: str, budget: int, width: int, num_heads: int | None, groups: int, expand: int,
                rank: int | None = None) -> list[HeadConfig]:
    """Every configuration the rule admits that fits the budget (usage not yet checked)."""
    form = _form(mixer)
    out = []
    if form == "ssd":
        inner = expand * width
        d_state = budget // inner
        heads = [num_heads] if num_heads is not None else _divisors(inner)
        for H in heads:
            if inner % H == 0 and d_state >= 1:
                out.append(HeadConfig(mixer, budget, width, H, d_state, inner // H, 1))
        return out
    heads = [num_heads] if num_heads is not None else _divisors(width)
    for H in heads:
        if width % H:
            continue
        D = width // H
        per_head = budget // H  # H·x ≤ budget ⟺ x ≤ ⌊budget/H⌋ for integer x
        if form == "lowrank" and rank > D:
            continue  # the rank cannot exceed this head dim
        if form == "mean":
            m, G = per_head // D, 1
        else:
            G = groups
            cov = {"bayes": G * D * D, "diagonal": G * D, "lowrank": G * D * ((rank or 0) + 1)}[form]
            m = max(per_head - cov, 0) // (D * G) * G  # the largest multiple of G that fits
        if m >= G:
            out.append(HeadConfig(mixer, budget, width, H, D, m, G, rank if form == "lowrank" else None))
    return out


def _preference(target_head_dim: int) -> Callable[[HeadConfig], tuple]:
    def key(c: HeadConfig) -> tuple:
        head_dim = c.value_dim if c.form == "ssd" else c.key_dim
        return (-c.state_size, abs(math.log(head_dim / target_head_dim)), -head_dim)

    return key


def solve_state_budget(
    budget: int,
    width: int,
    mixer: str,
    *,
    num_heads: int | None = None,
    groups: int = 1,
    min_usage: float = 0.9,
    target_head_dim: int = 64,
    expand: int = 2,
    rank: int | None = None,
) -> HeadConfig:
    """The head configuration of ``mixer`` at model ``width`` whose recurrent state best fills ``budget``.

    Follows the module's rule: ``D = width/H`` and the value dim widened to fill the budget (Mamba-2:
    ``d_state`` fills it), the largest state ``≤ budget`` wins, ties go to the head dim nearest
    ``target_head_dim``.

    Args:
        budget: per-layer state budget in floats (the paper: 8,192).
        width: model width (``d_model``).
        mixer: one of :func:`sized_mixers` (a registry mixer with a state-budget rule, a design of
            :data:`SIZED_DESIGNS`), or ``bayesian_lowrank`` with ``rank``.
        num_heads: fix ``H`` (must divide ``width``; Mamba-2: ``expand·width``) instead of searching it.
        groups: ``G`` covariance blocks per head for ``bayesian``/``diagonal_covariance`` (``m % G == 0``).
        min_usage: the least fraction of the budget the state must use, in (0, 1].
        target_head_dim: preferred head dim among equally full configurations.
        expand: Mamba-2's inner expansion (``d_inner = expand·width``).
        rank: ``bayesian_lowrank`` only (required there): the rank ``r`` of the precision factor;
            head dims below ``r`` are not admitted.

    Returns:
        :class:`HeadConfig` with ``state_size ≤ budget`` and ``usage ≥ min_usage``.

    Raises:
        ValueError: no configuration fits the budget, or none uses ``min_usage`` of it (the message
            names the budget, the mixer and the best configuration found); bad arguments.
    """
    budget = check_int("budget", budget, minimum=1)
    width = check_int("width", width, minimum=1, maximum=MAX_WIDTH)
    if not _known(mixer):
        raise ValueError(f"unknown mixer {mixer!r}; known: {', '.join(sized_mixers())}")
    if num_heads is not None:
        num_heads = check_int("num_heads", num_heads, minimum=1)
    groups = check_int("groups", groups, minimum=1)
    target_head_dim = check_int("target_head_dim", target_head_dim, minimum=1)
    expand = check_int("expand", expand, minimum=1)
    if isinstance(min_usage, bool) or not isinstance(min_usage, numbers.Real) or not 0 < min_usage <= 1:
        raise ValueError(f"min_usage must be a number in (0, 1], got {min_usage!r}")
    form = _form(mixer)
    if form == "lowrank":
        if rank is None:
            raise ValueError("mixer 'bayesian_lowrank' needs rank (an integer >= 0)")
        from ..ops.bayesian_layer.lowrank import check_rank

        rank = check_rank(rank)
    elif rank is not None:
        raise ValueError(f"rank applies only to mixer 'bayesian_lowrank', not {mixer!r}")
    if groups != 1 and form not in COVARIANCE_FORMS:
        raise ValueError(f"groups={groups} applies only to mixers with a covariance, not {mixer!r}")
    split = expand * width if form == "ssd" else width
    if num_heads is not None and split % num_heads:
        what = f"expand·width = {expand}·{width}" if form == "ssd" else f"width {width}"
        raise ValueError(f"num_heads={num_heads} does not divide the {what} of mixer {mixer!r}")

    found = _candidates(mixer, budget, width, num_heads, groups, expand, rank)
    where = f"a {mixer} layer (state {_FORMULAS[form]}" + (f", r = {rank}" if form == "lowrank" else "") + (
        f") at width {width}") + (
        f" with num_heads={num_heads}" if num_heads is not None else ""
    )
    if not found:
        raise ValueError(
            f"state budget {budget} floats cannot hold {where}: even the smallest configuration needs "
            f"{_smallest_state(mixer, width, num_heads, groups, expand, rank)} floats"
        )
    best = min(found, key=_preference(target_head_dim))
    if best.usage < min_usage:
        raise ValueError(
            f"state budget {budget} floats: the fullest configuration of {where} uses only "
            f"{best.state_size} floats ({100 * best.usage:.1f}% < min_usage {100 * min_usage:.0f}%): "
            f"{best.summary()}; pass a smaller min_usage or another width"
        )
    return best


def _smallest_state(mixer: str, width: int, num_heads: int | None, groups: int, expand: int,
                    rank: int | None = None) -> int:
    """The state of the smallest configuration the rule admits (value dim ``m = G`` or ``d_state = 1``)."""
    form = _form(mixer)
    if form == "ssd":
        return expand * width
    sizes = []
    for H in [num_heads] if num_heads is not None else _divisors(width):
        G = groups if form in COVARIANCE_FORMS else 1
        if form == "lowrank" and rank > width // H:
            continue
        sizes.append(HeadConfig(mixer, 1, width, H, width // H, G, G, rank if form == "lowrank" else None
                                ).state_size)
    return min(sizes) if sizes else 0


def match_state_budget(
    budget: int,
    width: int,
    mixers: Sequence[str] = BUDGET_MIXERS,
    *,
    print_fn: Callable[[str], None] | None = print,
    **kwargs,
) -> dict[str, HeadConfig]:
    """Solve every mixer at one budget and width, print the chosen sizes, return ``{mixer: HeadConfig}``.

    ``kwargs`` go to :func:`solve_state_budget` (``num_heads`` applies to every mixer). Raises the
    first mixer's ``ValueError`` when any mixer cannot meet the budget.
    """
    configs = {}
    for mixer in mixers:
        kw = dict(kwargs)
        form = _form(mixer) if _known(mixer) else None  # an unknown name: solve_state_budget says so
        if form not in COVARIANCE_FORMS:
            kw.pop("groups", None)  # G counts covariance blocks; the other mixers have none
        if form != "lowrank":
            kw.pop("rank", None)
        configs[mixer] = solve_state_budget(budget, width, mixer, **kw)
    if print_fn is not None:
        print_fn(f"state budget {budget} floats per layer, width {width}")
        for config in configs.values():
            print_fn("  " + config.summary())
    return configs


__all__ = ["BUDGET_MIXERS", "LOWRANK_MIXER", "MAX_WIDTH", "PAPER_STATE_BUDGET", "SIZED_DESIGNS", "HeadConfig",
           "budget_rule", "match_state_budget", "mixer_design", "sized_mixers", "solve_state_budget"]


def __getattr__(name: str):
    if name == "SSD_MIXERS":  # the old list of Mamba-shaped mixers: the registry's budget="ssd" now
        import warnings

        warnings.warn("bayeslayer.models.state_budget.SSD_MIXERS is deprecated; use budget_rule(mixer) == 'ssd'",
                      DeprecationWarning, stacklevel=2)
        return tuple(n for n, entry in MIXER_REGISTRY.items() if entry.budget == "ssd")
    if name == "PAPER_BUDGET":  # the old name, kept for one release
        import warnings

        warnings.warn("bayeslayer.models.state_budget.PAPER_BUDGET is deprecated; use PAPER_STATE_BUDGET",
                      DeprecationWarning, stacklevel=2)
        return PAPER_STATE_BUDGET
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
