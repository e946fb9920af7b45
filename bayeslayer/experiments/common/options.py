"""Checks every subcommand runs on its arguments before any work starts.

A mistake found after an hour of training costs the hour; these run first.  Each raises
:class:`bayeslayer.errors.UsageError` with a message that names the option, which
``bayeslayer.cli.main`` prints as one line (exit code 2).  The ``*_arg`` functions are argparse
``type=`` converters: their errors reach the user as ``argument --x: <message>``.

* :func:`device_arg`: ``auto``, ``cpu``, ``cuda``, ``cuda:N``
  (:func:`bayeslayer.training.distributed.resolve_device`); a CUDA device on a machine where PyTorch
  sees none is refused at once.
* :func:`check_out_dir` / :func:`check_out_file`: the output folder (or file) can be created and
  written, checked before the work that fills it.
* :func:`check_in_file` / :func:`check_in_dir`: an input that must exist.
* :func:`check_file_name`: an option that becomes a file name (``--name``) stays inside its folder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ...checks import INT_MAX, check_fits, check_int, memory_size
from ...errors import UsageError
from ...training.distributed import DEVICE_HELP, resolve_device

# --------------------------------------------------------------------------- devices


def device_arg(text: str) -> str:
    """argparse ``type=`` for ``--device``: checks the name (and that the GPU exists), keeps the text."""
    try:
        resolve_device(text)
    except UsageError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--device ")) from None
    return text


# --------------------------------------------------------------------------- numbers




def positive_int_arg(text: str) -> int:
    """argparse ``type=`` for a count that must be >= 1."""
    return _int_arg(text, minimum=1)


def nonnegative_int_arg(text: str) -> int:
    """argparse ``type=`` for a count that may be 0."""
    return _int_arg(text, minimum=0)


def int_arg(text: str) -> int:
    """argparse ``type=`` for any integer (a seed, a value the config checks): bounded, so a 20-digit number
    is refused here rather than overflowing inside PyTorch."""
    return _int_arg(text, minimum=-INT_MAX)


def _int_arg(text: str, *, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
    try:
        return check_int("value", value, minimum=minimum)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in [{minimum}, {INT_MAX}], got {value}") from None


def check_memory(nbytes: float, *, what: str, device: str | torch.device = "cpu") -> None:
    """:func:`bayeslayer.checks.check_fits` raising :class:`~bayeslayer.errors.UsageError` (``what`` names the
    options, e.g. ``"--T 100000000"``)."""
    check_fits(nbytes, what=what, device=device, error=UsageError)


#: a lower bound of the memory each seed of a run keeps until the run ends: its result record (a dict, 64 bytes
#: when empty) in the list of records (an 8-byte slot)
SEED_BYTES = 72


def check_seeds(seeds: int, *, name: str = "preset.seeds") -> None:
    """Refuse a number of seeds whose records cannot fit in memory, before the first one trains (the list of
    seeds used to fail as a bare ``MemoryError``)."""
    check_memory(SEED_BYTES * seeds, what=f"{name}={seeds:,} (--seeds)")


def list_arg(kind: Callable[[str], Any] = str, what: str = "values", *, allow_empty: bool = False,
             choices: Sequence | None = None) -> Callable[[str], tuple]:
    """argparse ``type=`` for a comma-separated list (``--lengths 2048,4096``): the tuple of ``kind`` of its items,
    blanks skipped.  An empty list only with ``allow_empty``; with ``choices``, every item must be one.  The
    command line's one list parser."""
    def parse(text: str) -> tuple:
        try:
            values = tuple(kind(x.strip()) for x in text.split(",") if x.strip())
        except ValueError:
            values = None
        if values is None or (not values and not allow_empty):
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
        if choices is not None and any(v not in choices for v in values):
            raise argparse.ArgumentTypeError(f"expected comma-separated {what} from {','.join(map(str, choices))}, "
                                             f"got {text!r}")
        return values
    return parse


def model_arg(text: str) -> tuple[str, str]:
    """argparse ``type=`` for ``--model [LABEL=]DIR``: ``(label, dir)``, the label defaulting to the folder's name."""
    label, sep, path = text.partition("=")
    if not sep:
        label, path = Path(text).name or text, text
    if not label or not path:
        raise argparse.ArgumentTypeError(f"--model takes DIR or LABEL=DIR, got {text!r}")
    return label, path


