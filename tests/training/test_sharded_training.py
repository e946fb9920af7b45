"""Sharded training (FSDP2 on the job's DeviceMesh) against one process: gloo on the CPU, ranks started here by
``torch.multiprocessing.spawn`` (workers in ``tests/training/fsdp_train_workers.py``).

The default suite runs one two-rank job (float64 training like one process, plain, and with tied embeddings
and activation checkpointing together; bf16 mixed precision; the sharded run folder stopped, resumed and finished),
as part of the suite's one two-rank job (``tests/two_rank_job.py``); a two-rank checkpoint resumes here in one
process. The slow ones: float32, the four-rank job (2 shards × 2 context-parallel ranks on one mesh), the
four-rank resume of the two-rank checkpoint, kill -9 of a rank mid-save and
``torchrun ... lm train --preset tiny --shard fsdp``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from bayeslayer.experiments.common.lm_run import latest_checkpoint, train_lm
from bayeslayer.training.distributed import DistContext

from ..two_rank_job import records
from . import fsdp_train_workers as workers
from .agreement import check_against_one_process

TOL64 = 1e-10


def spawn(root: Path, world: int, case: str, *args) -> list[dict]:
    for r in range(world):
        (root / f"rank{r}.json").unlink(missing_ok=True)
    init = root / f"init-{case}-{world}"
    init.unlink(missing_ok=True)
    mp.spawn(workers.job, args=(world, str(init), str(root), case, *args), nprocs=world, join=True)
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def setup(two_rank_job):
    """The corpus (tokenized into the cache by the two-rank job) and the one-process run of the run-folder cases."""
    root = two_rank_job / "fsdp"
    done = json.loads((two_rank_job / "done.json").read_text())
    corpus, cache = done["text"], done["cache"]
    single = train_lm(workers.lm_config(corpus), root / "single", device="cpu", cache_dir=cache, progress=False)
    return root, corpus, cache, single.losses


@pytest.fixture(scope="module")
def two_ranks(two_rank_job):
    """The "two_ranks" case, run by the default suite's one two-rank job (tests/two_rank_job.py)."""
    out = two_rank_job / "fsdp"
    return out, records(two_rank_job, "fsdp")


def check(results: list[dict], tol_losses: float, tol_weights: float) -> None:
    main = results[0]
    check_against_one_process(main, tol_losses, tol_weights)
    # the gradients were clipped (norm above grad_clip 0.5) and their norm over the shards is the whole norm
    assert min(main["ref_grad_norms"]) > 0.5
    np.testing.assert_allclose(main["grad_norms"], main["ref_grad_norms"], rtol=max(tol_losses, 1e-12))
    for r in results:
        assert r["losses"] == main["losses"] and r["grad_norms"] == main["grad_norms"]
    # every rank stores its share of the parameters: together exactly one copy, each at most its part rounded up
    stored = [r["param_bytes"] for r in results]
    assert sum(stored) == main["ddp_param_bytes"]
    assert max(stored) <= main["ddp_param_bytes"] / len(results) * 1.02


