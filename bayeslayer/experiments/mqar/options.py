"""What an MQAR run is told: :class:`MQARConfig` (every field checked, every model solved before the first one
trains) and the ``bayeslayer mqar`` arguments that build it (:func:`preset_from_args`, :func:`config_from_args`)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ...checks import check_int
from ...errors import UsageError
from ...training.compute_match import check_mode
from ...training.distributed import resolve_device
from ..common.mqar_setup import (
    LOWRANK_PREFIX,
    PRESETS,
    TASK_NAMES,
    MQARPreset,
    known_mixers,
    lowrank_rank,
    model_config,
)
from ..common.options import check_out_dir

DEFAULT_MIXERS = ("bayesian", "gated_deltanet", "gated_deltanet_noconv", "mamba2", "linear_attention")
#: the mixer whose run sets the budget of ``--compute-match flops|time``
REFERENCE = "bayesian"


def _check_mixers(mixers: Sequence[str]) -> list[str]:
    mixers = list(mixers)
    known = known_mixers()
    bad = [m for m in mixers if m not in known and lowrank_rank(m) is None]
    if not mixers or bad or len(set(mixers)) != len(mixers):
        raise ValueError(f"mixers must be distinct names from {known} or {LOWRANK_PREFIX}<r>; got {mixers}")
    return mixers



@dataclass(frozen=True)
class MQARConfig:
    """One MQAR run: ``task`` (one of :data:`TASK_NAMES`), ``preset`` (an :class:`MQARPreset`; default
    ``PRESETS["default"]``), ``mixers`` (distinct names of :func:`known_mixers` or ``bayesian_lowrank<r>``),
    ``out`` (the folder for ``<stem>.json``, its PNG and the ``runs/`` cache; ``None``: write nothing),
    ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device``: where models, batches and
    evaluation run), ``progress`` (a progress bar) and ``compute_match`` (``steps``, ``flops`` or ``time``: what
    every mixer gets of the reference :data:`REFERENCE`'s compute at the same width, learning rate and seed,
    :mod:`~bayeslayer.training.compute_match`).

    Every field is checked here, with its name in the error, and every mixer's model is solved at every
    width of the task, so a bad mixer fails before the first one trains.
    """

    task: str
    preset: MQARPreset = PRESETS["default"]
    mixers: tuple[str, ...] = DEFAULT_MIXERS
    out: str | None = None
    device: str | torch.device = "cpu"
    progress: bool = True
    compute_match: str = "steps"

    def __post_init__(self):
        if self.task not in TASK_NAMES:
            raise ValueError(f"task must be one of {TASK_NAMES}, got {self.task!r}")
        if not isinstance(self.preset, MQARPreset):
            raise TypeError(f"preset must be an MQARPreset, got {type(self.preset).__name__}")
        if isinstance(self.mixers, str):
            raise TypeError(f"mixers must be a sequence of mixer names, not the string {self.mixers!r}")
        object.__setattr__(self, "mixers", tuple(_check_mixers(self.mixers)))
        if self.out is not None and not isinstance(self.out, (str, os.PathLike)):
            raise TypeError(f"out must be a folder path or None, got {type(self.out).__name__}")
        if self.out is not None:
            object.__setattr__(self, "out", os.fspath(self.out))
        if not isinstance(self.device, (str, torch.device)):
            raise TypeError(f"device must be a device name or torch.device, got {type(self.device).__name__}")
        try:
            torch.device(self.device)
        except (RuntimeError, ValueError):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:<index>', got {self.device!r}") from None
        if not isinstance(self.progress, bool):
            raise TypeError(f"progress must be a bool, got {type(self.progress).__name__}")
        check_mode(self.compute_match)
        if self.compute_match == "time" and REFERENCE not in self.mixers:
            raise ValueError(f"compute_match='time' measures the budget on the reference {REFERENCE!r}: include it "
                             f"in mixers (got {list(self.mixers)})")
        for mixer in self.mixers:  # every model must be buildable before the first one trains
            for width in self.widths():
                model_config(mixer, self.preset, width)

    def widths(self) -> tuple[int, ...]:
        """The model widths of the task: Base sweeps the preset's widths, Update and Block use one."""
        return tuple(self.preset.base_widths) if self.task == "base" else (self.preset.width,)



# -- command line ------------------------------------------------------------------------------------
def preset_from_args(args: argparse.Namespace) -> MQARPreset:
    preset = PRESETS[args.preset]
    over: dict[str, Any] = {}
    for name in ("epochs", "batch_size", "seeds", "num_layers", "max_steps"):
        val = getattr(args, name)
        if val is not None:
            check_int(f"--{name.replace('_', '-')}", val, minimum=1)
            over[name] = val
    if args.lr is not None:
        bad = [lr for lr in args.lr if not (math.isfinite(lr) and lr > 0)]
        if bad:
            raise ValueError(f"--lr values must be finite and > 0, got {bad}")
        over["lrs"] = tuple(args.lr)
    # layout and gate are recorded in the JSON and its file name, so they do not rename the preset
    return replace(preset, **over, name=preset.name if not over else f"{preset.name}-custom",
                   layout=args.layout or preset.layout, gate=args.gate or preset.gate)


def config_from_args(args: argparse.Namespace) -> MQARConfig:
    """The :class:`MQARConfig` that ``bayeslayer mqar`` arguments name (``--device auto``: cuda when available)."""
    if args.task is None:
        raise UsageError("name a task: bayeslayer mqar {base,update,block}")
    device = str(resolve_device(args.device))
    return MQARConfig(task=args.task, preset=preset_from_args(args), mixers=tuple(args.mixers),
                      out=str(check_out_dir(args.out)), device=device, progress=not args.no_progress,
                      compute_match=args.compute_match)
