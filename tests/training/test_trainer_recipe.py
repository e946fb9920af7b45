"""docs/distributed.md's Hugging Face Trainer recipe (Accelerate's FSDP plugin, FSDP2, ``BayesLayerBlock`` the wrap
class) runs as written on two gloo processes started by ``torchrun`` (workers: ``trainer_recipe_worker.py``).

Accelerate takes its FSDP path only on accelerators (``accelerate_cpu.py``), so the default-suite run switches it
on for the CPU; the slow test runs the recipe a second time as Accelerate leaves it on the CPU (DDP) and
compares the two trainings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bayeslayer.models import BayesLayerForCausalLM

ROOT = Path(__file__).resolve().parents[2]


def run_recipe(folder: Path, engine: str) -> list[dict]:
    """The recipe on 2 ranks in ``folder`` (its ``runs/trainer-fsdp`` lands there); every rank's record."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "tests.training.trainer_recipe_worker", str(folder), engine]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trainer") / "fsdp"
    return folder, run_recipe(folder, "fsdp")


def test_the_recipe_shards_every_block_and_half_of_the_parameters(fsdp):
    """Accelerate's FSDP2 made each BayesLayerBlock an FSDP unit (and the model the root): every parameter is a
    DTensor, and each rank holds half of the parameters' and of AdamW's moments' bytes."""
    _, ranks = fsdp
    for r in ranks:
        assert r["distributed_type"] == "DistributedType.FSDP"
        assert r["wrapper"] == "FSDPBayesLayerForCausalLM"
        assert {"", "model.layers.0", "model.layers.1"} <= set(r["fsdp_units"]), r["fsdp_units"]
        assert r["dtensor_params"] == r["params"]
        assert r["steps"] == 4
    full = ranks[0]["full_param_bytes"]
    assert [r["param_bytes"] for r in ranks] == [full // 2] * 2  # the sizes here split evenly
    assert [r["adam_bytes"] for r in ranks] == [full] * 2  # two moments, each half of the parameters


def test_the_recipe_trains_and_saves_a_model_from_pretrained_reads(fsdp):
    folder, ranks = fsdp
    losses = ranks[0]["losses"]
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert ranks[1]["losses"] == losses  # Trainer logs the mean over the ranks
    saved = folder / "runs" / "trainer-fsdp"
    model = BayesLayerForCausalLM.from_pretrained(saved)  # verifies the manifest; safetensors only
    torch.manual_seed(0)  # the recipe's initial weights
    initial = BayesLayerForCausalLM(model.config)
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, initial.get_parameter(n))]
    assert len(moved) == len(list(model.parameters()))  # every weight took the steps
    assert sum(p.numel() for p in model.parameters()) * 4 == ranks[0]["full_param_bytes"]


@pytest.mark.slow
def test_the_sharded_recipe_trains_like_ddp(fsdp, tmp_path):
    """The same recipe, Accelerate left as it is on the CPU (it wraps the model in DDP): the losses and the saved
    weights of the two trainings agree (float32; measured: losses 1.1e-7 relative, weights 7.0e-7 of each tensor's
    largest entry)."""
    from safetensors.torch import load_file

    folder, sharded = fsdp
    ddp = run_recipe(tmp_path / "ddp", "accelerate-cpu")
    assert ddp[0]["distributed_type"] == "DistributedType.MULTI_CPU" and ddp[0]["wrapper"] == "DistributedDataParallel"
    assert ddp[0]["fsdp_units"] == [] and ddp[0]["param_bytes"] == ddp[0]["full_param_bytes"]
    rel = max(abs(x - y) / abs(y) for x, y in zip(sharded[0]["losses"], ddp[0]["losses"]))
    assert rel <= 1e-5, (sharded[0]["losses"], ddp[0]["losses"])
    a = load_file(folder / "runs" / "trainer-fsdp" / "model.safetensors")
    b = load_file(tmp_path / "ddp" / "runs" / "trainer-fsdp" / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in a)
    print("losses", sharded[0]["losses"], "relative to DDP's", rel, "weights", worst)  # shown with pytest -s
    assert worst <= 1e-5, worst
