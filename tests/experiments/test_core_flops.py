"""The recall and crowding models' FLOP counts (``CoreModel.flops``) against ``FlopCounterMode``: every core
kind, within 10%, forward and backward (the address is a fixed input: keys and queries need no gradient)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bayeslayer.experiments import crowding
from bayeslayer.experiments.common.harness import batch_generator, masked_cross_entropy
from bayeslayer.experiments.common.recall_models import ALL_KINDS, LOWRANK_KINDS
from bayeslayer.experiments.common.recall_task import PRESETS, build_model, sampler
from bayeslayer.training.flop_counter import measure_training_flops

pytestmark = pytest.mark.usefixtures("no_opt_einsum")


def check(model, batch):
    meas = measure_training_flops(lambda: masked_cross_entropy(model(batch.inputs), batch.labels))
    count = model.flops(*batch.inputs.shape[:2])
    for phase in ("forward", "backward"):
        ours, theirs = getattr(count, phase), getattr(meas.flops, phase)
        assert abs(ours - theirs) <= 0.10 * theirs, (phase, ours, theirs, meas.by_op)


# the low-rank cores run their covariance token by token: two ranks by default, the rest with -m slow; they count
# on a shorter task (4 pairs written twice, at most 2 fillers: 20 tokens instead of 56), since the counter's cost
# grows with the tokens and the count's agreement does not depend on how many there are
SLOW_KINDS = {"bayesian_lowrank1", "bayesian_lowrank4", "bayesian_lowrank8", "bayesian_lowrank16"}
SHORT = replace(PRESETS["tiny"], num_pairs=4, n_b=2, train_n_f=(1, 2))


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_KINDS else k
                                  for k in ALL_KINDS])
def test_recall_model_step(kind):
    preset = SHORT if kind in LOWRANK_KINDS else PRESETS["tiny"]
    batch = sampler(preset)(0, 4, batch_generator(0, 0))
    assert batch.inputs.shape[:2] == ((4, 20) if preset is SHORT else (4, 56))
    check(build_model(kind, preset), batch)


def test_crowding_model_step():
    preset = crowding.PRESETS["tiny"]
    projection = crowding.crowding_projection(preset.address_dim, preset.source_dim, preset.projection_seed)
    check(crowding.build_model("bayesian", preset), crowding.sampler(preset, projection)(0, 4, batch_generator(0, 0)))
