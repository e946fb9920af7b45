"""docs/distributed.md's Hugging Face Trainer recipes (Accelerate's FSDP plugin, FSDP2, ``BayesLayerBlock`` the wrap
class; padded windows, and packed documents through ``DataCollatorWithFlattening``) run as written on two gloo
processes (workers: ``trainer_recipe_worker.py``, both recipes in one job; started by ``torchrun`` in the slow test,
in the default suite the suite's one two-rank job, ``tests/two_rank_job.py``, with ``torchrun``'s environment).

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

from .trainer_recipe_worker import RECIPES

ROOT = Path(__file__).resolve().parents[2]


def run_recipes(folder: Path, engine: str) -> dict[str, list[dict]]:
    """Both recipes on 2 ranks in ``folder`` (their ``runs/trainer-fsdp*`` land there); every rank's record."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "tests.training.trainer_recipe_worker", str(folder), engine, *RECIPES]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return recipe_records(folder)


def recipe_records(folder: Path) -> dict[str, list[dict]]:
    """Every rank's record of each recipe, as the workers wrote them in ``folder``."""
    return {name: [json.loads((folder / f"{name}-rank{r}.json").read_text()) for r in range(2)] for name in RECIPES}


@pytest.fixture(scope="module")
def both(two_rank_job):
    """Both recipes on Accelerate's FSDP path, run by the default suite's one two-rank job
    (``tests/two_rank_job.py``, part ``trainer``: ``trainer_recipe_worker.main(folder, "fsdp", *RECIPES)``, the
    same as :func:`run_recipes` with engine ``fsdp``)."""
    folder = two_rank_job / "trainer"
    return folder, recipe_records(folder)


@pytest.fixture(scope="module")
def fsdp(both):
    folder, records = both
    return folder, records["trainer-fsdp"]


@pytest.fixture(scope="module")
def packed(both):
    folder, records = both
    return folder, records["trainer-fsdp-packed"]


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


def test_the_packed_recipe_shards_and_trains_on_flattened_documents(packed):
    """Each rank's micro-batch of 4 documents reached the model as one row whose position_ids restart at every
    document and whose labels hide each document's first token; sharded as the first recipe; it trains and saves."""
    folder, ranks = packed
    for r in ranks:
        assert r["distributed_type"] == "DistributedType.FSDP" and r["dtensor_params"] == r["params"]
        assert {"", "model.layers.0", "model.layers.1"} <= set(r["fsdp_units"]), r["fsdp_units"]
        assert r["steps"] == 4 and len(r["losses"]) == 4 and all(np.isfinite(r["losses"]))
        first = r["first_forward"]
        [positions], [labels] = first["position_ids"], first["labels"]
        starts = [i for i, p in enumerate(positions) if p == 0]
        assert len(first["input_ids"]) == 1 and len(starts) == 4 and starts[0] == 0, positions
        assert [labels[i] for i in starts] == [-100] * 4
    assert ranks[0]["first_forward"]["input_ids"] != ranks[1]["first_forward"]["input_ids"]  # each its own documents
    BayesLayerForCausalLM.from_pretrained(folder / "runs" / "trainer-fsdp-packed")


def test_the_packed_recipe_keeps_every_document_to_itself(packed):
    """The first sharded forward pass of the packed recipe (the initial weights) gave the logits and the loss of
    its documents run one by one, in one process, unsharded (float32: ≤ 1e-5); the same row without its
    position_ids (every document reading the previous one's memory) is far from them."""
    import torch.nn.functional as F

    folder, ranks = packed
    torch.manual_seed(0)  # the recipe's initial weights
    model = BayesLayerForCausalLM(BayesLayerForCausalLM.config_class.from_pretrained(
        folder / "runs" / "trainer-fsdp-packed")).eval()
    for r in ranks:
        first = r["first_forward"]
        ids = torch.tensor(first["input_ids"])
        starts = [i for i, p in enumerate(first["position_ids"][0]) if p == 0] + [ids.shape[1]]
        with torch.no_grad():
            alone = [model(input_ids=ids[:, a:b]).logits for a, b in zip(starts, starts[1:])]
            leaking = model(input_ids=ids).logits
        logits, packed_logits = torch.cat(alone, 1), torch.tensor(first["logits"])
        scale = logits.abs().max()
        assert (packed_logits - logits).abs().max() <= 1e-5 * scale
        assert (leaking - logits).abs().max() >= 1e-2 * scale  # without position_ids the documents leak
        total = sum(F.cross_entropy(x[0, :-1].double(), ids[0, a + 1:b], reduction="sum")
                    for x, a, b in zip(alone, starts, starts[1:]))
        items = first["num_items_in_batch"] or ids.shape[1] - (len(starts) - 1)
        assert abs(first["loss"] - float(total) / items) <= 1e-5 * abs(first["loss"])


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """Both recipes under Accelerate's CPU default (DDP), run once for the slow comparison."""
    folder = tmp_path_factory.mktemp("trainer") / "ddp"
    return folder, run_recipes(folder, "accelerate-cpu")


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_the_sharded_recipe_trains_like_ddp(both, ddp, name):
    """The same recipes, Accelerate left as it is on the CPU (it wraps the model in DDP): the losses and the saved
    weights of the two trainings agree (float32; measured: the losses equal, the weights 1.2e-7 (padded) and 2.8e-6
    (packed) of each tensor's largest entry)."""
    from safetensors.torch import load_file

    folder, records = both
    ddp_folder, ddp_records = ddp
    sharded, ddp = records[name], ddp_records[name]
    assert ddp[0]["distributed_type"] == "DistributedType.MULTI_CPU" and ddp[0]["wrapper"] == "DistributedDataParallel"
    assert ddp[0]["fsdp_units"] == [] and ddp[0]["param_bytes"] == ddp[0]["full_param_bytes"]
    assert ddp[0]["first_forward"]["input_ids"] == sharded[0]["first_forward"]["input_ids"]  # the same batches
    rel = max(abs(x - y) / abs(y) for x, y in zip(sharded[0]["losses"], ddp[0]["losses"]))
    assert rel <= 1e-5, (sharded[0]["losses"], ddp[0]["losses"])
    a = load_file(folder / "runs" / name / "model.safetensors")
    b = load_file(ddp_folder / "runs" / name / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in a)
    print(name, "losses", sharded[0]["losses"], "relative to DDP's", rel, "weights", worst)  # shown with pytest -s
    assert worst <= 1e-5, worst

