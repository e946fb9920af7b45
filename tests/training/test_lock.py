"""One run per output folder: a second run is refused with a message naming the first (pid,
command), touches nothing, and the first finishes unharmed; a killed holder frees the folder.

The first run is a second process forked from the test's (:class:`tests.training.faults.Forked`): the lock is
the operating system's, between processes, and needs no fresh interpreter."""

from __future__ import annotations

import hashlib
import re
import sys
import time
from pathlib import Path

import pytest

from bayeslayer.experiments.common.harness import TrainConfig, train, train_seeds
from bayeslayer.training import FolderBusyError, OutputLock

from ..experiments.test_harness import make_model, sample_copy
from .faults import Forked, hold_until_killed, single_thread


def hold(folder: Path) -> Forked:
    """A second process (forked) that holds ``folder``'s lock until it is killed; its command line, as the lock
    records it, is ``lock-holder FOLDER``.  Call ``readline()`` for its "locked"."""
    def child(say):
        sys.argv = ["lock-holder", str(folder)]
        with OutputLock(folder):
            say("locked")
            hold_until_killed()

    return Forked(child)


def _digest(model) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode() + t.numpy().tobytes())
    return h.hexdigest()


def test_a_second_run_is_refused_naming_the_holder_and_a_killed_holder_frees_the_folder(tmp_path):
    folder = tmp_path / "out"
    holder = hold(folder)
    try:
        assert holder.readline() == "locked"
        with pytest.raises(FolderBusyError, match=rf"{re.escape(str(folder))} is in use by another run \(pid "
                                                  rf"{holder.pid} on .*: \S+ lock-holder {re.escape(str(folder))}"):
            train(make_model(), sample_copy, TrainConfig(steps=2, batch_size=4), checkpoint_path=folder,
                  progress=False)
        with pytest.raises(FolderBusyError, match=f"pid {holder.pid}"):
            train_seeds("toy", make_model, sample_copy, TrainConfig(steps=2, batch_size=4), [0], lambda m: {},
                        run_dir=str(folder), progress=False)
        assert sorted(p.name for p in folder.iterdir()) == [".lock"]  # the refused runs wrote nothing
    finally:
        holder.kill()
        holder.wait()
    with OutputLock(folder) as lock:  # the OS released the dead holder's lock
        assert lock.held
    with OutputLock(folder), pytest.raises(FolderBusyError):
        OutputLock(folder).acquire()  # two locks in one process exclude each other too


def test_the_first_run_is_unharmed_by_a_refused_second(tmp_path):
    """Run A (a second process) pauses before step 3, holding its folder with a checkpoint at step 2; a second run
    there is refused and changes nothing; run A then ends with the uninterrupted run's weights."""
    cfg = TrainConfig(steps=6, batch_size=8, lr=1e-2, checkpoint_every=2)
    folder, go = tmp_path / "run.ckpt", tmp_path / "go"

    def run_a(say):
        def sample(step, batch_size, generator):
            if step == 3:
                say("paused")
                while not go.exists():
                    time.sleep(0.05)
            return sample_copy(step, batch_size, generator)

        model = make_model()
        train(model, sample, cfg, checkpoint_path=folder, progress=False)
        say(_digest(model))

    with single_thread():  # run A and the reference alike, so the floats are reduced in the same order
        ref = make_model()
        train(ref, sample_copy, cfg, progress=False)
        run = Forked(run_a)
        try:
            assert run.readline() == "paused"  # run A holds the folder and has a checkpoint at step 2
            before = {p.relative_to(folder): p.stat().st_mtime_ns for p in folder.rglob("*")}
            with pytest.raises(FolderBusyError, match=f"pid {run.pid}"):
                train(make_model(), sample_copy, cfg, checkpoint_path=folder, progress=False)
            assert {p.relative_to(folder): p.stat().st_mtime_ns for p in folder.rglob("*")} == before
            go.touch()
            digest = run.readline()
        finally:
            if not go.exists():  # the test failed before letting run A go on
                run.kill()
            run.wait()
    assert run.returncode == 0, "run A failed (its traceback is on stderr)"
    assert digest == _digest(ref)  # run A ends with the uninterrupted run's weights
