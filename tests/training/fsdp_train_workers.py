"""Worker processes of the sharded-training tests: each runs one rank of a gloo group on the CPU.

The tests start them with ``torch.multiprocessing.spawn``.  Every rank trains a two-layer
``BayesLayerForCausalLM`` through the package's training paths with ``shard="fsdp"``
(:func:`bayeslayer.training.lm.train_on_windows`, or the run folder of
:func:`bayeslayer.experiments.common.lm_run.train_lm`); rank 0 also trains the same model in one process where a
case compares, and each rank writes what it got to ``out_dir/rank{r}.json`` for the test to compare.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

VOCAB, T, N_WINDOWS = 50, 40, 8


def _init(rank: int, world: int, init_file: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def _model(dtype: torch.dtype, tied: bool = False):
    from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM

    torch.manual_seed(0)
    cfg = BayesLayerConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_heads=2, head_dim=4,
                           mixers=["bayesian", "bayesian"], bos_token_id=None, eos_token_id=None, use_cache=False,
                           tie_word_embeddings=tied)
    return BayesLayerForCausalLM(cfg).to(dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def _train(ctx, dtype: torch.dtype, *, shard: str, micro_batch_size: int, tied: bool = False,
           checkpointing: bool = False) -> dict:
    """Losses, gradient norms, gathered final weights (rank 0), this rank's parameter bytes and how far the
    weights moved, after 3 AdamW steps of :func:`bayeslayer.training.lm.train_on_windows` (4 windows per step)."""
    from bayeslayer.training.lm import NextTokenTrainee, context_parallel, train_on_windows
    from bayeslayer.training.loop import TrainConfig
    from bayeslayer.training.parallel import full_state_dict, local_bytes

    windows = np.random.default_rng(3).integers(0, VOCAB, size=(N_WINDOWS, T))
    model = _model(dtype, tied)
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    trainee = NextTokenTrainee(model)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if ctx.context_parallel:
        trainee = context_parallel(trainee, T, ctx)
    # clipping at 0.5: the first steps' gradients are clipped, so the norm over the shards is exercised
    config = TrainConfig(steps=3, batch_size=4, lr=3e-2, betas=(0.9, 0.95), weight_decay=0.1, grad_clip=0.5,
                         warmup_steps=1, seed=0)
    norms: list[float] = []
    state = train_on_windows(trainee, windows, config, ctx=ctx, micro_batch_size=micro_batch_size, progress=False,
                             shard=shard, after_step=lambda s, info: norms.append(info.grad_norm))
    weights = full_state_dict(model)
    out = {"losses": state.losses, "grad_norms": norms, "param_bytes": local_bytes(model.parameters()),
           "weights": weights}
    if weights:
        out["moved"] = min(_rel(weights[k], init[k]) for k, _ in model.named_parameters())
    return out


def compare(ctx, dtype_name: str, *, micro_batch_size: int = 1, tied: bool = False,
            checkpointing: bool = False) -> dict:
    """FSDP training on ``ctx`` against one process (rank 0 runs it, with DDP's parameter bytes)."""
    from bayeslayer.training.distributed import DistContext

    dtype = getattr(torch, dtype_name)
    got = _train(ctx, dtype, shard="fsdp", micro_batch_size=micro_batch_size, tied=tied, checkpointing=checkpointing)
    out = {"losses": got["losses"], "grad_norms": got["grad_norms"], "param_bytes": got["param_bytes"]}
    if ctx.rank == 0:
        ref = _train(DistContext(), dtype, shard="none", micro_batch_size=4, tied=tied)
        out.update(ref_losses=ref["losses"], ref_grad_norms=ref["grad_norms"], ddp_param_bytes=ref["param_bytes"],
                   moved=ref["moved"])
        out["losses_rel"] = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"], strict=True))
        out["weights_rel"] = {k: _rel(got["weights"][k], ref["weights"][k]) for k in ref["weights"]}
    dist.barrier()
    return out


def mixed_precision(ctx) -> dict:
    """bf16 autocast with shard="fsdp": the dtypes a block's parameters have inside its forward, of the sharded
    parameters and of their gradients, and the losses (for the test to set beside fp32's)."""
    from bayeslayer.training.lm import NextTokenTrainee, train_on_windows
    from bayeslayer.training.loop import TrainConfig

    windows = np.random.default_rng(3).integers(0, VOCAB, size=(N_WINDOWS, T))
    model = _model(torch.float32)
    seen: dict = {}
    block = model.model.layers[0]

    def before_forward(module, args) -> None:  # inside the block's forward: its parameters are gathered
        seen["forward"] = sorted(set(seen.get("forward", [])) | {str(p.dtype) for p in module.parameters()})

    block.mlp.register_forward_pre_hook(before_forward)
    block.attn.register_forward_pre_hook(before_forward)

    def after_step(state, info):
        seen.setdefault("sharded", sorted({str(p.dtype) for p in model.parameters()}))

    original = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        seen.setdefault("grads", sorted({str(p.grad.dtype) for g in self.param_groups for p in g["params"]
                                         if p.grad is not None}))
        return original(self, *args, **kwargs)

    torch.optim.AdamW.step = step
    try:
        state = train_on_windows(NextTokenTrainee(model), windows, TrainConfig(steps=3, batch_size=4, lr=3e-2,
                                                                               warmup_steps=1),
                                 ctx=ctx, micro_batch_size=1, progress=False, shard="fsdp",
                                 autocast_dtype=torch.bfloat16, after_step=after_step)
    finally:
        torch.optim.AdamW.step = original
    return {**seen, "losses": state.losses}


def lm_config(corpus: str, **overrides):
    """The small LM run the run-folder cases train (fp32, no dropout, a checkpoint every 2 of 4 steps)."""
    from bayeslayer.training.lm_config import LMConfig

    settings = dict(preset="test", mixer="bayesian", hidden_size=16, num_layers=2, num_heads=2, head_dim=8,
                    mlp_dropout=0.0, source=corpus, vocab_size=280, seq_len=16, steps=4, batch_size=4,
                    micro_batch_size=1, lr=3e-3, warmup_steps=1, eval_every=2, eval_windows=3, eval_batch_size=2,
                    checkpoint_every=2, log_every=1, seed=0)
    settings.update(overrides)
    return LMConfig(**settings)


def run_folders(rank: int, corpus: str, cache_dir: str, out_dir: str) -> dict:
    """``lm train``'s run folder, sharded on this job: an uninterrupted run, and one stopped after step 2 and
    resumed (rank 0 keeps a copy of that folder as it was at step 2, for the other world sizes)."""
    from bayeslayer.experiments.common.lm_run import train_lm

    out, config = Path(out_dir), lm_config(corpus)
    whole = train_lm(config, out / "whole", device="cpu", cache_dir=cache_dir, progress=False, shard="fsdp")
    first = train_lm(config, out / "resumed", device="cpu", cache_dir=cache_dir, progress=False, shard="fsdp",
                     stop_after=2)
    if rank == 0:
        shutil.copytree(out / "resumed", out / "at_step_2")
    dist.barrier()
    second = train_lm(config, out / "resumed", device="cpu", cache_dir=cache_dir, progress=False, shard="fsdp")
    return {"whole": whole.losses, "first": first.losses, "resumed": second.losses,
            "resumed_from": second.resumed_from, "summary": second.summary}


def resume_elsewhere(rank: int, corpus: str, cache_dir: str, run_dir: str) -> dict:
    """Resume a run folder written by another number of ranks; also the weights and AdamW moments as loaded
    (gathered, rank 0) from its checkpoint, for the test to compare with the shard files."""
    from bayeslayer.experiments.common.lm_run import latest_checkpoint, train_lm
    from bayeslayer.training.distributed import init_distributed

    config = lm_config(corpus)
    ctx = init_distributed("cpu")
    name = [str(latest_checkpoint(run_dir)) if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    loaded = loaded_state(Path(name[0]), config, ctx)
    result = train_lm(config, run_dir, device="cpu", cache_dir=cache_dir, progress=False, shard="fsdp")
    return {"losses": result.losses, "resumed_from": result.resumed_from, "loaded": loaded}


def loaded_state(ckpt: Path, config, ctx) -> dict[str, list]:
    """Load a sharded checkpoint into a fresh model sharded over ``ctx`` (unsharded in one process) and AdamW
    with the run's parameter groups; ``{key: flat values}`` of the weights and moments gathered on rank 0 (``{}``
    on the others)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from bayeslayer.training.lm import build_model
    from bayeslayer.training.optim import param_groups
    from bayeslayer.training.parallel import full_state_dict, shard_model
    from bayeslayer.training.sharded_state import load_sharded
    from bayeslayer.training.state import load_state

    saved = load_state(ckpt, "trainer_state")
    model = build_model(config, config.vocab_size)
    groups = param_groups(model, config.weight_decay)  # before sharding: it reads the parameters' flags
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [{**g, "params": [names[id(p)] for p in g["params"]]} for g in groups]
    if ctx.distributed:
        shard_model(model, ctx.shard_mesh)
    now = dict(model.named_parameters())
    optimizer = torch.optim.AdamW([{**g, "params": [now[n] for n in g["params"]]} for g in groups], lr=config.lr)
    load_sharded(ckpt, model, optimizer, saved["optimizer"]["param_groups"])
    weights = full_state_dict(model)
    moments = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                  cpu_offload=True))
    if not weights:
        return {}
    out = {f"model.{k}": v.reshape(-1).tolist() for k, v in weights.items()}
    for fqn, state in moments["state"].items():
        out.update({f"optim.{fqn}.{k}": v.reshape(-1).tolist() for k, v in state.items()})
    return out


def kill_mid_save(rank: int, corpus: str, cache_dir: str, run_dir: str) -> None:
    """A run folder with a checkpoint every step, whose rank 1 is killed (SIGKILL) in the middle of writing the
    second checkpoint: after its shard file is written, before it is synced."""
    from bayeslayer.experiments.common.lm_run import train_lm
    from bayeslayer.training import loop

    real = loop.save_sharded
    calls = [0]

    def save(directory, module, optimizer):
        calls[0] += 1
        if rank == 1 and calls[0] == 2:
            os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
        return real(directory, module, optimizer)

    loop.save_sharded = save
    train_lm(lm_config(corpus, checkpoint_every=1), run_dir, device="cpu", cache_dir=cache_dir, progress=False,
             shard="fsdp")


def job(rank: int, world: int, init_file: str, out_dir: str, case: str, *args) -> None:
    """Run ``case`` on this rank and write its result to ``out_dir/rank{rank}.json``."""
    _init(rank, world, init_file)
    try:
        out = CASES[case](rank, world, *args)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _two_ranks(rank: int, world: int, corpus: str, cache_dir: str, out_dir: str) -> dict:
    """The default suite's two-rank job: float64 FSDP training against one process (plain; with a tied head and
    activation checkpointing together, each of which changes how FSDP gathers), bf16 mixed precision and the
    sharded run folder."""
    from bayeslayer.training.distributed import init_distributed

    ctx = init_distributed("cpu")
    return {"float64": compare(ctx, "float64", micro_batch_size=1),
            "tied_checkpointing": compare(ctx, "float64", micro_batch_size=2, tied=True, checkpointing=True),
            "bf16": mixed_precision(ctx),
            "mesh": [list(ctx.mesh.shape), list(ctx.mesh.mesh_dim_names), ctx.shard_mesh.size()],
            "runs": run_folders(rank, corpus, cache_dir, out_dir)}


def _cp_shard(rank: int, world: int, cp: int, dtype_name: str) -> dict:
    """FSDP over every rank × context parallelism in groups of ``cp``, on one mesh, against one process."""
    from bayeslayer.training.distributed import init_distributed

    ctx = init_distributed("cpu", context_parallel=cp)
    out = compare(ctx, dtype_name, micro_batch_size=1)
    out["mesh"] = [list(ctx.mesh.shape), list(ctx.mesh.mesh_dim_names), ctx.shard_mesh.size()]
    return out


def _float32(rank: int, world: int) -> dict:
    from bayeslayer.training.distributed import init_distributed

    return compare(init_distributed("cpu"), "float32", micro_batch_size=1)


CASES = {"two_ranks": _two_ranks, "cp_shard": _cp_shard, "float32": _float32,
         "resume": lambda rank, world, *a: resume_elsewhere(rank, *a),
         "kill": lambda rank, world, *a: kill_mid_save(rank, *a)}
