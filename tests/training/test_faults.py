"""A kill at every filesystem step of training (checkpoint saves included) leaves a run that resumes
and finishes bit-identical to an uninterrupted one — for the harness loop and the LM loop."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from bayeslayer.experiments.common.harness import TrainConfig, train

from ..experiments.test_harness import make_model, sample_copy
from .faults import KILLED, run_killed_at, single_thread, tiny_lm


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode() + t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


HARNESS_CFG = TrainConfig(steps=6, batch_size=8, lr=1e-2, warmup_steps=1, checkpoint_every=2)


def _harness_run(ckpt: Path) -> tuple[str, list[float]]:
    model = make_model()
    res = train(model, sample_copy, HARNESS_CFG, checkpoint_path=str(ckpt), progress=False)
    return _digest(model), res.losses


def _harness_grid(tmp_path, points) -> tuple[int, list[int]]:
    """Kill the recall harness before each chosen disk operation (``points(total)``), resume, compare."""
    with single_thread():
        reference, ref_losses = _harness_run(tmp_path / "reference")
        code, total = run_killed_at(lambda: _harness_run(tmp_path / "count"), None)
        assert code == 0 and total > 40  # 3 checkpoint saves + 1 final, each ~13 steps
        chosen = points(total)
        for i in chosen:
            ckpt = tmp_path / f"kill{i}"
            code, _ = run_killed_at(lambda ckpt=ckpt: _harness_run(ckpt), i)
            assert code == KILLED, f"the child was not killed at operation {i}"
            digest, losses = _harness_run(ckpt)
            assert digest == reference, f"kill before disk operation {i}: the resumed run's weights differ"
            assert losses == ref_losses, f"kill before disk operation {i}: the loss history differs"
    return total, chosen


def test_harness_kill_at_every_sixth_disk_step_resumes_bit_identical(tmp_path):
    """Every sixth disk operation of the harness's run and its last one (checkpoints at steps 2, 4 and 6, then
    the final save, each 17 to 23 operations: every save is killed in two places or more); the slow test
    below kills at every one."""
    total, chosen = _harness_grid(tmp_path, lambda total: sorted({*range(0, total, 6), total - 1}))
    print(f"harness: {len(chosen)} kill points of {total}, all resumed bit-identical")


@pytest.mark.slow
def test_harness_kill_at_every_disk_step_resumes_bit_identical(tmp_path):
    total, _ = _harness_grid(tmp_path, lambda total: list(range(total)))
    print(f"harness: {total} kill points, all resumed bit-identical")


# ---------------------------------------------------------------------------- the LM loop

@pytest.fixture(scope="module")
def lm_setup(tmp_path_factory):
    return tiny_lm(tmp_path_factory.mktemp("lm_faults"))


def _lm_run(config, run_dir: Path, cache: str):
    from bayeslayer.experiments.common.lm_run import train_lm

    return train_lm(config, run_dir, cache_dir=cache, progress=False, keep_checkpoints=1)


def _lm_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r["event"] == "train"]


def _lm_grid(tmp_path, lm_setup, points) -> int:
    config, cache = lm_setup
    with single_thread():
        ref = _lm_run(config, tmp_path / "reference", cache)
        code, total = run_killed_at(lambda: _lm_run(config, tmp_path / "count", cache), None)
        assert code == 0
        chosen = points(total)
        for i in chosen:
            run = tmp_path / f"kill{i}"
            code, _ = run_killed_at(lambda run=run: _lm_run(config, run, cache), i)
            assert code == KILLED, f"the child was not killed at operation {i}"
            res = _lm_run(config, run, cache)
            assert res.finished and res.summary["weights_sha256"] == ref.summary["weights_sha256"], (
                f"kill before disk operation {i}: the resumed run's weights differ")
            assert res.losses == ref.losses, f"kill before disk operation {i}"
            assert _lm_steps(run) == [1, 2, 3, 4], f"kill before disk operation {i}: log {_lm_steps(run)}"
            assert json.loads((run / "train_summary.json").read_text())["weights_sha256"] == ref.summary[
                "weights_sha256"]
    return total


def test_lm_kill_at_every_tenth_disk_step_resumes_bit_identical(tmp_path, lm_setup):
    """Every tenth disk operation of a 4-step run (checkpoints at steps 2 and 4, keep=1, final/);
    the slow test below kills at every one."""
    total = _lm_grid(tmp_path, lm_setup, lambda total: list(range(0, total, 10)))
    print(f"lm: {len(range(0, total, 10))} kill points of {total}, all resumed bit-identical")


@pytest.mark.slow
def test_lm_kill_at_every_disk_step_resumes_bit_identical(tmp_path, lm_setup):
    total = _lm_grid(tmp_path, lm_setup, lambda total: list(range(total)))
    print(f"lm: {total} kill points, all resumed bit-identical")
