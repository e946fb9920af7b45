"""The checkpoint folders of a synthetic-task run (:func:`bayeslayer.experiments.common.harness.train`):
``model.safetensors`` (the ``state_dict``, tied weights stored once) beside the trainer state, which records
the :class:`~bayeslayer.training.loop.TrainConfig` and the task/model ``identity`` a resume must match."""

from __future__ import annotations

import warnings
from dataclasses import asdict

import torch.nn as nn

from ...training import CheckpointError, CheckpointStore
from ...training.loop import Checkpoints, LoopState, TrainConfig

# TrainConfig fields that never change what a run computes (when checkpoints are written): a checkpoint or
# a cached seed written with another value is resumed or reused all the same
BOOKKEEPING = frozenset({"checkpoint_every"})


def harness_settings(config: dict) -> dict:
    """A :class:`TrainConfig` as a dict (``asdict`` or read back from JSON) without its bookkeeping fields."""
    return {k: v for k, v in config.items() if k not in BOOKKEEPING}


def _save_weights(model: nn.Module, path) -> None:
    from safetensors.torch import save_file

    # a tied weight appears under two names; safetensors stores tensors that share memory only once
    seen: set[int] = set()
    weights = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        weights[name] = t.contiguous().clone() if t.data_ptr() in seen or not t.is_contiguous() else t
        seen.add(t.data_ptr())
    save_file(weights, str(path), metadata={"format": "pt"})


def _load_weights(model: nn.Module, path) -> None:
    from safetensors.torch import load_file

    model.load_state_dict(load_file(str(path), device="cpu"))


class HarnessCheckpoints(Checkpoints):
    """The harness's checkpoint folders: ``model.safetensors`` (the ``state_dict``) and the trainer state,
    which records the :class:`TrainConfig` and ``identity`` a resume must match."""

    def __init__(self, store: CheckpointStore, model: nn.Module, config: TrainConfig, identity,
                 restart_on_mismatch: bool) -> None:
        super().__init__(store)
        self.model, self.config, self.identity, self.restart = model, config, identity, restart_on_mismatch

    def find(self):
        self.store.recover()
        try:
            return self.store.load()
        except CheckpointError as exc:
            if not self.restart:
                raise
            warnings.warn(f"{exc}; starting this run from scratch", RuntimeWarning, stacklevel=5)
            self.store.discard()
            return None

    def accept(self, checkpoint, state) -> bool:
        config = harness_settings(asdict(self.config))
        saved = harness_settings(state["config"]) if isinstance(state["config"], dict) else state["config"]
        if saved == config and state.get("identity") == self.identity:
            return True
        which = ("config", saved, config) if saved != config else (
            "task/model settings", state.get("identity"), self.identity)
        message = f"checkpoint {checkpoint} was written with {which[0]} {which[1]}, not {which[2]}"
        if not self.restart:
            raise ValueError(f"{message}; remove {self.store.root} or use the same {which[0]}")
        warnings.warn(f"{message}; starting this run from scratch", RuntimeWarning, stacklevel=5)
        return False

    def write_weights(self, directory) -> None:
        _save_weights(self.model, directory / "model.safetensors")

    def read_weights(self, directory) -> None:
        _load_weights(self.model, directory / "model.safetensors")

    def extra_state(self, state: LoopState) -> dict:
        return {"config": asdict(self.config), "identity": self.identity}
