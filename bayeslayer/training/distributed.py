"""Where a training process stands in a (possibly single-process) job, and at which precision it computes.

* :class:`DistContext` — rank, world size, local rank and device of this process;
  :func:`init_distributed` joins the ``torchrun`` job that ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``
  describe (``nccl`` on CUDA, ``gloo`` on CPU) or, without one, is a single process;
* :func:`resolve_precision` and :func:`autocast` — ``"auto"``/``"bf16"``/``"fp32"`` as an autocast
  dtype and context (the filters compute in fp32 whatever the input dtype).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

PRECISIONS = ("auto", "bf16", "fp32")


@dataclass(frozen=True)
class DistContext:
    """This process's place in a (possibly single-process) job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def init_distributed(device: torch.device) -> DistContext:
    """Join the ``torchrun`` job described by ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (if any) on ``device``.

    ``device`` is a resolved ``torch.device`` (with its CUDA index; the command line's
    :func:`bayeslayer.experiments.common.options.resolve_device` turns ``auto``/``cuda`` into one).  ``nccl``
    on CUDA, ``gloo`` on CPU.  Without ``torchrun`` (``WORLD_SIZE`` unset or 1) this is a single process
    and nothing is initialised.
    """
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device, got {type(device).__name__}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, device=device)


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype: ``None`` for fp32; ``auto`` is bf16 on a CUDA device that supports it."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp32":
        return None
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"precision='bf16' but {device} does not support bfloat16; use fp32")
    return torch.bfloat16


def autocast(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` to ``dtype`` on ``device``'s type; a no-op context for ``None`` (fp32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


__all__ = ["PRECISIONS", "DistContext", "autocast", "init_distributed", "resolve_precision"]
