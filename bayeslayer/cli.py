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
import shutil
import sys
from pathlib import Path

from .errors import EXIT_INTERRUPTED, EXIT_USAGE, Interrupted, expected_errors, is_out_of_memory
from .experiments.common.threads import apply_threads

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
    "bayeslayer.experiments.variance",
]


class _HelpFormatter(argparse.HelpFormatter):
    """Plain-text help: every option with a value shows its default, unless its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or "%(default)" in text or not action.option_strings or action.nargs == 0
                or default is None or default is argparse.SUPPRESS):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: ``<prog>: error: <message> (see <prog> --help)``.

    The stock parser prints the whole usage block first; a bad value should read like every
    other expected failure.  Subcommand parsers inherit this class, and its help formatter
    (:class:`_HelpFormatter`: defaults shown, descriptions wrapped as one paragraph).
    """

    def __init__(self, *args, **kwargs):
        kwargs["formatter_class"] = _HelpFormatter
        super().__init__(*args, **kwargs)

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


def _leaf_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)subcommand ``args`` names: ``bayeslayer lm train``'s for ``lm train ...``."""
    for attr in ("command", "lm_command", "distill_command"):
        name = getattr(args, attr, None)
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not name or not subs or name not in subs[0].choices:
            continue
        parser = subs[0].choices[name]
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


class _NewFolders:
    """The folders a command creates, so that a failed start leaves none behind.

    Taken before the command runs: the first folder of ``--out`` that does not exist yet, and the
    entries of the working folder (commands write their default output under ``runs/<command>/``).
    After an expected failure, :meth:`remove_unused` deletes each folder that appeared since and holds
    nothing but empty folders and lock files (``.lock``): never one with a result or a checkpoint in it.
    """

    def __init__(self, args: argparse.Namespace):
        out = getattr(args, "out", None)
        self.new_top = None
        if isinstance(out, str) and out:
            path = Path(out).absolute()
            while not path.parent.exists() and path.parent != path:
                path = path.parent
            if not path.exists():
                self.new_top = path
        self.cwd = Path.cwd()
        self.cwd_entries = set(os.listdir(self.cwd))

    @staticmethod
    def _unused(folder: Path) -> bool:
        from .training.lock import LOCK_NAME

        return folder.is_dir() and all(p.is_dir() or p.name == LOCK_NAME for p in folder.rglob("*"))

    def remove_unused(self) -> None:
        candidates = [self.cwd / e for e in sorted(set(os.listdir(self.cwd)) - self.cwd_entries)]
        if self.new_top is not None:
            candidates.append(self.new_top)
        for folder in candidates:
            if self._unused(folder):
                shutil.rmtree(folder, ignore_errors=True)


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
        args, extra = parser.parse_known_args(argv)
        if extra:  # said by the subcommand, so the error points to its --help
            _leaf_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
        debug = debug or args.debug
        if not getattr(args, "func", None):
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        apply_threads(args)
        folders = _NewFolders(args)
        try:
            return exit_code(args.func(args))
        except (SystemExit, *expected_errors()):
            folders.remove_unused()  # a failed start leaves no empty output folder behind
            raise
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
