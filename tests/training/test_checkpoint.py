"""Checkpoint folders: the manifest catches flipped bytes in any file and names it; an older
checkpoint is used instead (with a warning) when one verifies; saving never removes the only
complete checkpoint; training state round-trips exactly through JSON + safetensors."""

from __future__ import annotations

import json
import random
import warnings

import numpy as np
import pytest
import torch

from bayeslayer.experiments.common.harness import TrainConfig, train
from bayeslayer.files import atomic_write_text, remove_stale_temporaries
from bayeslayer.training import (
    CheckpointError,
    CheckpointStore,
    load_state,
    rng_state,
    save_state,
    set_rng_state,
    verify_checkpoint,
)

from ..experiments.test_harness import make_model, sample_copy


def _flip(path, offset=None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def _store_with(tmp_path, steps=(1, 2), keep=2) -> CheckpointStore:
    store = CheckpointStore(tmp_path / "ckpt", keep=keep)
    for step in steps:
        def write(d, step=step):
            (d / "weights.bin").write_bytes(bytes([step]) * 64)
            (d / "state.json").write_text(json.dumps({"step": step}))

        store.save(step, write)
    return store


def test_save_keeps_the_newest_and_points_at_the_last(tmp_path):
    store = _store_with(tmp_path, steps=(1, 2, 3, 4), keep=2)
    assert [p.name for p in store.checkpoints()] == ["step-00000003", "step-00000004"]
    assert store.load().name == "step-00000004"
    again = store.save(4, lambda d: (d / "weights.bin").write_bytes(b"x"))  # a re-save of the same step
    assert again.name == "step-00000004.1" and store.load() == again
    assert [p.name for p in store.checkpoints()] == ["step-00000004", "step-00000004.1"]
    assert not list(store.root.glob(".tmp-*"))


@pytest.mark.parametrize("name", ["weights.bin", "state.json", "manifest.json"])
def test_a_flipped_byte_is_named_and_the_older_checkpoint_is_used(tmp_path, name):
    store = _store_with(tmp_path)
    newest = store.root / "step-00000002"
    _flip(newest / name)
    with pytest.raises(CheckpointError, match=name):
        verify_checkpoint(newest)
    with pytest.warns(RuntimeWarning, match=rf"{name}.*falling back to the older checkpoint .*step-00000001"):
        assert store.load().name == "step-00000001"
    assert (store.root / "damaged-step-00000002").is_dir()  # kept for inspection, never loaded again
    assert store.load().name == "step-00000001"


def test_every_damage_kind_is_detected(tmp_path):
    cases = {
        "truncated": lambda d: (d / "weights.bin").write_bytes(b"\0" * 10),
        "missing": lambda d: (d / "state.json").unlink(),
        "extra file": lambda d: (d / "planted.pt").write_bytes(b"x"),
        "no manifest": lambda d: (d / "manifest.json").unlink(),
        "manifest not JSON": lambda d: (d / "manifest.json").write_text("{"),
    }
    for kind, damage in cases.items():
        store = _store_with(tmp_path / kind.replace(" ", "_"), steps=(5,))
        damage(store.root / "step-00000005")
        with pytest.raises(CheckpointError, match="step-00000005"):
            store.load()


def test_a_damaged_pointer_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path):
    store = _store_with(tmp_path)
    (store.root / "latest").write_bytes(b"\x80\x04garbage")
    with pytest.warns(RuntimeWarning, match="latest"):
        assert store.load().name == "step-00000002"


def test_stale_temporaries_are_removed_only_on_request(tmp_path):
    store = _store_with(tmp_path, steps=(1,))
    (store.root / ".tmp-abc").mkdir()
    store.save(2, lambda d: (d / "w").write_bytes(b"1"))
    assert (store.root / ".tmp-abc").exists()  # save never touches another writer's temporary folder
    assert remove_stale_temporaries(store.root) == [store.root / ".tmp-abc"]


def test_atomic_write_keeps_the_old_file_on_error(tmp_path):
    path = tmp_path / "f.txt"
    atomic_write_text(path, "old")
    from bayeslayer.files import atomic_write

    with pytest.raises(RuntimeError), atomic_write(path, "w") as fh:
        fh.write("new, half")
        raise RuntimeError("boom")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_state_round_trip_is_exact(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    random.random()
    np.random.rand()
    state = {"optimizer": opt.state_dict(), "rng": rng_state(), "losses": [0.1, float("inf")], "t": (1, 2)}
    save_state(tmp_path, "s", state)
    back = load_state(tmp_path, "s")
    assert back["t"] == (1, 2) and back["losses"][1] == float("inf")
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    for k, v in state["optimizer"]["state"].items():  # integer keys survive
        for name, t in v.items():
            assert torch.equal(back["optimizer"]["state"][k][name], t)
    draws = (random.random(), np.random.rand(), torch.rand(3))
    set_rng_state(back["rng"])
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert draws[:2] == again[:2] and torch.equal(draws[2], again[2])
    with pytest.raises(TypeError, match="cannot store a object"):
        save_state(tmp_path, "bad", {"x": object()})


CFG = TrainConfig(steps=6, batch_size=8, lr=1e-2, checkpoint_every=2)


@pytest.mark.parametrize("name", ["model.safetensors", "trainer_state.json", "trainer_state.safetensors",
                                  "manifest.json"])
def test_harness_detects_a_flipped_byte_in_any_checkpoint_file_and_falls_back(tmp_path, name):
    ref = make_model()
    train(ref, sample_copy, CFG, progress=False)
    ckpt = tmp_path / "run.ckpt"
    train(make_model(), sample_copy, CFG, checkpoint_path=ckpt, stop_after=4, progress=False)
    _flip(ckpt / "step-00000004" / name)
    resumed = make_model(seed=3)
    with pytest.warns(RuntimeWarning, match=rf"step-00000004/{name}.*falling back.*step-00000002"):
        res = train(resumed, sample_copy, CFG, checkpoint_path=ckpt, progress=False)
    assert res.finished
    for a, b in zip(ref.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # resumed from step 2: still the uninterrupted run's weights


def test_harness_refuses_a_checkpoint_damaged_everywhere_naming_the_file(tmp_path):
    ckpt = tmp_path / "run.ckpt"
    train(make_model(), sample_copy, CFG, checkpoint_path=ckpt, stop_after=2, progress=False)
    _flip(ckpt / "step-00000002" / "trainer_state.json")
    with warnings.catch_warnings(), pytest.raises(CheckpointError, match="trainer_state.json fails its SHA-256"):
        train(make_model(), sample_copy, CFG, checkpoint_path=ckpt, progress=False)
