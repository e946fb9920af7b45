"""Per-rank training memory of DDP and FSDP2: measured on the CPU for a small model, and the formula for large ones.

Measured: every rank is a process of a gloo group started here (``torch.multiprocessing.spawn``; 1, 2 and 4
ranks); it builds a ``BayesLayerForCausalLM``, makes it DDP (``--shard none``: the whole model on every rank)
or shards it with :func:`bayeslayer.training.parallel.shard_model` (``--shard fsdp``), runs one AdamW step
of the package's training loop (:func:`bayeslayer.training.lm.train_on_windows`) and counts, from the tensors
themselves, the bytes it stores: parameters, gradients (taken after the backward pass of the step, before they
are cleared) and AdamW's state (two moments and a step count per parameter).  A sharded tensor counts its local
shard.  Not counted: activations, DDP's gradient buckets (a second copy of the gradients for its all-reduce,
PyTorch's default) and FSDP's transient all-gathered block (the ``gathered unit`` column: the largest block's
full parameters, held while it computes).

Formula (fp32 weights and AdamW): DDP ``4 + 4 + 8 = 16`` bytes per parameter on every rank; FSDP over ``N``
ranks ``16 / N``, plus the gathered block.  It is applied to the package's own model at three sizes of about 340M,
1.3B and 7B parameters (counted on the ``meta`` device, which allocates nothing).

Usage: ``python benchmarks/sharding_memory.py [--ranks 1 2 4] [--json results/distributed/sharding_memory.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: The measured model: the ``tiny`` preset's shape with an 8k vocabulary (``lm train --preset tiny``).
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=16, vocab_size=8192)
#: The formula's models: (name, width, layers, heads of head dim 128), vocabulary 32,000; the layers chosen so
#: that the Bayesian-Layer model's parameter count is close to the name.
LARGE = (("340M", 1024, 16, 8), ("1.3B", 2048, 17, 16), ("7B", 4096, 25, 32))
VOCAB_LARGE = 32000


def _config(hidden_size: int, num_hidden_layers: int, num_heads: int, head_dim: int, vocab_size: int):
    from bayeslayer.models import BayesLayerConfig

    return BayesLayerConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                            num_heads=num_heads, head_dim=head_dim, mixers=["bayesian"] * num_hidden_layers,
                            bos_token_id=None, eos_token_id=None, use_cache=False, mlp_dropout=0.0)


def _block_bytes(model, dtype_bytes: int = 4) -> int:
    """Full parameter bytes of the largest FSDP unit below the root (a block or the embedding)."""
    units = [*model.model.layers, model.model.embeddings]
    return max(sum(p.numel() for p in u.parameters()) * dtype_bytes for u in units)


def measure(rank: int, world: int, shard: str) -> dict:
    """This rank's bytes after one training step with ``shard`` (``none`` or ``fsdp``)."""
    from bayeslayer.models import BayesLayerForCausalLM
    from bayeslayer.training.distributed import init_distributed
    from bayeslayer.training.lm import NextTokenTrainee, train_on_windows
    from bayeslayer.training.loop import TrainConfig
    from bayeslayer.training.parallel import local_bytes

    ctx = init_distributed("cpu")
    torch.manual_seed(0)
    model = BayesLayerForCausalLM(_config(**SMALL))
    trainee = NextTokenTrainee(model)
    windows = np.random.default_rng(0).integers(0, SMALL["vocab_size"], size=(4 * world, 32))
    seen: dict = {}

    def after_step(state, info):  # the optimiser has stepped; the gradients of the step are still there
        optimizer_tensors = [t for p in model.parameters() for t in seen["optimizer"].state.get(p, {}).values()
                             if isinstance(t, torch.Tensor)]
        seen["bytes"] = {"parameters": local_bytes(model.parameters()),
                         "gradients": seen["grads"], "optimizer": local_bytes(optimizer_tensors)}

    original_step = torch.optim.AdamW.step

    def step(self, *args, **kwargs):  # count the gradients just before the update (then the loop clears them)
        seen["optimizer"] = self
        seen["grads"] = local_bytes(p.grad for g in self.param_groups for p in g["params"])
        return original_step(self, *args, **kwargs)

    torch.optim.AdamW.step = step
    try:
        train_on_windows(trainee, windows, TrainConfig(steps=1, batch_size=world, lr=1e-3), ctx=ctx,
                         micro_batch_size=1, progress=False, shard=shard, after_step=after_step)
    finally:
        torch.optim.AdamW.step = original_step
    return seen["bytes"]


