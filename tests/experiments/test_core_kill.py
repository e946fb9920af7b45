"""``recall`` and ``crowding`` killed mid-run (``os._exit``, like kill -9: no cleanup, no Ctrl-C checkpoint)
resume from their periodic checkpoints and finish with the results of an uninterrupted run: the same weights
(SHA-256), loss histories and test numbers."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from bayeslayer.experiments import crowding, recall
from bayeslayer.training import CheckpointStore

from ..training.faults import KILLED, run_killed_at, single_thread

RECALL = replace(recall.PRESETS["tiny"], num_pairs=2, address_dim=4, n_b=2, train_n_f=(1, 2), test_n_f=(1, 4),
                 test_rho=(0.6, 0.9), test_n_f_for_rho=2, eval_sequences=4, curve_points=2, curve_sequences=2,
                 curve_n_f=(4,), curve_rho=(0.9,), steps=8, batch_size=4, seeds=2)
CROWDING = replace(crowding.PRESETS["tiny"], num_values=8, train_n=(8, 12), test_load=(1, 2), eval_sequences=4,
                   num_queries=4, steps=8, batch_size=4, seeds=2)
EXPERIMENTS = {"recall": (recall, recall.RecallConfig, RECALL), "crowding": (crowding, crowding.CrowdingConfig,
                                                                            CROWDING)}
MODEL = "delta"


def _without_times(obj):
    """The record without wall-clock times (the only numbers a resumed run may change)."""
    if isinstance(obj, dict):
        return {k: _without_times(v) for k, v in obj.items() if k != "train_seconds"}
    if isinstance(obj, list):
        return [_without_times(v) for v in obj]
    return obj


def _killed_at_step(module, kill_step: int):
    """Run ``fn`` with ``module.sampler`` patched: the first request for step ``kill_step``'s batch exits the
    process at once."""
    original = module.sampler

    def sampler(*args):
        inner = original(*args)

        def sample_batch(step, batch_size, generator):
            if step == kill_step:
                os._exit(KILLED)
            return inner(step, batch_size, generator)

        return sample_batch

    module.sampler = sampler  # only ever in the forked child


@pytest.mark.parametrize("experiment", sorted(EXPERIMENTS))
def test_kill_mid_run_resumes_bit_identical(experiment, tmp_path, capfd):
    module, config_type, preset = EXPERIMENTS[experiment]
    out = tmp_path / "out"

    def run(checkpoint_every: int = 3, out_dir: Path | None = out):
        return module.run(config_type(preset=preset, models=(MODEL,), out=str(out_dir) if out_dir else None,
                                      progress=False, checkpoint_every=checkpoint_every))

    def killed(kill_step: int):
        _killed_at_step(module, kill_step)
        run()

    runs = out / "runs"
    name = f"{experiment}_{preset.name}_{MODEL}"
    with single_thread():
        reference = run(0, None)  # uninterrupted, never checkpointed
        # kill 1: seed 0 at step 7, one step after its checkpoint at step 6
        assert run_killed_at(lambda: killed(7), None)[0] == KILLED
        assert CheckpointStore(runs / f"{name}_seed0.ckpt").pointed().name == "step-00000006"
        assert not (out / f"{experiment}.json").exists()
        # kill 2, of the resumed run: seed 0 finishes from step 6, seed 1 is killed at step 5 (checkpoint at 3)
        capfd.readouterr()
        assert run_killed_at(lambda: killed(5), None)[0] == KILLED
        assert f"resuming from step 6 ({runs / f'{name}_seed0.ckpt'}" in capfd.readouterr().err
        assert (runs / f"{name}_seed0.json").exists() and not (runs / f"{name}_seed0.ckpt").exists()
        assert CheckpointStore(runs / f"{name}_seed1.ckpt").pointed().name == "step-00000003"
        resumed = run()
        assert f"resuming from step 3 ({runs / f'{name}_seed1.ckpt'}" in capfd.readouterr().err
    seeds, ref_seeds = resumed["models"][MODEL]["seeds"], reference["models"][MODEL]["seeds"]
    assert [s["weights_sha256"] for s in seeds] == [s["weights_sha256"] for s in ref_seeds]
    assert [s["loss_curve"] for s in seeds] == [s["loss_curve"] for s in ref_seeds]
    assert _without_times(resumed["models"]) == _without_times(reference["models"])
    assert resumed["config"]["train"]["checkpoint_every"] == 3
    assert not any(p.name.endswith(".ckpt") for p in runs.iterdir())  # removed once each seed finished


def test_the_checkpoint_interval_is_checked_and_reaches_the_training_config():
    with pytest.raises(ValueError, match="checkpoint_every"):
        recall.RecallConfig(preset=RECALL, checkpoint_every=-1)
    with pytest.raises(TypeError, match="checkpoint_every"):
        crowding.CrowdingConfig(preset=CROWDING, checkpoint_every=2.0)
    assert recall.RecallConfig(preset=RECALL).checkpoint_every == 100


def test_cli_checkpoint_option_and_the_printed_resume_folder(tmp_path, capsys):
    from bayeslayer.cli import main as cli_main

    assert cli_main(["recall", "--checkpoint-every", "-1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--checkpoint-every" in err and err.count("\n") == 1
    out = tmp_path / "out"
    assert cli_main(["crowding", "--preset", "tiny", "--models", "delta", "--steps", "2", "--seeds", "1",
                     "--checkpoint-every", "1", "--no-progress", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"checkpoints (every 1 steps and on Ctrl-C) go to {out / 'runs'}" in printed
    assert "rerun the same command to resume" in printed
