"""Checks every subcommand runs on its arguments before any work starts.

A mistake found after an hour of training costs the hour; these run first.  Each raises
:class:`bayeslayer.errors.UsageError` with a message that names the option, which
``bayeslayer.cli.main`` prints as one line (exit code 2).  The ``*_arg`` functions are argparse
``type=`` converters: their errors reach the user as ``argument --x: <message>``.

* :func:`resolve_device` / :func:`device_arg`: ``auto``, ``cpu``, ``cuda``, ``cuda:N``.  A bare
  ``cuda`` means this process's GPU (``cuda:$LOCAL_RANK``, 0 outside ``torchrun``); a CUDA device
  on a machine where PyTorch sees none is refused at once.
* :func:`check_out_dir` / :func:`check_out_file`: the output folder (or file) can be created and
  written, checked before the work that fills it.
* :func:`check_in_file` / :func:`check_in_dir`: an input that must exist.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch

from ..checks import check_int
from ..errors import UsageError

DEVICE_HELP = "auto (a GPU when there is one, else the CPU), cpu, cuda or cuda:N"


# --------------------------------------------------------------------------- devices


def resolve_device(spec: str | torch.device, *, option: str = "--device") -> torch.device:
    """The ``torch.device`` that ``spec`` names, with a CUDA index; refuses a GPU that is not there.

    ``auto`` is ``cuda:$LOCAL_RANK`` when PyTorch sees a GPU, else ``cpu``; ``cuda`` is
    ``cuda:$LOCAL_RANK`` (``torch.cuda.set_device`` and distributed runs need the index).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if isinstance(spec, torch.device):
        dev = spec
    elif not isinstance(spec, str):
        raise UsageError(f"{option} must be a device name ({DEVICE_HELP}), got {type(spec).__name__}")
    elif spec == "auto":
        dev = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(spec)
        except (RuntimeError, ValueError):
            raise UsageError(f"{option} must be {DEVICE_HELP}, got {spec!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"{option} {spec}: no CUDA GPU is visible to PyTorch on this machine "
                             f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                             "use --device cpu")
        if dev.index is None:
            dev = torch.device("cuda", local_rank)
        if dev.index >= torch.cuda.device_count():
            raise UsageError(f"{option} {spec}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                             f"numbered 0..{torch.cuda.device_count() - 1}")
    elif dev.type not in ("cpu", "cuda"):
        raise UsageError(f"{option} must be {DEVICE_HELP}, got {spec!r}")
    return dev


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


def _int_arg(text: str, *, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
    return value


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


def check_out_file(path: str | os.PathLike, *, option: str) -> Path:
    """``path`` as an output file: not a folder, in a folder that exists (or can be made) and is writable."""
    if path is None or str(path) == "":
        raise UsageError(f"{option} must be a file path, got {path!r}")
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{option} {path} is a folder, not a file")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{option} {path}: the file is not writable")
    check_out_dir(path.parent if str(path.parent) else ".", option=f"{option} {path}: folder")
    return path


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
    from ..data.text import NAMED_SOURCES, SOURCE_HELP

    if not isinstance(source, str) or not source:
        raise UsageError(f"{option} must be {SOURCE_HELP}, got {source!r}")
    if source not in NAMED_SOURCES and not source.startswith("hf:") and not Path(source).expanduser().exists():
        raise UsageError(f"{option} {source}: no such file or folder (sources are {SOURCE_HELP})")
    return source


def check_tokenizer(tokenizer: str | os.PathLike, *, option: str = "--tokenizer") -> None:
    """``tokenizer`` (a ``tokenizer.json`` or a folder holding one) exists and parses."""
    from ..data.text import load_tokenizer

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
    path = out / f"{name}.json"
    if not path.is_file():
        raise UsageError(f"--plot-only redraws from {path}, which does not exist; pass the --out folder "
                         "of an earlier run")
    record = load_json(path)
    if experiment is not None and record.get("experiment") != experiment:
        raise UsageError(f"--plot-only: {path} is not a {experiment} results file "
                         f"(experiment = {record.get('experiment')!r})")
    return record


__all__ = [
    "DEVICE_HELP", "PLOT_ONLY_HELP", "check_in_dir", "check_int", "check_in_file", "check_out_dir", "check_out_file",
    "check_source", "check_tokenizer", "device_arg", "model_arg", "nonnegative_int_arg", "plot_only_json",
    "positive_float_arg", "positive_int_arg", "resolve_device",
]
