"""Worker processes of the context-parallel training tests: each runs one rank of a gloo group on the CPU.

The tests start them with ``torch.multiprocessing.spawn``.  Every rank trains a two-layer
``BayesLayerForCausalLM`` through the package's LM training path (:func:`bayeslayer.training.lm.train_on_windows`
with a context-parallel :class:`~bayeslayer.training.distributed.DistContext` and next-token trainee);
rank 0 also trains the same model in one process on whole windows, and each
rank writes what it got to ``out_dir/rank{r}.json`` for the test to compare.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

VOCAB, T, N_WINDOWS = 50, 40, 8


def _init(rank: int, world: int, init_file: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def _model(mixers: list[str], dtype: torch.dtype):
    from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM

    torch.manual_seed(0)
    cfg = BayesLayerConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=len(mixers), num_heads=2, head_dim=4,
                           mixers=mixers, bos_token_id=None, eos_token_id=None, use_cache=False)
    return BayesLayerForCausalLM(cfg).to(dtype)


def _train(ctx, dtype: torch.dtype, steps: int, batch_size: int, micro_batch_size: int) -> tuple[list, dict]:
    """``(losses, final weights)`` of ``steps`` AdamW steps through the public LM training path on ``ctx``
    (:func:`bayeslayer.training.lm.train_on_windows`, the one ``lm train`` runs)."""
    from bayeslayer.training.lm import NextTokenTrainee, context_parallel, train_on_windows
    from bayeslayer.training.loop import TrainConfig

    windows = np.random.default_rng(3).integers(0, VOCAB, size=(N_WINDOWS, T))
    trainee = NextTokenTrainee(_model(["bayesian", "bayesian"], dtype))
    init = {k: v.detach().clone() for k, v in trainee.model.state_dict().items()}
    if ctx.context_parallel:
        trainee = context_parallel(trainee, T, ctx)
    config = TrainConfig(steps=steps, batch_size=batch_size, lr=3e-2, betas=(0.9, 0.95), weight_decay=0.1,
                         grad_clip=1.0, warmup_steps=1, seed=0)
    state = train_on_windows(trainee, windows, config, ctx=ctx, micro_batch_size=micro_batch_size, progress=False)
    weights = {k: v.detach().clone() for k, v in trainee.model.state_dict().items()}
    # the training moved every weight by a visible amount (else agreeing weights would show nothing)
    moved = min(_rel(p.detach(), init[k]) for k, p in trainee.model.named_parameters())
    return state.losses, weights, moved


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def compare(cp_size: int, dtype_name: str, steps: int, batch_size: int, micro_batch_size: int) -> dict:
    """Context-parallel training (``cp_size`` ranks per group, ``world / cp_size`` replicas) against one process
    (rank 0 runs it): losses, weights and whether every rank ended with the same weights."""
    from bayeslayer.training.distributed import DistContext, init_distributed

    dtype = getattr(torch, dtype_name)
    ctx = init_distributed(torch.device("cpu"), context_parallel=cp_size)
    losses, weights, _ = _train(ctx, dtype, steps, batch_size, micro_batch_size)
    out = {"losses": losses}
    flat = torch.cat([w.reshape(-1).double() for w in weights.values()])
    got = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(got, flat)
    out["ranks_agree"] = max(_rel(g, flat) for g in got)
    if ctx.rank == 0:
        ref_losses, ref_weights, out["moved"] = _train(DistContext(), dtype, steps, batch_size, batch_size)
        out["ref_losses"] = ref_losses
        out["losses_rel"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
        out["weights_rel"] = {k: _rel(weights[k], ref_weights[k]) for k in ref_weights}
    dist.barrier()
    return out


def train_case(rank: int, world: int, init_file: str, out_dir: str, cp_size: int, dtype_name: str, steps: int,
               batch_size: int, micro_batch_size: int) -> None:
    _init(rank, world, init_file)
    try:
        out = compare(cp_size, dtype_name, steps, batch_size, micro_batch_size)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def default_suite(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """What the default suite checks on 2 ranks, in one group (starting the processes is the slow part):
    float64 training against one process (3 AdamW steps, 4 windows of 40 tokens per step in 2 micro-batches),
    the bad set-ups and README's context-parallel training recipe."""
    _init(rank, world, init_file)
    try:
        out = {"float64": compare(world, "float64", 3, 4, 2), "bad": refusals(world)}
        out["readme"] = readme_recipe()  # last: the recipe ends the process group
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def readme_recipe() -> dict:
    """README's context-parallel training recipe, run as written on this job's ranks (it joins their group)."""
    from tests.test_contributing import recipe

    name = "context-parallel-training"
    namespace = {"__name__": "bayeslayer_recipe_cp"}
    exec(compile(recipe(name), f"<README recipe {name}>", "exec"), namespace)
    return {"losses": namespace["state"].losses, "steps": namespace["state"].step, "cp_size": namespace["ctx"].cp_size}


def refusals(world: int) -> dict:
    """Bad context-parallel set-ups of the training path; every rank records the error it got."""
    from bayeslayer.training.distributed import init_distributed
    from bayeslayer.training.lm import NextTokenTrainee, Objective, context_parallel
    from bayeslayer.training.lm_config import LMConfig

    got = {}
    ctx = init_distributed(torch.device("cpu"), context_parallel=world)
    config = LMConfig(seq_len=T, batch_size=4, micro_batch_size=1)
    for mixers in (["bayesian", "attention"], ["mamba2"]):
        try:
            Objective().context_parallel(NextTokenTrainee(_model(mixers, torch.float32)), config, ctx)
            got[mixers[-1]] = "ran"
        except ValueError as e:
            got[mixers[-1]] = str(e)
    try:  # a trainee other than next-token training of our model
        context_parallel(torch.nn.Linear(2, 2), T, ctx)
        got["trainee"] = "ran"
    except ValueError as e:
        got["trainee"] = str(e)
    try:
        init_distributed(torch.device("cpu"), context_parallel=world + 1)
        got["divide"] = "ran"
    except ValueError as e:
        got["divide"] = str(e)
    trainee = Objective().context_parallel(NextTokenTrainee(_model(["bayesian"], torch.float32)), config, ctx)
    try:  # whole windows instead of this rank's slice
        trainee(torch.zeros(1, T, dtype=torch.int64))
        got["slice"] = "ran"
    except ValueError as e:
        got["slice"] = str(e)
    return got
