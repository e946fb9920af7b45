"""Sharded training state on disk: ``torch.distributed.checkpoint`` (DCP) in safetensors files, no pickle.

:func:`save_sharded` writes a module's weights and its optimiser's tensors, each rank its own shards, to
``shard-<rank+1>-model-00001-of-00001.safetensors`` files in one folder (DCP's
``HuggingFaceStorageWriter``; where each shard sits in the whole tensor is in the file's safetensors
header, JSON).  :func:`load_sharded` reads them back on any number of ranks, sharded or not: DCP's planner
gives each rank the slices of the saved shards that its own shards cover, so a checkpoint written by 2
ranks loads on 1 or 4 bit for bit.  DCP's default format keeps its index in a pickle; this one has none.

State keys (the fully qualified names of ``torch.distributed.checkpoint.state_dict``, which do not
depend on the sharding): ``model.<parameter or buffer>`` and ``optim.<parameter>.<state>`` (AdamW's
``exp_avg``, ``exp_avg_sq``, ``step``).  The optimiser's parameter groups (learning rates, betas, the
parameters' names) are not tensors: :func:`save_sharded` returns them for the caller's JSON.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn

#: The file-name prefix of the shards (DCP's ``HuggingFaceStorageWriter`` with ``save_distributed``).
SHARD_PREFIX = "shard-"


def _state_dicts(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict, dict]:
    """``(flat DCP state, model state_dict, optimiser state_dict)``, FQN-keyed (DTensors where sharded)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_sd = get_model_state_dict(module)
    optim_sd = get_optimizer_state_dict(module, optimizer)
    flat = {f"model.{k}": v for k, v in model_sd.items()}
    for fqn, state in optim_sd["state"].items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"the optimiser's state {fqn}.{key} is a {type(value).__name__}; a sharded checkpoint "
                                "stores tensors only")
            flat[f"optim.{fqn}.{key}"] = value
    return flat, model_sd, optim_sd


def _one_process() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every save and load in one process (it assumes a forgotten process group); here one
    process is a supported case."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*assuming the intent", category=UserWarning)
        yield


def _check(directory, module, optimizer) -> Path:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path, got {type(directory).__name__}")
    return Path(directory)


def save_sharded(directory: str | os.PathLike, module: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """Write this rank's shards of ``module``'s weights and ``optimizer``'s state into ``directory`` (collective:
    every rank of the job calls it with the same ``directory``, on a file system they share).

    Returns the optimiser's parameter groups (hyper-parameters and parameter names; JSON-able), which
    :func:`load_sharded` needs back.  The files are written, not published: the caller makes the folder
    appear atomically (:meth:`~bayeslayer.training.CheckpointStore.save`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    directory = _check(directory, module, optimizer)
    if not directory.is_dir():
        raise FileNotFoundError(f"directory {directory} does not exist")
    flat, _, optim_sd = _state_dicts(module, optimizer)
    writer = HuggingFaceStorageWriter(str(directory), save_distributed=True)
    with _quiet_single_process():
        dcp.save(flat, storage_writer=writer, no_dist=_one_process())
    return [dict(group) for group in optim_sd["param_groups"]]


def _reader(directory: Path):
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    class ShardReader(HuggingFaceStorageReader):
        """DCP's safetensors reader over the shard files only (the folder holds other files too)."""

        def read_metadata(self):
            metadata = super().read_metadata()
            metadata.storage_data = {index: info for index, info in metadata.storage_data.items()
                                     if Path(info.relative_path).name.startswith(SHARD_PREFIX)}
            kept = {index.fqn for index in metadata.storage_data}
            metadata.state_dict_metadata = {k: v for k, v in metadata.state_dict_metadata.items() if k in kept}
            return metadata

    return ShardReader(str(directory))


def load_sharded(directory: str | os.PathLike, module: nn.Module, optimizer: torch.optim.Optimizer,
                 param_groups: list[dict]) -> None:
    """Load what :func:`save_sharded` wrote into ``module`` and ``optimizer`` (collective), whatever the number
    of ranks or the sharding it was written with; ``param_groups``: what :func:`save_sharded` returned.

    A tensor the module needs that the shards lack, or a parameter group that names other parameters,
    is a ``ValueError`` naming them.  A parameter without optimiser state in the checkpoint (one that never
    had a gradient) gets none, as in the saved run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    directory = _check(directory, module, optimizer)
    if not isinstance(param_groups, list) or not all(isinstance(g, dict) and "params" in g for g in param_groups):
        raise ValueError("param_groups must be the list of dicts save_sharded returned")
    reader = _reader(directory)
    saved = set(reader.read_metadata().state_dict_metadata)
    flat, model_sd, optim_sd = _state_dicts(module, optimizer)  # templates: the optimiser's state is initialised
    missing = sorted(k for k in flat if k.startswith("model.") and k not in saved)
    if missing:
        raise ValueError(f"{directory}: the shards lack {len(missing)} tensor(s) of the model: {missing[:5]}")
    live = [[str(p) for p in g["params"]] for g in optim_sd["param_groups"]]
    stored = [[str(p) for p in g["params"]] for g in param_groups]
    if live != stored:
        raise ValueError(f"{directory}: the checkpoint's optimiser groups hold other parameters than this run's "
                         f"({[len(g) for g in stored]} vs {[len(g) for g in live]} per group)")
    without = {fqn for fqn, state in optim_sd["state"].items()
               if not all(f"optim.{fqn}.{key}" in saved for key in state)}
    flat = {k: v for k, v in flat.items()
            if not (k.startswith("optim.") and k[len("optim."):].rsplit(".", 1)[0] in without)}
    with _quiet_single_process():
        dcp.load(flat, storage_reader=reader, no_dist=_one_process())
    set_model_state_dict(module, model_sd)
    optim_sd = {"state": {fqn: s for fqn, s in optim_sd["state"].items() if fqn not in without},
                "param_groups": [dict(g) for g in param_groups]}
    set_optimizer_state_dict(module, optimizer, optim_sd)


__all__ = ["SHARD_PREFIX", "load_sharded", "save_sharded"]