def positive_float_arg(text: str) -> float:
    """argparse ``type=`` for a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


# --------------------------------------------------------------------------- files and folders


def _nearest_existing(path: Path) -> Path:
    for p in (path, *path.parents):
        if p.exists():
            return p
    return Path(".")


def check_out_dir(path: str | os.PathLike, *, option: str = "--out") -> Path:
    """``path`` as an output folder: an existing writable folder, or one that can be created.

    Refuses a path that is a file, one below a file, and a folder (or the nearest existing
    parent of a new one) the process may not write into.  Creates nothing.
    """
    if path is None or str(path) == "":
        raise UsageError(f"{option} must be a folder path, got {path!r}")
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise UsageError(f"{option} {path} is a file, not a folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise UsageError(f"{option} {path}: the folder is not writable")
        return path
    base = _nearest_existing(path.parent)
    if not base.is_dir():
        raise UsageError(f"{option} {path}: cannot create it, {base} is a file")
    if not os.access(base, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: cannot create it, {base} is not writable")
    return path


def cache_dir_arg(text: str) -> str:
    """argparse ``type=`` for ``--cache-dir``: a folder, or a path where one can be made (not a file)."""
    try:
        check_out_dir(text, option="--cache-dir")
    except UsageError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--cache-dir ")) from None
    return text


def check_out_file(path: str | os.PathLike, *, option: str) -> Path:
    """``path`` as an output file: not a folder, in a folder that exists (or can be made) and is writable."""
    if path is None or str(path) == "":
        raise UsageError(f"{option} must be a file path, got {path!r}")
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{option} {path} is a folder, not a file")
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise UsageError(f"{option} {path} is a symbolic link or not a regular file; bayeslayer writes only "
                         "regular files and never through a link")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{option} {path}: the file is not writable")
    check_out_dir(path.parent if str(path.parent) else ".", option=f"{option} {path}: folder")
    return path


def check_file_name(name: str, *, option: str = "--name") -> str:
    """``name`` as one file-name component inside its folder (e.g. the stem of ``<out>/<name>.json``).

    Refuses an empty name, ``.``/``..``, and any name with a path separator or a NUL byte, so that
    the files made from it cannot land outside the folder they belong in.
    """
    if not isinstance(name, str) or not name:
        raise UsageError(f"{option} must be a non-empty file name, got {name!r}")
    if any(c in name for c in ("/", "\\", "\0")) or name in (".", "..") or name != name.strip():
        raise UsageError(f"{option} must be a plain file name (no folder, no '/' or '\\', not '.' or '..', no "
                         f"surrounding spaces), got {name!r}; choose the folder with --out")
    return name


def check_in_file(path: str | os.PathLike, *, option: str, what: str = "file") -> Path:
    """``path`` as an input file that must exist."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{option} {path}: no such {what}")
    if path.is_dir():
        raise UsageError(f"{option} {path} is a folder, not a {what}")
    return path


