"""An LM run folder that was tampered with between runs: a damaged ``final/`` of a finished run is
named and rewritten (not reported as finished as it is), a truncated ``log.jsonl`` is a warning that
says how much was lost, and planted links in the run folder are refused with their targets kept."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from bayeslayer.experiments.common.lm_run import train_lm
from bayeslayer.files import UnsafeFileError
from bayeslayer.models.loading import verify_model_dir
from bayeslayer.training.lm import load_run

from .faults import single_thread, tiny_lm


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_files")
    config, cache = tiny_lm(root, steps=4)
    with single_thread():
        ref = train_lm(config, root / "reference", cache_dir=cache, progress=False)
    return config, cache, ref, root / "reference"


def test_final_carries_a_manifest_that_verifies(setup):
    *_, run = setup
    assert verify_model_dir(run / "final")
    load_run(run)


@pytest.mark.parametrize("damage", ["empty config.json", "flipped weights byte", "missing lm_config.json"])
def test_a_finished_run_with_a_damaged_final_says_so_and_rewrites_it(tmp_path, setup, damage):
    config, cache, ref, reference = setup
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    final = run / "final"
    if damage == "empty config.json":
        (final / "config.json").write_text("")
    elif damage == "flipped weights byte":
        data = bytearray((final / "model.safetensors").read_bytes())
        data[-3] ^= 0x01
        (final / "model.safetensors").write_bytes(bytes(data))
    else:
        (final / "lm_config.json").unlink()
    with pytest.raises((ValueError, OSError)):
        load_run(run)
    with single_thread(), pytest.warns(RuntimeWarning, match=f"{final} was damaged"):
        again = train_lm(config, run, cache_dir=cache, progress=False)
    assert again.finished and verify_model_dir(final)
    assert again.summary["weights_sha256"] == ref.summary["weights_sha256"]
    load_run(run)


def test_a_truncated_log_is_a_warning_that_counts_the_loss(tmp_path, setup):
    config, cache, _, _ = setup
    run = tmp_path / "run"
    with single_thread():
        train_lm(config, run, cache_dir=cache, progress=False, stop_after=2)
        log = run / "log.jsonl"
        text = log.read_text()
        log.write_text(text[: text.index("\n") + 10])  # the start line, then 10 bytes of the next
        with pytest.warns(RuntimeWarning) as caught:
            train_lm(config, run, cache_dir=cache, progress=False)
    messages = [str(w.message) for w in caught]
    assert any(f"{log}: 1 damaged line(s) dropped" in m for m in messages), messages
    assert any("the entries of steps 1..2 are lost" in m for m in messages), messages


def test_a_symlinked_log_is_refused_and_its_target_kept(tmp_path, setup):
    config, cache, _, reference = setup
    run = tmp_path / "run"
    with single_thread():
        train_lm(config, run, cache_dir=cache, progress=False, stop_after=2)
    target = tmp_path / "precious.txt"
    target.write_text("precious\n")
    (run / "log.jsonl").unlink()
    os.symlink(target, run / "log.jsonl")
    with single_thread(), pytest.raises(UnsafeFileError, match="log.jsonl is a symbolic link"):
        train_lm(config, run, cache_dir=cache, progress=False)
    assert target.read_text() == "precious\n"


def test_a_symlinked_final_is_refused(tmp_path, setup):
    config, cache, _, reference = setup
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    elsewhere = tmp_path / "elsewhere"
    os.replace(run / "final", elsewhere)
    os.symlink(elsewhere, run / "final")
    with single_thread(), pytest.raises(UnsafeFileError, match="final is a symbolic link"):
        train_lm(config, run, cache_dir=cache, progress=False)
    assert verify_model_dir(elsewhere) and Path(run / "final").is_symlink()
