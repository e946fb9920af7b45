"""One run per output folder: a second run is refused with a message naming the first (pid,
command), touches nothing, and the first finishes unharmed; a killed holder frees the folder."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bayeslayer.experiments.common.harness import TrainConfig, train, train_seeds
from bayeslayer.training import FolderBusyError, OutputLock

from ..experiments.test_harness import make_model, sample_copy
from .faults import single_thread

ROOT = Path(__file__).resolve().parents[2]

_HOLD = """
import sys
from bayeslayer.training import OutputLock
with OutputLock(sys.argv[1]):
    print("locked", flush=True)
    sys.stdin.read()  # hold the lock until the parent closes stdin
"""

# Run A: a harness run that pauses before step 3 until the parent creates a file.
_RUN_A = """
import hashlib, os, sys, time
import torch
sys.path.insert(0, sys.argv[3])
from tests.experiments.test_harness import make_model, sample_copy
from bayeslayer.experiments.common.harness import TrainConfig, train

go = sys.argv[2]
def sample(step, batch_size, generator):
    if step == 3:
        print("paused", flush=True)
        while not os.path.exists(go):
            time.sleep(0.05)
    return sample_copy(step, batch_size, generator)

torch.set_num_threads(1)
model = make_model()
train(model, sample, TrainConfig(steps=6, batch_size=8, lr=1e-2, checkpoint_every=2), checkpoint_path=sys.argv[1],
      progress=False)
h = hashlib.sha256()
for name, t in model.state_dict().items():
    h.update(name.encode() + t.numpy().tobytes())
print(h.hexdigest(), flush=True)
"""


def _wait_for(proc: subprocess.Popen, line: str) -> None:
    got = proc.stdout.readline().strip()
    assert got == line, f"child said {got!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_a_second_run_is_refused_naming_the_holder_and_a_killed_holder_frees_the_folder(tmp_path):
    folder = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    try:
        _wait_for(proc, "locked")
        with pytest.raises(FolderBusyError, match=rf"{folder} is in use by another run \(pid {proc.pid} on .*-c"):
            train(make_model(), sample_copy, TrainConfig(steps=2, batch_size=4), checkpoint_path=folder,
                  progress=False)
        with pytest.raises(FolderBusyError, match=f"pid {proc.pid}"):
            train_seeds("toy", make_model, sample_copy, TrainConfig(steps=2, batch_size=4), [0], lambda m: {},
                        run_dir=str(folder), progress=False)
        assert sorted(p.name for p in folder.iterdir()) == [".lock"]  # the refused runs wrote nothing
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with OutputLock(folder) as lock:  # the OS released the dead holder's lock
        assert lock.held
    with OutputLock(folder), pytest.raises(FolderBusyError):
        OutputLock(folder).acquire()  # two locks in one process exclude each other too


def test_the_first_run_is_unharmed_by_a_refused_second(tmp_path):
    cfg = TrainConfig(steps=6, batch_size=8, lr=1e-2, checkpoint_every=2)
    with single_thread():  # as run A, so the floats are reduced in the same order
        ref = make_model()
        train(ref, sample_copy, cfg, progress=False)
    h = hashlib.sha256()
    for name, t in ref.state_dict().items():
        h.update(name.encode() + t.numpy().tobytes())

    folder, go = tmp_path / "run.ckpt", tmp_path / "go"
    proc = subprocess.Popen([sys.executable, "-c", _RUN_A, str(folder), str(go), str(ROOT)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    try:
        _wait_for(proc, "paused")  # run A holds the folder and has a checkpoint at step 2
        before = {p.relative_to(folder): p.stat().st_mtime_ns for p in folder.rglob("*")}
        with pytest.raises(FolderBusyError, match=f"pid {proc.pid}"):
            train(make_model(), sample_copy, cfg, checkpoint_path=folder, progress=False)
        assert {p.relative_to(folder): p.stat().st_mtime_ns for p in folder.rglob("*")} == before
        go.touch()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert out.split()[-1] == h.hexdigest()  # run A ends with the uninterrupted run's weights
