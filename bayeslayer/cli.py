"""``bayeslayer`` command line: one subcommand per experiment.

Each experiment module exposes ``add_parser(subparsers)`` which registers its
subcommand and sets ``func`` on the parsed namespace.  Modules listed in
``_COMMAND_MODULES`` are imported lazily so ``bayeslayer --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (subcommand module, import path). Add a line here when an experiment lands.
_COMMAND_MODULES = [
    "bayeslayer.experiments.demo",
    "bayeslayer.experiments.collision",
    "bayeslayer.experiments.recall",
    "bayeslayer.experiments.crowding",
    "bayeslayer.experiments.lm",
    "bayeslayer.experiments.state_budget",
    "bayeslayer.experiments.mqar",
    "bayeslayer.experiments.niah",
    "bayeslayer.experiments.distill",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bayeslayer",
        description="The Bayesian Layer: experiments of 'Memory by Design' and tools around the layer.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for path in _COMMAND_MODULES:
        importlib.import_module(path).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
