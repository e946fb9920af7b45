"""A pickle planted in any file the CLIs read never runs: the payload would create a marker file;
after every load the marker is absent and a clear error, a warning or a retrain followed.  And the
package's source loads nothing with pickle."""

from __future__ import annotations

import io
import pickle
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from bayeslayer.experiments.common.harness import TrainConfig, train, train_seeds
from bayeslayer.experiments.common.lm_run import train_lm
from bayeslayer.training.lm import load_run

from ..experiments.test_harness import make_model, sample_copy
from .faults import single_thread
from .test_lm_reliability import setup  # noqa: F401 - the shared tiny LM run

PACKAGE = Path(__file__).resolve().parents[2] / "bayeslayer"


class Payload:
    """Unpickling this calls ``open(marker, "w")``: the marker file appears iff the pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(path: Path, marker: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix in (".pt", ".safetensors", ".bin", ".npz"):  # torch.save's zip container
        buf = io.BytesIO()
        torch.save({"state": Payload(marker)}, buf)
        path.write_bytes(buf.getvalue())
    else:
        path.write_bytes(pickle.dumps(Payload(marker)))


def test_the_payload_runs_when_unpickled(tmp_path):
    """The test's own check: the planted bytes do run code under a pickle loader."""
    marker = tmp_path / "marker"
    _plant(tmp_path / "x.pt", marker)
    torch.load(tmp_path / "x.pt", weights_only=False)
    assert marker.exists()


def _final(m):
    return {"ok": 1.0}


SEEDS_CFG = TrainConfig(steps=4, batch_size=4, lr=1e-2, checkpoint_every=2)
SEED_FILES = ["toy_seed0.pt", "toy_seed0.json", "toy_seed0.ckpt/latest",
              "toy_seed0.ckpt/step-00000002/model.safetensors",
              "toy_seed0.ckpt/step-00000002/trainer_state.json",
              "toy_seed0.ckpt/step-00000002/trainer_state.safetensors",
              "toy_seed0.ckpt/step-00000002/manifest.json"]


@pytest.mark.parametrize("planted", SEED_FILES)
def test_per_seed_files_of_recall_crowding_mqar_never_run_a_pickle(tmp_path, planted):
    """``train_seeds`` is the loader of ``recall``, ``crowding`` and ``mqar`` (per-seed cache and
    checkpoint folder; ``<name>_seed<s>.pt`` is where older versions kept a pickle checkpoint)."""
    runs, marker = tmp_path / "runs", tmp_path / "marker"
    train(make_model(), sample_copy, SEEDS_CFG, checkpoint_path=runs / "toy_seed0.ckpt", stop_after=2,
          progress=False, identity={"fingerprint": None})
    expected = train_seeds("toy", make_model, sample_copy, SEEDS_CFG, [0], _final, progress=False)
    _plant(runs / planted, marker)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = train_seeds("toy", make_model, sample_copy, SEEDS_CFG, [0], _final, run_dir=str(runs),
                              progress=False)
    assert not marker.exists(), f"a pickle planted at {planted} ran"
    assert records[0]["loss_curve"] == expected[0]["loss_curve"]  # resumed or retrained: the same run
    if planted != "toy_seed0.ckpt/latest":  # a damaged pointer falls back silently to the newest checkpoint
        assert any(planted.split("/")[-1] in str(w.message) or "not loaded" in str(w.message) for w in caught)


LM_FILES = ["config.json", "objective.json", "log.jsonl", "checkpoints/latest",
            "checkpoints/step-00000002/config.json", "checkpoints/step-00000002/model.safetensors",
            "checkpoints/step-00000002/trainer_state.json", "checkpoints/step-00000002/trainer_state.safetensors",
            "checkpoints/step-00000002/manifest.json", "checkpoints/step-00000002/trainer_state.pt"]


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, setup):  # noqa: F811
    config, cache, _ = setup
    run = tmp_path_factory.mktemp("stopped") / "run"
    with single_thread():
        train_lm(config, run, cache_dir=cache, progress=False, stop_after=2)
    return run


@pytest.mark.parametrize("planted", LM_FILES + ["cache"])
def test_lm_run_and_cache_files_never_run_a_pickle(tmp_path, setup, stopped_run, planted):  # noqa: F811
    config, cache, _ = setup
    run, marker = tmp_path / "run", tmp_path / "marker"
    shutil.copytree(stopped_run, run)
    own_cache = tmp_path / "cache"
    shutil.copytree(cache, own_cache)
    if planted == "cache":  # every token-cache, tokenizer and bigram-count file at once
        for path in list(own_cache.iterdir()):
            _plant(path, marker)
    else:
        _plant(run / planted, marker)
    with single_thread(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            train_lm(config, run, cache_dir=str(own_cache), progress=False)
        except (ValueError, OSError, RuntimeError) as exc:  # a clear error naming the file is fine too
            assert planted.split("/")[-1] in str(exc) or "cache" in str(exc) or "tokeniz" in str(exc), str(exc)
    assert not marker.exists(), f"a pickle planted at {planted} ran"


@pytest.mark.parametrize("planted", ["final/model.safetensors", "final/config.json", "final/lm_config.json"])
def test_a_finished_model_folder_never_runs_a_pickle(tmp_path, setup, planted):  # noqa: F811
    _, _, ref = setup
    run, marker = tmp_path / "run", tmp_path / "marker"
    shutil.copytree(ref.run_dir, run)
    _plant(run / planted, marker)
    with pytest.raises(Exception):  # noqa: B017,PT011 - any refusal; what matters is the marker
        load_run(run)
    assert not marker.exists()


def test_the_package_loads_nothing_with_pickle():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if re.search(r"\bimport pickle\b|pickle\.loads?\(|weights_only\s*=\s*False|allow_pickle\s*=\s*True",
                         code) or ("torch.load(" in code and "weights_only=True" not in code):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
