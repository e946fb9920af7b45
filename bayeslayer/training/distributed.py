"""Where a training process stands in a (possibly single-process) job, and at which precision it computes.

* :class:`DistContext` — rank, world size, local rank and device of this process, and the job's one
  2-D :class:`~torch.distributed.device_mesh.DeviceMesh` ``(dp, cp)``: data-parallel replicas × the ranks
  that share each sequence (context parallelism); FSDP shards over both dimensions together
  (:attr:`DistContext.shard_mesh`).  :func:`init_distributed` joins the ``torchrun`` job that
  ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` describe (``nccl`` on CUDA, ``gloo`` on CPU) or, without one, is a
  single process, on the device :func:`resolve_device` names (``auto``, ``cpu``, ``cuda``, ``cuda:N``);
* :func:`resolve_precision` and :func:`autocast` — ``"auto"``/``"bf16"``/``"fp32"`` as an autocast
  dtype and context (the filters compute in fp32 whatever the input dtype).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import UsageError

PRECISIONS = ("auto", "bf16", "fp32")
#: The dimensions of the job's DeviceMesh: data-parallel replicas, then the ranks of a context-parallel group.
MESH_DIMS = ("dp", "cp")
DEVICE_HELP = "auto (a GPU when there is one, else the CPU), cpu, cuda or cuda:N"


@dataclass(frozen=True)
class DistContext:
    """This process's place in a (possibly single-process) job.

    With context parallelism (``cp_size > 1``) the ``world_size`` ranks form ``world_size / cp_size``
    data-parallel replicas of ``cp_size`` consecutive ranks each: the ranks of one replica
    (``cp_group``) share every sequence, split along T (docs/context_parallel.md), and the replicas
    read different sequences.  ``cp_rank`` is this rank's place in its group, ``dp_rank``/``dp_size``
    its replica and their number (``rank``/``world_size`` without context parallelism).

    ``mesh``: the job's ``DeviceMesh`` of shape ``(dp_size, cp_size)``, dimensions named ``("dp", "cp")``
    (rank ``r`` at ``(r // cp_size, r % cp_size)``); ``None`` in a single process.  Every process group of
    the job is a dimension of it: ``cp_group`` is ``mesh["cp"]``'s.  ``shard_mesh``: the 1-D mesh FSDP
    shards parameters over, every rank of the job (``mesh["dp"]``, or ``dp`` × ``cp`` flattened as ``dp_cp``):
    the ranks of a context-parallel group hold the same parameters, so they share the sharding as the
    replicas do (torchtitan's ``dp_shard_cp``).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    cp_size: int = 1
    mesh: object = field(default=None, compare=False, repr=False)
    shard_mesh: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        for name in ("world_size", "cp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.world_size % self.cp_size != 0:
            raise ValueError(f"cp_size ({self.cp_size}) must divide world_size ({self.world_size})")
        if self.mesh is not None:
            from torch.distributed.device_mesh import DeviceMesh

            expected = (self.world_size // self.cp_size, self.cp_size)
            if not isinstance(self.mesh, DeviceMesh) or tuple(self.mesh.shape) != expected \
                    or self.mesh.mesh_dim_names != MESH_DIMS:
                raise ValueError(f"mesh must be a DeviceMesh of shape {expected} with dimensions {MESH_DIMS}, got "
                                 f"{self.mesh!r}")
        elif self.context_parallel:
            raise ValueError("a context-parallel DistContext needs its mesh (from init_distributed(..., "
                             "context_parallel=C))")

    @property
    def cp_group(self):
        """The process group of this rank's context-parallel group (``None`` without context parallelism)."""
        return self.mesh.get_group("cp") if self.context_parallel else None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def context_parallel(self) -> bool:
        return self.cp_size > 1

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.cp_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


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


def init_distributed(device: str | torch.device = "auto", *, context_parallel: int = 1) -> DistContext:
    """Join the ``torchrun`` job described by ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (if any) on ``device``.

    ``device``: ``auto`` (``cuda:LOCAL_RANK`` when PyTorch sees a GPU, else the CPU), ``cpu``, ``cuda``,
    ``cuda:N`` or a ``torch.device`` (:func:`resolve_device` gives it its CUDA index).  ``nccl``
    on CUDA, ``gloo`` on CPU.  Without ``torchrun`` (``WORLD_SIZE`` unset or 1) this is a single process
    and nothing is initialised.  A process group that is already initialised is joined as it is.

    ``context_parallel``: ranks per context-parallel group (1: none); it must divide the world size.
    With more than one rank, the job's ``DeviceMesh`` ``(dp, cp)`` is built (``cp`` = ``context_parallel``;
    every group of ``context_parallel`` consecutive ranks is one row ``mesh["cp"]``).
    """
    device = resolve_device(device)
    if isinstance(context_parallel, bool) or not isinstance(context_parallel, int) or context_parallel < 1:
        raise ValueError(f"context_parallel must be a positive int, got {context_parallel!r}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    if world % context_parallel != 0:
        raise ValueError(f"context_parallel={context_parallel} must divide the number of ranks ({world}); "
                         + ("launch with torchrun --nproc_per_node N, N a multiple of it" if world == 1
                            else "use another group size or another number of ranks"))
    mesh = shard_mesh = None
    if world > 1:  # collective: every rank takes part in creating every group of the mesh
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world // context_parallel, context_parallel), mesh_dim_names=MESH_DIMS)
        shard_mesh = mesh["dp"] if context_parallel == 1 else mesh["dp", "cp"]._flatten("dp_cp")
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, device=device,
                       cp_size=context_parallel, mesh=mesh, shard_mesh=shard_mesh)


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


__all__ = ["DEVICE_HELP", "MESH_DIMS", "PRECISIONS", "DistContext", "autocast", "init_distributed", "resolve_device",
           "resolve_precision"]
