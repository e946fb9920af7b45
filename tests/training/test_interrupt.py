"""Ctrl-C in the harness loop: the first stops after the step with a checkpoint, a second one mid-step
keeps the last complete checkpoint; either way the folder is unlocked and resuming gives the
uninterrupted run's weights and losses."""

from __future__ import annotations

import signal

import pytest
import torch

from bayeslayer.experiments.common.harness import TrainConfig, train
from bayeslayer.training import TrainingInterrupted

from ..experiments.test_harness import make_model, sample_copy

CFG = TrainConfig(steps=8, batch_size=8, lr=1e-2, checkpoint_every=3)


def _interrupting(at: int, how):
    def sample(step, batch_size, generator):
        if step == at:
            how()
        return sample_copy(step, batch_size, generator)

    return sample


def _ctrl_c():
    signal.raise_signal(signal.SIGINT)


def _hard():
    raise KeyboardInterrupt


@pytest.mark.parametrize(("how", "message", "saved"), [
    (_ctrl_c, r"interrupted at step 5; saved it to .*step-00000005", 5),
    (_hard, r"interrupted after step 4; the last complete checkpoint is .*step-00000003", 3),
])
def test_ctrl_c_leaves_a_resumable_run_that_ends_as_an_uninterrupted_one(tmp_path, how, message, saved, capsys):
    ref = make_model()
    ref_res = train(ref, sample_copy, CFG, progress=False)
    ckpt = tmp_path / "run.ckpt"
    with pytest.raises(TrainingInterrupted, match=message) as info:
        train(make_model(), _interrupting(4, how), CFG, checkpoint_path=ckpt, progress=False)
    assert isinstance(info.value, KeyboardInterrupt) and info.value.step in (saved, 4)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    capsys.readouterr()
    model = make_model(seed=9)
    res = train(model, sample_copy, CFG, checkpoint_path=ckpt, progress=False)
    assert f"resuming from step {saved} ({ckpt / f'step-{saved:08d}'})" in capsys.readouterr().err
    assert res.losses == ref_res.losses
    for a, b in zip(ref.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
