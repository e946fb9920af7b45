"""How many CPU threads a subcommand's PyTorch work uses (``--threads N`` on every subcommand).

PyTorch starts one intra-op thread per core.  That pays when matrices are large (a language model's
projections) and costs when tensors are tiny, as in the collision experiment (D = 16), the recall and
crowding toys, ``demo`` and the ``tiny`` language model: the work per operation is too small to
share, and on a busy machine the OpenMP workers wait for cores that other processes hold, so a job
can run several times slower with two threads than with one.  Each subcommand therefore declares a
default for its workload (:data:`SMALL`, one thread, or :data:`TORCH_DEFAULT`, PyTorch's own), and
``--threads N`` overrides it; ``--threads 0`` keeps PyTorch's default.  ``benchmarks/threads.py``
measures both choices, on an idle machine and beside a competing CPU-bound process.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

#: The default of small-tensor workloads: one thread.
SMALL = 1
#: The default of large-matrix workloads: leave PyTorch's choice (one thread per core) alone.
TORCH_DEFAULT = 0

#: PyTorch's own intra-op thread count in this process, read before any ``--threads`` changes it.
_TORCH_THREADS = torch.get_num_threads()


def threads_arg(text: str) -> int:
    """argparse ``type=`` for ``--threads``: an integer >= 0 (0: PyTorch's default)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 (0: PyTorch's default), got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 (0: PyTorch's default), got {value}")
    return value


def _describe(threads: int) -> str:
    return "PyTorch's default" if threads == TORCH_DEFAULT else f"{threads} (small tensors)"


def add_threads_option(parser: argparse.ArgumentParser, default: int | Callable[[argparse.Namespace], int],
                       *, default_text: str | None = None) -> None:
    """Add ``--threads N`` to ``parser``; ``default`` is :data:`SMALL`, :data:`TORCH_DEFAULT`, or a function of
    the parsed arguments giving one of them (e.g. by preset), described by ``default_text`` in the help."""
    if not (callable(default) or (isinstance(default, int) and default >= 0)):
        raise ValueError(f"default must be an integer >= 0 or a function of the arguments, got {default!r}")
    if default_text is None:
        if callable(default):
            raise ValueError("default_text is required when default is a function")
        default_text = _describe(default)
    parser.add_argument("--threads", type=threads_arg, default=None, metavar="N",
                        help=f"CPU threads for PyTorch; 0 = PyTorch's default, one per core ({_TORCH_THREADS} "
                             f"here) (default: {default_text})")
    parser.set_defaults(threads_default=default)


def resolve_threads(args: argparse.Namespace) -> int | None:
    """The thread count the parsed arguments ask for (``None``: the command has no ``--threads``)."""
    if not hasattr(args, "threads_default"):
        return None
    if args.threads is not None:
        return args.threads
    default = args.threads_default
    return default(args) if callable(default) else default


def apply_threads(args: argparse.Namespace) -> int | None:
    """Set PyTorch's intra-op threads as the parsed arguments say; returns the count in force (or ``None``)."""
    threads = resolve_threads(args)
    if threads is None:
        return None
    torch.set_num_threads(_TORCH_THREADS if threads == TORCH_DEFAULT else threads)
    return torch.get_num_threads()


__all__ = ["SMALL", "TORCH_DEFAULT", "add_threads_option", "apply_threads", "resolve_threads", "threads_arg"]