def test_two_ranks_shard_and_train_like_one_process_float64(two_ranks):
    """3 AdamW steps, 4 windows per step (1 per micro-batch, 2 micro-batches per rank); each rank stores half
    of the parameters DDP would (the sizes here split evenly: exactly half)."""
    results = [r["float64"] for r in two_ranks[1]]
    check(results, TOL64, TOL64)
    assert [r["param_bytes"] for r in results] == [results[0]["ddp_param_bytes"] // 2] * 2


def test_tied_embeddings_and_activation_checkpointing_shard_too(two_ranks):
    """A head tied to the embedding stays one parameter in the root unit (the ranks' parameter bytes add up to
    one copy of it); blocks recomputed in the backward pass (non-reentrant activation checkpointing) gather their
    shards again; with both in one run, the training is the one process's (tied, not checkpointed)."""
    check([r["tied_checkpointing"] for r in two_ranks[1]], TOL64, TOL64)


def test_bf16_gathers_bf16_parameters_and_keeps_fp32_shards_and_gradients(two_ranks):
    """precision bf16 with shard="fsdp": FSDP's MixedPrecisionPolicy all-gathers the parameters in bf16 for the
    forward and backward, reduces the gradients in fp32 and keeps the sharded parameters (what AdamW updates) in
    fp32; the losses stay within bf16's rounding of the fp32 run's."""
    for r in two_ranks[1]:
        got = r["bf16"]
        assert got["forward"] == ["torch.bfloat16"] and got["sharded"] == ["torch.float32"]
        assert got["grads"] == ["torch.float32"]
    fp32 = two_ranks[1][0]["float64"]["ref_losses"]
    np.testing.assert_allclose(two_ranks[1][0]["bf16"]["losses"], fp32, rtol=2e-2)


def test_the_job_has_one_mesh(two_ranks):
    for r in two_ranks[1]:
        assert r["mesh"] == [[2, 1], ["dp", "cp"], 2]


def test_a_sharded_run_folder_resumes_bit_identical_and_final_loads(two_ranks, setup):
    """lm train's run folder with shard="fsdp" on 2 ranks: stopped after step 2 and resumed, it ends bit for bit
    where the uninterrupted run ends; final/ is the whole model, which from_pretrained reads; the losses are
    the one-process run's (float32)."""
    from bayeslayer.models import BayesLayerForCausalLM

    out, results = two_ranks
    runs = results[0]["runs"]
    assert runs["resumed_from"] == 2 and runs["first"] == runs["whole"][:2]
    assert runs["resumed"] == runs["whole"]
    for r in results:
        assert r["runs"]["whole"] == runs["whole"]
    whole = BayesLayerForCausalLM.from_pretrained(out / "whole" / "final")
    resumed = BayesLayerForCausalLM.from_pretrained(out / "resumed" / "final")
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    summary = runs["summary"]
    assert summary["shard"] == "fsdp" and summary["world_size"] == 2
    n_bytes = 4 * summary["parameters"]["total"]
    assert summary["parameter_bytes_per_rank"] == [n_bytes // 2] * 2  # the sizes split evenly: exactly half
    # float32, 2 ranks against 1: the gradients are reduced in another order
    np.testing.assert_allclose(runs["whole"], setup[3], rtol=1e-5)
    ckpt = latest_checkpoint(out / "whole")
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["config.json", "manifest.json", "shard-00001-model-00001-of-00001.safetensors",
                     "shard-00002-model-00001-of-00001.safetensors", "trainer_state.json", "trainer_state.safetensors"]


def shard_files(ckpt: Path) -> dict[str, torch.Tensor]:
    """The whole tensors of a sharded checkpoint, put together here from the shard files' own headers (each
    piece and its offsets), independently of torch.distributed.checkpoint."""
    from safetensors import safe_open

    pieces: dict[str, list] = {}
    for path in sorted(ckpt.glob("shard-*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            offsets = json.loads(f.metadata()["DCP_SHARDING_INFO"])
            for key in f.keys():
                pieces.setdefault(key, []).append((offsets[key]["saved_offsets"], f.get_tensor(key)))
    whole = {}
    for key, parts in pieces.items():
        shape = [max(o[d] + t.shape[d] for o, t in parts) for d in range(parts[0][1].dim())]
        full = torch.full(shape, float("nan"), dtype=parts[0][1].dtype) if parts[0][1].is_floating_point() \
            else torch.zeros(shape, dtype=parts[0][1].dtype)
        for offset, t in parts:
            full[tuple(slice(o, o + n) for o, n in zip(offset, t.shape))] = t
        whole[key] = full
    return whole


def check_loaded(loaded: dict[str, list], files: dict[str, torch.Tensor]) -> None:
    """What a job loaded from a checkpoint equals its shard files' contents (:func:`shard_files`) bit for bit,
    every weight and AdamW moment."""
    assert files and set(loaded) == set(files), set(loaded) ^ set(files)
    for key, values in loaded.items():
        assert torch.equal(torch.tensor(values, dtype=files[key].dtype), files[key].reshape(-1)), key


def test_a_two_rank_checkpoint_resumes_in_one_process(two_ranks, setup, tmp_path):
    """The two-rank run folder at step 2, resumed here in one process: its weights and AdamW moments load bit for
    bit and the run finishes with the two-rank run's losses (float32: the gradients add up in another order)."""
    out, results = two_ranks
    run = tmp_path / "run"
    shutil.copytree(out / "at_step_2", run)
    config = workers.lm_config(setup[1])
    ckpt = latest_checkpoint(run)
    check_loaded(workers.loaded_state(ckpt, config, DistContext()), shard_files(ckpt))
    with pytest.warns(RuntimeWarning, match="written by 2 rank"):
        result = train_lm(config, run, device="cpu", cache_dir=setup[2], progress=False, shard="fsdp")
    whole = results[0]["runs"]["whole"]
    assert result.resumed_from == 2 and result.losses[:2] == whole[:2]
    np.testing.assert_allclose(result.losses, whole, rtol=1e-5)


@pytest.mark.slow
def test_a_two_rank_checkpoint_resumes_on_four_ranks(two_ranks, setup, tmp_path):
    out, results = two_ranks
    run = tmp_path / "run"
    shutil.copytree(out / "at_step_2", run)
    files = shard_files(latest_checkpoint(run))  # read now: the finished run replaces the checkpoint
    got = spawn(tmp_path, 4, "resume", setup[1], setup[2], str(run))
    check_loaded(got[0]["loaded"], files)
    whole = results[0]["runs"]["whole"]
    for r in got:
        assert r["resumed_from"] == 2 and r["losses"][:2] == whole[:2]
        np.testing.assert_allclose(r["losses"], whole, rtol=1e-5)


@pytest.mark.slow  # two ranks of each kind stay in the default run (this file, test_context_parallel.py)
def test_four_ranks_shard_times_context_parallel_like_one_process_float64(tmp_path):
    """4 ranks on one (dp 2 × cp 2) mesh: every window split along T over a context-parallel pair, the parameters
    sharded over all four ranks."""
    results = spawn(tmp_path, 4, "cp_shard", 2, "float64")
    check(results, TOL64, TOL64)
    for r in results:
        assert r["mesh"] == [[2, 2], ["dp", "cp"], 4]


@pytest.mark.slow
def test_two_ranks_shard_and_train_like_one_process_float32(tmp_path):
    # float32: the shards' gradients are reduce-scattered per micro-batch and summed in another order than one
    # process, and AdamW turns gradient entries of rounding size into updates of up to lr (3e-2) in either
    # direction, so the weights agree only to about 1e-2 of a parameter's largest entry
    check(spawn(tmp_path, 2, "float32"), 1e-5, 1e-2)


@pytest.mark.slow
def test_kill_9_of_one_rank_mid_save_leaves_the_last_checkpoint(setup, tmp_path):
    """Rank 1 is killed (SIGKILL) while the second checkpoint is being written (its shard file written, not yet
    synced): the folder's newest checkpoint is still the first, it verifies, and a resumed run starts from it and
    finishes with the uninterrupted run's losses."""
    run = tmp_path / "run"
    with pytest.raises(mp.ProcessExitedException):
        spawn(tmp_path, 2, "kill", setup[1], setup[2], str(run))
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and ckpt.name == "step-00000001"
    # the save that was cut short left its temporary folder, unless rank 0 removed it on the error it got from the
    # dead rank's collective before it was stopped itself; either way no checkpoint names it
    config = workers.lm_config(setup[1], checkpoint_every=1)
    with pytest.warns(RuntimeWarning, match="written by 2 rank"):
        result = train_lm(config, run, device="cpu", cache_dir=setup[2], progress=False, shard="fsdp")
    assert result.resumed_from == 1 and result.finished
    np.testing.assert_allclose(result.losses, setup[3], rtol=1e-5)
    assert not any(p.name.startswith(".tmp") for p in (run / "checkpoints").iterdir())


@pytest.mark.slow
def test_torchrun_lm_train_tiny_shard_fsdp_matches_one_process(tmp_path, setup):
    """torchrun --nproc-per-node 2 -m bayeslayer.cli lm train --preset tiny --shard fsdp (on the test corpus): the
    losses equal one process's (float32: rtol 1e-5) and each rank stores half of the parameters."""
    from bayeslayer.training.lm_config import LMConfig

    out = tmp_path / "fsdp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "bayeslayer.cli", "lm", "train", "--preset", "tiny", "--shard", "fsdp", "--no-progress",
           "--out", str(out), "--cache-dir", setup[2], "--device", "cpu", "--source", setup[1],
           "--vocab-size", "280", "--seq-len", "32", "--steps", "4", "--batch-size", "4", "--eval-every", "2",
           "--checkpoint-every", "2", "--log-every", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["shard"] == "fsdp" and summary["world_size"] == 2
    n_bytes = 4 * summary["parameters"]["total"]
    assert summary["parameter_bytes_per_rank"] == [n_bytes // 2] * 2
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["event"] == "train"]
    saved = LMConfig.from_json(json.loads((out / "config.json").read_text()))
    single = train_lm(replace(saved, preset="tiny"), tmp_path / "single", cache_dir=setup[2], progress=False,
                      device="cpu")
    np.testing.assert_allclose(losses, single.losses, rtol=1e-5)


def test_a_run_resumes_only_with_the_shard_it_was_started_with(setup, tmp_path):
    config = workers.lm_config(setup[1], steps=2, checkpoint_every=1)
    run = tmp_path / "run"
    train_lm(config, run, device="cpu", cache_dir=setup[2], progress=False, shard="fsdp", stop_after=1)
    with pytest.raises(ValueError, match="was written with shard='fsdp' and this run has shard='none'"):
        train_lm(config, run, device="cpu", cache_dir=setup[2], progress=False)
    with pytest.raises(ValueError, match="shard must be one of"):
        train_lm(config, run, device="cpu", cache_dir=setup[2], progress=False, shard="zero3")
