"""``bayeslayer state-budget``: the head configurations whose recurrent state fits a per-layer float budget.

The solver and its rule are :mod:`bayeslayer.models.state_budget` (docs/theory.md §8.4); this command
prints (and with ``--json`` writes) what it finds for each width and mixer.
"""

from __future__ import annotations

import argparse
import numbers
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..models.state_budget import (
    BUDGET_MIXERS,
    LOWRANK_MIXER,
    MAX_WIDTH,
    PAPER_STATE_BUDGET,
    match_state_budget,
)
from .common.options import check_int, check_out_file, positive_int_arg
from .common.threads import SMALL, add_threads_option

DESCRIPTION = (
    "For each model width and mixer, list the head configurations (number of heads, "
    "head dimension, covariance groups) whose recurrent state per layer fits the "
    "budget in floats and uses at least --min-usage of it, the configuration "
    "nearest --target-head-dim first. Arithmetic only: nothing is trained; "
    "--json also writes the configurations to a file."
)


# -- the command as config -> record ----------------------------------------------------------------
@dataclass(frozen=True)
class StateBudgetConfig:
    """What ``bayeslayer state-budget`` solves: every mixer of ``mixers`` at every width of ``widths`` for a
    per-layer ``budget`` of floats, with :func:`solve_state_budget`'s ``num_heads``, ``groups`` (covariance
    mixers only), ``min_usage``, ``target_head_dim`` and ``rank`` (``bayesian_lowrank`` only); ``json``: a
    file to write the configurations to (``None``: none).  Every field is checked here, with its name."""

    budget: int = PAPER_STATE_BUDGET
    widths: tuple[int, ...] = (64,)
    mixers: tuple[str, ...] = BUDGET_MIXERS
    rank: int | None = None
    num_heads: int | None = None
    groups: int = 1
    min_usage: float = 0.9
    target_head_dim: int = 64
    json: str | None = None

    def __post_init__(self):
        check_int("budget", self.budget, minimum=1)
        for name, known in (("widths", None), ("mixers", (*BUDGET_MIXERS, LOWRANK_MIXER))):
            values = getattr(self, name)
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
                raise ValueError(f"{name} must be a non-empty sequence, got {values!r}")
            if known is None:
                values = tuple(check_int(f"{name} entry", w, minimum=1, maximum=MAX_WIDTH) for w in values)
            elif any(m not in known for m in values):
                raise ValueError(f"{name} must be names from {list(known)}, got {list(values)}")
            object.__setattr__(self, name, tuple(values))
        if self.rank is not None:
            check_int("rank", self.rank, minimum=0)
        if self.num_heads is not None:
            check_int("num_heads", self.num_heads, minimum=1)
        check_int("groups", self.groups, minimum=1)
        check_int("target_head_dim", self.target_head_dim, minimum=1)
        usage = self.min_usage
        if isinstance(usage, bool) or not isinstance(usage, numbers.Real) or not (0 < usage <= 1):
            raise ValueError(f"min_usage must be a number in (0, 1], got {usage!r}")
        if self.json is not None and not isinstance(self.json, (str, os.PathLike)):
            raise TypeError(f"json must be a file path or None, got {type(self.json).__name__}")


def run(config: StateBudgetConfig, *, print_fn: Callable[[str], None] | None = print) -> list[dict]:
    """Solve every mixer at every width of ``config`` (:func:`match_state_budget`, which prints the sizes
    through ``print_fn``); returns the configurations as dicts (:meth:`HeadConfig.to_dict`), the JSON the
    command writes to ``config.json``."""
    if not isinstance(config, StateBudgetConfig):
        raise TypeError(f"config must be a StateBudgetConfig, got {type(config).__name__}")
    if config.json:
        check_out_file(config.json, option="json")
    results = []
    for width in config.widths:
        configs = match_state_budget(
            config.budget, width, config.mixers, print_fn=print_fn, num_heads=config.num_heads,
            groups=config.groups, min_usage=config.min_usage, target_head_dim=config.target_head_dim,
            rank=config.rank,
        )
        results.extend(c.to_dict() for c in configs.values())
    if config.json:
        from .common.harness import write_json

        write_json(config.json, results)  # atomic; creates the folder json names
    return results


# -- command line ------------------------------------------------------------------------------------
def config_from_args(args: argparse.Namespace) -> StateBudgetConfig:
    """The :class:`StateBudgetConfig` that ``bayeslayer state-budget`` arguments name (``--json`` checked first)."""
    if args.json:
        check_out_file(args.json, option="--json")
    return StateBudgetConfig(budget=args.budget, widths=tuple(args.width), mixers=tuple(args.mixers),
                             rank=args.rank, num_heads=args.num_heads, groups=args.groups,
                             min_usage=args.min_usage, target_head_dim=args.target_head_dim, json=args.json)


def _main(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    run(config)
    if config.json:
        print(f"wrote {config.json}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("state-budget", help="head configurations whose recurrent state fits a float budget",
                       description=DESCRIPTION)
    p.add_argument("--budget", type=positive_int_arg, default=PAPER_STATE_BUDGET,
                   help="per-layer state budget in floats")
    p.add_argument("--width", type=positive_int_arg, nargs="+", default=[64], help="model width(s)")
    p.add_argument("--mixers", nargs="+", default=list(BUDGET_MIXERS), choices=(*BUDGET_MIXERS, LOWRANK_MIXER),
                   metavar="MIXER",
                   help=f"mixers to size (default: all of {', '.join(BUDGET_MIXERS)}; {LOWRANK_MIXER} needs --rank)")
    p.add_argument("--rank", type=int, default=None, help="rank r of bayesian_lowrank's precision factor")
    p.add_argument("--num-heads", type=positive_int_arg, default=None, help="fix the number of heads")
    p.add_argument("--groups", type=positive_int_arg, default=1, help="covariance groups G (covariance mixers only)")
    p.add_argument("--min-usage", type=float, default=0.9, help="least fraction of the budget to use")
    p.add_argument("--target-head-dim", type=positive_int_arg, default=64, help="preferred head dim among ties")
    p.add_argument("--json", default=None, help="also write the configurations to this JSON file")
    add_threads_option(p, SMALL)
    p.set_defaults(func=_main)


__all__ = ["StateBudgetConfig", "config_from_args", "run"]
