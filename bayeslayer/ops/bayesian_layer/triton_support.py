"""What the Triton kernels can run, and why not when they cannot (no Triton import here).

One place for these facts: the Triton entry points (:func:`~bayeslayer.ops.bayesian_layer.chunk_triton.bl_chunk_triton`,
:func:`~bayeslayer.ops.bayesian_layer.step_triton.bl_step_triton`) refuse what they cannot run with these messages,
and :mod:`bayeslayer.ops.backend` asks the same questions to choose a backend.

* :func:`triton_unavailable` — Triton missing, or the tensors' device cannot run Triton
  (CUDA tensors run compiled kernels; CPU tensors run only in Triton's interpreter,
  ``TRITON_INTERPRET=1`` set before Triton is first imported).
* :func:`unsupported` — a configuration the kernels do not implement: a write model other
  than the exact Kalman filter (``bayes``), rotation dynamics, a key dim outside
  ``1..MAX_HEAD_DIM``, a chunk size outside :data:`SUPPORTED_CHUNK_SIZES`, an input dtype
  outside :data:`SUPPORTED_DTYPES`.

Each returns ``None`` when the kernels can run, else a sentence saying why not.
:class:`BackendError` is what a forced backend raises when it cannot run.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

SUPPORTED_CHUNK_SIZES = (16, 32, 64)  # tl.dot needs tiles of >= 16 rows; 64 is the register limit
#: the key dim is padded to a power of two; sm_90 builds are measured up to 256, the most flash-linear-attention's
#: state kernels (the mean pass) take
MAX_HEAD_DIM = 256
#: the largest key dim the chain kernels hold ``P`` for (fp32, D×D, in registers); larger ones run the segment scan
CHAIN_MAX_HEAD_DIM = 128
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: the write models the kernels run (:mod:`.write_models`): the exact Kalman filter (dense covariance) only
TRITON_WRITES = ("bayes",)
OPS = ("chunk", "step")


class BackendError(RuntimeError):
    """A backend that was asked for explicitly cannot run here; the message says why."""


def interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET=1`` (Triton then runs kernels on CPU tensors, slowly)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def triton_installed() -> bool:
    """Whether the ``triton`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_unavailable(device: torch.device | str | None = None) -> str | None:
    """Why Triton cannot run kernels on tensors on ``device`` here, or None when it can.

    ``device=None`` asks about this machine: a CUDA device, or the interpreter.
    """
    if not triton_installed():
        return "Triton is not installed (pip install triton)"
    dev = None if device is None else torch.device(device)
    if dev is not None and dev.type == "cuda":
        return None
    if dev is None or dev.type == "cpu":
        if interpreter_enabled():
            return None
        where = "there is no CUDA device" if not torch.cuda.is_available() else "the inputs are on the CPU"
        return (f"{where} and TRITON_INTERPRET is not 1 (Triton's kernels run on CUDA tensors, or on CPU "
                "tensors in Triton's interpreter when TRITON_INTERPRET=1 is set before Triton is imported)")
    return f"Triton's kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got device {dev}"


def unsupported(
    op: str = "chunk",
    *,
    write: str = "bayes",
    rotation: bool = False,
    head_dim: int | None = None,
    chunk_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> str | None:
    """Why the Triton ``op`` (``"chunk"`` or ``"step"``) cannot run this configuration, or None.

    Arguments left at None are not checked (a layer asks about its configuration before it
    has seen a tensor).  ``chunk_size`` is only checked for ``op="chunk"``.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if write not in TRITON_WRITES:
        return (f"write model {write!r} has no Triton kernel (the kernels implement the exact Kalman filter, "
                f"write model 'bayes')")
    if rotation:
        return "rotation dynamics (theta) have no Triton kernel (identity, scalar and diagonal decay do)"
    if head_dim is not None and not 1 <= head_dim <= MAX_HEAD_DIM:
        return f"key head dim D={head_dim} is outside the kernels' 1..{MAX_HEAD_DIM}"
    if op == "chunk" and chunk_size is not None and (
        isinstance(chunk_size, bool) or chunk_size not in SUPPORTED_CHUNK_SIZES
    ):
        return f"chunk_size={chunk_size!r} is not one of the kernels' {SUPPORTED_CHUNK_SIZES}"
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        return f"input dtype {str(dtype).replace('torch.', '')} is not one of the kernels' {names}"
    return None


def next_pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def tile_sizes(D: int, m: int) -> tuple[int, int, int]:
    """``(BD, BK, BV)``: padded key dim, key-dim tile, value-dim tile of the chunk kernels.

    BK = 16, BV ≤ 32: with 64-wide tiles the sm_90 build of the covariance kernel
    spills heavily at C = 64 (``benchmarks/gpu.py --compile-only``); at 16/32 it
    fits in registers (covariance: no spill; mean: ≤ 56 bytes).
    """
    BD = max(16, next_pow2(D))
    return BD, 16, min(max(16, next_pow2(m)), 32)
