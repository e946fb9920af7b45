"""The learned collision-recall task: its presets, training batches and model.

:mod:`bayeslayer.experiments.recall` trains and tests these over seeds;
:mod:`bayeslayer.experiments.variance` re-trains the BL model from them.  The task's batches are
:func:`bayeslayer.data.collision_tasks.collision_recall_batch`; the models the recurrent cores of
:mod:`bayeslayer.experiments.common.recall_models`, addresses fed directly as key and query.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from ...data.collision_tasks import collision_recall_batch
from .recall_models import build_core_model
from .recall_sweep import CorePreset


@dataclass(frozen=True)
class RecallPreset(CorePreset):
    """Everything a recall run depends on; ``paper`` is the paper's budget (docs/theory.md §8.2).

    The first fields (name, steps, batch size, seeds, ``eval_sequences`` — sequences per evaluation
    point, 8 queries each — and the optimiser's) are :class:`~bayeslayer.experiments.common.recall_sweep.CorePreset`'s.
    """

    n_b: int = 4
    num_pairs: int = 8
    address_dim: int = 16
    train_n_f: tuple[int, ...] = (1, 2, 4, 8)
    train_rho: tuple[float, float] = (0.60, 0.80)
    test_n_f: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    test_rho_for_n_f: float = 0.80
    test_rho: tuple[float, ...] = (0.60, 0.65, 0.70, 0.75, 0.80, 0.85, 0.90, 0.95)
    test_n_f_for_rho: int = 64
    eval_batch: int = 32  # sequences per forward pass at evaluation (memory)
    eval_seed: int = 1234
    curve_points: int = 10  # evaluations during training (0: none); every steps // curve_points steps
    curve_sequences: int = 32  # sequences per monitoring point
    curve_n_f: tuple[int, ...] = (64, 128, 256)
    curve_rho: tuple[float, ...] = (0.80, 0.90, 0.95)

    def eval_every(self) -> int:
        """Every ``steps // curve_points`` steps (at least 1); 0 (only at the end) without learning curves."""
        return max(1, self.steps // self.curve_points) if self.curve_points else 0


_DEFAULT = RecallPreset("default", steps=600, batch_size=64, seeds=2, eval_sequences=64)
PRESETS = {
    "paper": RecallPreset("paper", steps=2500, batch_size=256, seeds=3, eval_sequences=256),
    # Sized from step times measured on the idle 2-core CPU (batch 64, T ≈ 70, one thread: BL 0.13 s,
    # Delta 0.07 s, LA 0.05 s, GLA 0.2 s): all four models, two seeds, training and the test sweeps
    # in roughly 10-15 minutes when the machine is idle (BL fits the training range in ~200 steps).
    "default": _DEFAULT,
    # The default with 3× the steps and nothing else changed: does the default budget limit recall?
    # (An independent check moved Delta's recall at n_f = 256 from 0.26 to 0.36 at 3× the steps.)
    "long": replace(_DEFAULT, name="long", steps=3 * _DEFAULT.steps),
    # Seconds-long smoke run (tests, trying the command out).
    "tiny": RecallPreset("tiny", steps=20, batch_size=16, seeds=1, eval_sequences=8,
                         test_n_f=(1, 8, 32), test_rho=(0.6, 0.95), test_n_f_for_rho=8, curve_points=2,
                         curve_sequences=4, curve_n_f=(8,), curve_rho=(0.95,)),
}


def sampler(preset: RecallPreset):
    """Training batches: one ``n_f`` from ``train_n_f`` per batch, ``ρ ~ U[train_rho]`` per sequence."""
    lo, hi = preset.train_rho

    def sample_batch(step: int, batch_size: int, generator: torch.Generator):
        idx = int(torch.randint(len(preset.train_n_f), (1,), generator=generator))
        rho = lo + (hi - lo) * torch.rand(batch_size, generator=generator)
        return collision_recall_batch(batch_size, n_f=preset.train_n_f[idx], rho=rho, generator=generator,
                                      n_b=preset.n_b, num_pairs=preset.num_pairs,
                                      address_dim=preset.address_dim)

    return sample_batch


def build_model(kind: str, preset: RecallPreset) -> nn.Module:
    return build_core_model(kind, input_dim=1 + preset.address_dim + 2 * preset.num_pairs,
                            num_classes=2 * preset.num_pairs, address_start=1, address_dim=preset.address_dim,
                            head_dim=preset.address_dim)