def check_in_dir(path: str | os.PathLike, *, option: str, what: str = "folder") -> Path:
    """``path`` as an input folder that must exist."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{option} {path}: no such {what}")
    if not path.is_dir():
        raise UsageError(f"{option} {path} is a file, not a {what}")
    return path


def check_source(source: str, *, option: str = "--source") -> str:
    """A corpus source: a name of :data:`bayeslayer.data.text.NAMED_SOURCES`, ``hf:<name>[:<config>]``
    (checked when fetched) or a local path that must exist."""
    from ...data.text import NAMED_SOURCES, SOURCE_HELP

    if not isinstance(source, str) or not source:
        raise UsageError(f"{option} must be {SOURCE_HELP}, got {source!r}")
    if source not in NAMED_SOURCES and not source.startswith("hf:") and not Path(source).expanduser().exists():
        raise UsageError(f"{option} {source}: no such file or folder (sources are {SOURCE_HELP})")
    return source


def check_tokenizer(tokenizer: str | os.PathLike, *, option: str = "--tokenizer") -> None:
    """``tokenizer`` (a ``tokenizer.json`` or a folder holding one) exists and parses."""
    from ...data.text import load_tokenizer

    try:
        load_tokenizer(tokenizer)
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
        raise UsageError(f"{option} {tokenizer}: {' '.join(str(err).split())}") from None


# --------------------------------------------------------------------------- --plot-only


PLOT_ONLY_HELP = "redraw the figures and tables in --out from the JSON an earlier run wrote there; runs nothing"


def plot_only_json(out: str | os.PathLike, name: str, *, experiment: str | None = None) -> dict:
    """The results record ``<out>/<name>.json`` that ``--plot-only`` redraws from.

    The convention of every subcommand: ``--out DIR`` is where a run writes its JSON and figures,
    and ``--plot-only`` redraws the figures and tables in that same ``DIR`` from its JSON.
    ``experiment`` (when the record names one) must match, so one command never draws another's file.
    """
    from .plotting import load_json

    out = check_out_dir(out)
    path = out / f"{check_file_name(name)}.json"
    if not path.is_file():
        raise UsageError(f"--plot-only redraws from {path}, which does not exist; pass the --out folder "
                         "of an earlier run")
    record = load_json(path)
    if experiment is not None and record.get("experiment") != experiment:
        raise UsageError(f"--plot-only: {path} is not a {experiment} results file "
                         f"(experiment = {record.get('experiment')!r})")
    return record


@contextlib.contextmanager
def redrawing(path: str | os.PathLike):
    """Around ``--plot-only``'s drawing from ``path``: a record of the wrong shape (a key missing, a number
    where a list belongs, ...) is one :class:`UsageError` naming the file, not a ``KeyError`` or ``TypeError``.
    (A missing key read from :func:`plot_only_json`'s record already names the file and the key.)"""
    try:
        yield
    except ValueError as err:  # a reader's own check of the record: say which file it was about
        if str(path) in str(err):  # plotting.MissingKeyError names the file and the key
            raise
        raise UsageError(f"--plot-only: {path}: {' '.join(str(err).split())}") from err
    except (KeyError, TypeError, IndexError, AttributeError) as err:
        detail = " ".join(str(err).split()) or type(err).__name__
        raise UsageError(f"--plot-only: {path} does not have the shape of a results file this command wrote "
                         f"({type(err).__name__}: {detail}); rerun the experiment to rewrite it") from err


def add_train_eval(sub, name: str, *, help: str, description: str, train: tuple[str, str],
                   evaluate: tuple[str, str], presets: Mapping[str, object],
                   preset_help: str) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """``bayeslayer <name> {train,eval}``: the command and its two subcommands; returns their parsers.

    ``train`` and ``evaluate`` are each subcommand's ``(help, description)``; the subcommand the user
    named is ``args.<name>_command``.  ``train`` takes ``--preset`` (one of ``presets``, default ``cpu``).
    """
    p = sub.add_parser(name, help=help, description=description)
    commands = p.add_subparsers(dest=f"{name}_command", metavar="{train,eval}", required=True)
    t = commands.add_parser("train", help=train[0], description=train[1])
    e = commands.add_parser("eval", help=evaluate[0], description=evaluate[1])
    t.add_argument("--preset", choices=sorted(presets), default="cpu", help=preset_help)
    return t, e


def add_sharding_options(parser: argparse.ArgumentParser, *, applies: str = "") -> None:
    """``--shard none|fsdp`` and ``--activation-checkpointing`` of a training command (``applies``: a note on
    what the sharding applies to, appended to the help)."""
    from ...training.parallel import SHARDINGS

    parser.add_argument("--shard", choices=SHARDINGS, default="none",
                        help="data parallelism across the torchrun job's ranks: none = DDP (every rank holds the whole "
                             "model, its gradients and AdamW state); fsdp = FSDP2 (each decoder block, the embedding "
                             "and the head sharded over every rank, sharded checkpoints that resume on any number of "
                             f"ranks; docs/distributed.md){applies}. A run resumes with the one it started with")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block's activations in the backward pass (less memory, about one more "
                             "forward pass of time; the losses do not change)")


__all__ = [
    "DEVICE_HELP", "PLOT_ONLY_HELP", "add_sharding_options", "add_train_eval", "cache_dir_arg", "check_file_name",
    "check_in_dir", "check_in_file", "check_int", "check_memory", "check_out_dir", "check_out_file", "check_seeds",
    "check_source",
    "check_tokenizer", "device_arg", "int_arg", "list_arg", "memory_size", "model_arg", "nonnegative_int_arg",
    "plot_only_json", "positive_float_arg", "positive_int_arg", "redrawing",
]


def parse_json_object(option: str, text: str) -> dict:
    """The value of a command-line option that takes a JSON object, e.g. ``--mixer-kwargs '{"p0": 1.0}'``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{option} must be a JSON object, got {text!r}: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option} must be a JSON object, got {text!r}")
    return value
