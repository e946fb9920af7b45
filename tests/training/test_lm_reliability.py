"""The LM loop on disk: Ctrl-C stops after the step with a checkpoint and a resumed run says where it
resumed and ends bit-identical; damaged checkpoint files (model config, weights, trainer state,
manifest) are named and an older checkpoint used; a failed start records no config; a folder in
use is refused before anything in it is touched."""

from __future__ import annotations

import json
import os
import shutil
import signal
from dataclasses import replace
from pathlib import Path

import pytest

from bayeslayer.experiments.common.lm_run import latest_checkpoint, train_lm
from bayeslayer.training import CheckpointError, FolderBusyError, TrainingInterrupted

from .faults import single_thread, tiny_lm
from .test_lock import hold


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_rel")
    config, cache = tiny_lm(root, steps=6, eval_every=3)
    with single_thread():
        ref = train_lm(config, root / "reference", cache_dir=cache, progress=False)
    return config, cache, ref


def _steps(run: Path) -> list[int]:
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r["event"] == "train"]


def test_ctrl_c_stops_after_the_step_with_a_checkpoint_and_resumes_exactly(tmp_path, setup, capsys):
    config, cache, ref = setup
    run = tmp_path / "run"

    def ctrl_c_at_3(step, loss):
        if step == 3:
            signal.raise_signal(signal.SIGINT)

    with single_thread():
        with pytest.raises(TrainingInterrupted, match=r"interrupted at step 3; saved it to .*step-00000003"):
            train_lm(config, run, cache_dir=cache, progress=False, on_step=ctrl_c_at_3)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
        assert latest_checkpoint(run).name == "step-00000003"
        capsys.readouterr()
        resumed = train_lm(config, run, cache_dir=cache, progress=False)  # the lock was released
    assert f"resuming from step 3 ({run / 'checkpoints' / 'step-00000003'})" in capsys.readouterr().err
    assert resumed.summary["weights_sha256"] == ref.summary["weights_sha256"] and resumed.losses == ref.losses
    assert _steps(run) == list(range(1, 7))


def test_a_second_ctrl_c_mid_step_keeps_the_last_complete_checkpoint(tmp_path, setup):
    config, cache, ref = setup
    run = tmp_path / "run"

    def hard_stop_at_5(step, loss):
        if step == 5:
            raise KeyboardInterrupt  # as a second Ctrl-C would, before step 5 was saved

    with single_thread():
        with pytest.raises(TrainingInterrupted, match=r"last complete checkpoint is .*step-00000004"):
            train_lm(config, run, cache_dir=cache, progress=False, on_step=hard_stop_at_5)
        resumed = train_lm(config, run, cache_dir=cache, progress=False)
    assert resumed.resumed_from == 4 and resumed.summary["weights_sha256"] == ref.summary["weights_sha256"]
    assert _steps(run) == list(range(1, 7))  # step 5, logged before the stop, is not there twice


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "trainer_state.json",
                                  "trainer_state.safetensors", "manifest.json"])
def test_a_flipped_byte_in_an_lm_checkpoint_is_named_and_the_older_one_used(tmp_path, setup, name):
    config, cache, ref = setup
    run = tmp_path / "run"
    with single_thread():
        train_lm(config, run, cache_dir=cache, progress=False, stop_after=4, keep_checkpoints=2)
        path = run / "checkpoints" / "step-00000004" / name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        with pytest.warns(RuntimeWarning, match=rf"step-00000004/{name}.*falling back.*step-00000002"):
            resumed = train_lm(config, run, cache_dir=cache, progress=False, keep_checkpoints=2)
    assert resumed.resumed_from == 2 and resumed.summary["weights_sha256"] == ref.summary["weights_sha256"]
    assert _steps(run) == list(range(1, 7))


def test_a_damaged_only_checkpoint_is_an_error_naming_the_file(tmp_path, setup):
    config, cache, _ = setup
    run = tmp_path / "run"
    with single_thread():
        train_lm(config, run, cache_dir=cache, progress=False, stop_after=2)
        (run / "checkpoints" / "step-00000002" / "trainer_state.json").write_text("{")
        with pytest.raises(CheckpointError, match="step-00000002/trainer_state.json has 1 bytes"):
            train_lm(config, run, cache_dir=cache, progress=False)
        (run / "config.json").write_text('{"mixer": ')  # truncated
        with pytest.raises(ValueError, match=r"configuration .*config.json is damaged or not JSON"):
            train_lm(config, run, cache_dir=cache, progress=False)


def test_a_failed_start_records_no_config_so_the_corrected_command_runs(tmp_path, setup):
    config, cache, _ = setup
    run = tmp_path / "run"
    bad = replace(config, mixer_kwargs={"no_such_option": 1}, steps=2, checkpoint_every=0, eval_every=0)
    with single_thread():
        with pytest.raises((TypeError, ValueError)):
            train_lm(bad, run, cache_dir=cache, progress=False)
        assert not (run / "config.json").exists() and not (run / "objective.json").exists()
        with pytest.raises((FileNotFoundError, ValueError)):
            train_lm(replace(config, source=str(tmp_path / "no-such-corpus")), run, cache_dir=cache, progress=False)
        assert not (run / "config.json").exists()
        good = train_lm(replace(bad, mixer_kwargs={}), run, cache_dir=cache, progress=False)
    assert good.finished


def test_a_folder_in_use_is_refused_before_anything_is_written(tmp_path, setup):
    config, cache, _ = setup
    run = tmp_path / "run"
    holder = hold(run)  # a second process holding the folder's lock
    try:
        assert holder.readline() == "locked"
        with pytest.raises(FolderBusyError, match=f"pid {holder.pid}"):
            train_lm(config, run, cache_dir=cache, progress=False)
        assert os.listdir(run) == [".lock"]
    finally:
        holder.kill()
        holder.wait()
    shutil.rmtree(run)
