"""``bayeslayer`` command line: one subcommand per experiment.

Each experiment module exposes ``add_parser(subparsers)`` which registers its
subcommand and sets ``func`` on the parsed namespace.  Modules listed in
``_COMMAND_MODULES`` are imported lazily so ``bayeslayer --help`` stays fast.

Exit codes: 0 done; 2 an expected failure (a bad value, a missing file, a busy folder, no GPU,
...: see :mod:`bayeslayer.errors` for which exceptions count), reported as one line
``bayeslayer <command>: error: <message>`` on stderr; 130 interrupted (Ctrl-C), one line saying
where the last checkpoint is when the work said so; 1 a bug, with its traceback.
``bayeslayer --debug <command> ...`` (or ``BAYESLAYER_DEBUG=1``) shows the traceback of every
failure instead of the one line.

A subcommand's ``func`` may return ``None`` (done), an ``int`` (the exit code) or a record (a
dict of results, for callers in Python): anything but an ``int`` is exit code 0.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .errors import EXIT_INTERRUPTED, EXIT_USAGE, Interrupted, expected_errors, is_out_of_memory

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
    "bayeslayer.experiments.heldout",
    "bayeslayer.experiments.distill",
]


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: ``<prog>: error: <message> (see <prog> --help)``.

    The stock parser prints the whole usage block first; a bad value should read like every
    other expected failure.  Subcommand parsers inherit this class.
    """

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="bayeslayer",
        description="The Bayesian Layer: experiments of 'Memory by Design' and tools around the layer.",
        epilog="Exit codes: 0 done, 2 bad input or an expected failure (one line on stderr), 130 interrupted, "
               "1 a bug (with its traceback).",
    )
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of a failure instead of its one-line message")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for path in _COMMAND_MODULES:
        importlib.import_module(path).add_parser(sub)
    return parser


def _prog(args: argparse.Namespace | None) -> str:
    """``bayeslayer``, ``bayeslayer niah``, ``bayeslayer lm train``: who is speaking in an error line."""
    words = ["bayeslayer"]
    for attr in ("command", "lm_command", "distill_command"):
        value = getattr(args, attr, None) if args is not None else None
        if value:
            words.append(value)
    return " ".join(words)


def _one_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    if isinstance(err, KeyError) and type(err).__str__ is KeyError.__str__:  # str(KeyError("x")) is "'x'": says nothing
        text = f"{type(err).__name__}: {text}"
    return " ".join(text.split())  # a message that spans lines still reads as one


def exit_code(result) -> int:
    """The exit code of a subcommand's return value: an ``int`` as is, anything else (None, a record) 0."""
    if isinstance(result, int) and not isinstance(result, bool):
        return result
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = None
    debug = bool(os.environ.get("BAYESLAYER_DEBUG"))
    try:
        args = parser.parse_args(argv)
        debug = debug or args.debug
        if not getattr(args, "func", None):
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        return exit_code(args.func(args))
    except KeyboardInterrupt as err:
        if debug:
            raise
        where = err.checkpoint if isinstance(err, Interrupted) else None
        line = f"{_prog(args)}: interrupted"
        if where:
            line += f"; the last checkpoint is kept in {where} (rerun the same command to resume)"
        print(line, file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit as err:
        # argparse (already printed, code 0 or 2) or code that exits with a message
        if err.code is None or isinstance(err.code, int):
            return err.code or 0
        if debug:
            raise
        text = " ".join(str(err.code).split())
        prog = _prog(args)
        print(text if text.startswith(prog) else f"{prog}: error: {text}", file=sys.stderr)
        return EXIT_USAGE
    except expected_errors() as err:
        if debug:
            raise
        print(f"{_prog(args)}: error: {_one_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    except RuntimeError as err:  # PyTorch's CPU allocator reports a failed allocation as a RuntimeError
        if debug or not is_out_of_memory(err):
            raise
        text = _one_line(err).split(" (Triggered internally")[0]
        text = text[text.find("DefaultCPUAllocator"):] if "DefaultCPUAllocator" in text else text  # no C++ location
        print(f"{_prog(args)}: error: out of memory: {text}; use smaller sizes", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