def _worker(rank: int, world: int, init_file: str, out_dir: str, shard: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(measure(rank, world, shard)))
    finally:
        dist.destroy_process_group()


def measured_rows(ranks: list[int]) -> list[dict]:
    rows = []
    for world in ranks:
        for shard in ("none", "fsdp"):
            with tempfile.TemporaryDirectory() as tmp:
                mp.spawn(_worker, args=(world, str(Path(tmp, "init")), tmp, shard), nprocs=world, join=True)
                got = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
            rows.append({"ranks": world, "shard": shard, "per_rank": got,
                         "max": {k: max(g[k] for g in got) for k in got[0]}})
    return rows


def formula_rows(ranks: list[int]) -> list[dict]:
    from bayeslayer.models import BayesLayerForCausalLM, count_parameters

    rows = []
    for name, hidden, layers, heads in LARGE:
        with torch.device("meta"):
            model = BayesLayerForCausalLM(_config(hidden, layers, heads, 128, VOCAB_LARGE))
        n = count_parameters(model).total
        rows.append({"model": name, "hidden_size": hidden, "layers": layers, "heads": heads, "parameters": n,
                     "gathered_unit_fp32": _block_bytes(model), "ddp": 16 * n,
                     "fsdp": {str(r): 16 * n / r for r in ranks}})
    return rows


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--json", type=Path, default=None, help="write the numbers here")
    a = p.parse_args()
    from bayeslayer.models import BayesLayerForCausalLM, count_parameters

    small = BayesLayerForCausalLM(_config(**SMALL))
    n_small = count_parameters(small).total
    rows = measured_rows(a.ranks)
    formula = formula_rows(a.ranks)
    print(f"# measured on gloo/CPU after one AdamW step: BayesLayerForCausalLM {SMALL}, {n_small:,} parameters, fp32; "
          "bytes per rank (largest rank)")
    print("| ranks | engine | parameters (B) | gradients (B) | AdamW state (B) | total (B) | of DDP's |")
    print("|---|---|---|---|---|---|---|")
    ddp = {r["ranks"]: sum(r["max"].values()) for r in rows if r["shard"] == "none"}
    for r in rows:
        total = sum(r["max"].values())
        print(f"| {r['ranks']} | {'DDP' if r['shard'] == 'none' else 'FSDP2'} | {r['max']['parameters']:,} | "
              f"{r['max']['gradients']:,} | {r['max']['optimizer']:,} | {total:,} | {total / ddp[r['ranks']]:.3f} |")
    print(f"\n# formula, fp32 weights and AdamW: GB per rank (vocabulary {VOCAB_LARGE:,})")
    print("| model | width × layers | parameters | DDP | " + " | ".join(f"FSDP2 × {r}" for r in a.ranks)
          + " | gathered unit |")
    print("|---|---|---|---|" + "---|" * len(a.ranks) + "---|")
    for f in formula:
        print(f"| {f['model']} | {f['hidden_size']} × {f['layers']} | {f['parameters']:,} | {_gb(f['ddp'])} | "
              + " | ".join(_gb(f["fsdp"][str(r)]) for r in a.ranks) + f" | {_gb(f['gathered_unit_fp32'])} |")
    if a.json is not None:
        from bayeslayer.experiments.common.provenance import write_record

        record = dict(config=dict(ranks=a.ranks, json=str(a.json), small=SMALL, small_parameters=n_small,
                                  vocab_large=VOCAB_LARGE),
                      cores=os.cpu_count(), torch=torch.__version__, measured=rows, formula=formula)
        write_record(a.json, record)


if __name__ == "__main__":
    main()
