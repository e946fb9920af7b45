"""An LM run directory, shared by ``lm train`` and ``distill train`` (with its own
:class:`~bayeslayer.training.lm.Objective`): :func:`train_lm` trains a causal LM into it, resumably, through
:func:`bayeslayer.training.lm.train_on_windows` (batches, micro-batches, data and context parallelism: see
there), evaluates it on the validation windows and writes its records; :func:`bayeslayer.training.lm.load_run`
reads the finished model back.  AdamW with the warm-up + cosine schedule and global-norm clipping is the
package's one loop (:func:`bayeslayer.training.loop.train_loop`); bf16 autocast where asked
(``precision="auto"``: bf16 on a CUDA device that supports it, else fp32).

Run directory (``--out``)::

    .lock                            held while a run uses the folder (a second run is refused)
    config.json                      the LMConfig (a resume must match it), written once the
                                     corpus has loaded and the model was built
    log.jsonl                        one JSON object per logged step / evaluation
    checkpoints/latest               name of the newest complete checkpoint
    checkpoints/step-00000100/       HF model dir (config.json, model.safetensors), trainer_state.json
                                     + trainer_state.safetensors, manifest.json (SHA-256 of each);
                                     sharded (--shard fsdp): config.json, every rank's
                                     shard-*.safetensors (weights and AdamW moments) and the trainer state
    final/                           HF model dir of the finished model (from_pretrained-able)
    train_summary.json               steps, tokens, tokens/s, final validation PPL by group

Checkpoints are :class:`bayeslayer.training.CheckpointStore` folders: written into a temporary
directory, fsynced, renamed into place and only then named in ``checkpoints/latest``, so a run
killed at any moment resumes from the last complete one; each file's SHA-256 is checked on load
(a damaged checkpoint is named, and an older one used when it exists).  A checkpoint holds the
model (safetensors), optimizer and scheduler states, step, loss history and every rank's RNG
states (JSON + safetensors, no pickle), so a resumed run continues the same loss trajectory bit
for bit on the same machine and world size; the log is cut back to the checkpoint's step, so no
step appears in it twice.  Ctrl-C stops after the current step with a checkpoint
(:class:`bayeslayer.training.TrainingInterrupted`).

Distributed: launch with ``torchrun --nproc_per_node N -m bayeslayer.cli lm train ...``; the
``gloo`` backend is used on CPU, ``nccl`` on CUDA.  With ``--context-parallel C`` (``context_parallel=``)
each window is split along T over ``C`` consecutive ranks (docs/context_parallel.md): every rank reads
its slice of the window and the token after it, its loss is its share of the window's loss, and the
``N / C`` groups are data-parallel replicas of one another.  Evaluation runs whole windows on every rank.
With ``--shard fsdp`` (``shard="fsdp"``) the model is sharded over every rank with FSDP2 instead of
replicated with DDP (:mod:`bayeslayer.training.parallel`; docs/distributed.md): the checkpoints are
sharded and load on any number of ranks, and ``final/`` is gathered into the same plain model folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...checks import check_int
from ...data.text.windows import WindowSchedule
from ...files import read_json, remove_stale_temporaries
from ...training import CheckpointStore, OutputLock
from ...training.distributed import DistContext, init_distributed, resolve_precision
from ...training.lm import Objective, load_corpus, micro_batches_per_step, train_on_windows
from ...training.lm_config import LMConfig, check_resume_config
from ...training.log import JsonLog
from ...training.loop import Checkpoints, LoopState, StepInfo
from ...training.optim import DECAY_POLICY
from ...training.parallel import check_shard
from ...training.state import seed_everything
from .lm_finish import finish_run, param_counts  # the end of a run: lm_finish.py
from .provenance import write_record


def _rank_seed(seed: int, rank: int) -> int:
    # dropout masks must differ between ranks, and not depend on how the model was initialised
    return (seed * 1_000_003 + 7919 * (rank + 1)) % 2**63

def checkpoint_store(run_dir: str | os.PathLike, *, keep: int = 1) -> CheckpointStore:
    """The run's :class:`~bayeslayer.training.CheckpointStore` (``run_dir/checkpoints``)."""
    return CheckpointStore(Path(run_dir) / "checkpoints", keep=keep)

def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint directory of a run that passes its SHA-256 check, or ``None``.

    A damaged newest checkpoint is set aside with a warning when an older one verifies; when none
    does, :class:`~bayeslayer.training.CheckpointError` names the damaged file.
    """
    return checkpoint_store(run_dir).load()

@dataclass
class LMTrainResult:
    """What one call of :func:`train_lm` did (losses cover the whole run, resumed parts included)."""

    run_dir: Path
    step: int = 0
    losses: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0  # training time of this call (excluding evaluations)
    step_cpu_seconds: float | None = None  # CPU time of the run's steps, earlier calls included (None: unknown)
    tokens_per_second: float = 0.0  # over this call's steps, all ranks together
    finished: bool = False
    resumed_from: int | None = None
    summary: dict = field(default_factory=dict)

def _check_objective(run_dir: Path, objective: Objective, *, write: bool, device: Any = "cpu", seed: int = 0) -> None:
    """A run directory that holds another objective's run is an error; ``write``: record ``objective.json``."""
    path = run_dir / "objective.json"
    current = objective.describe()
    if path.exists():
        saved = read_json(path, what="the run's objective")
        if isinstance(saved, dict):
            saved = {k: v for k, v in saved.items() if k != "provenance"}
        if saved != current:
            raise ValueError(f"{run_dir} holds a run of another objective ({saved} → {current}); use another --out")
    elif (run_dir / "checkpoints" / "latest").exists() and current != Objective().describe():
        raise ValueError(f"{run_dir} holds a next-token run; objective {current['name']!r} needs another --out")
    if write:
        write_record(path, current, device=device, seeds=[seed], optimizer_groups=DECAY_POLICY)

def train_lm(
    config: LMConfig,
    run_dir: str | os.PathLike,
    *,
    device: str = "auto",
    cache_dir: str | None = None,
    stop_after: int | None = None,
    progress: bool = True,
    keep_checkpoints: int = 1,
    on_step: Callable[[int, float], None] | None = None,
    objective: Objective | None = None,
    context_parallel: int = 1,
    compute: dict | None = None,
    shard: str = "none",
    activation_checkpointing: bool = False,
) -> LMTrainResult:
    """Train (or resume) the run in ``run_dir``; see the module docstring.

    Args:
        config: the run; a ``run_dir`` that already holds a run must have the same config
            (bookkeeping fields such as ``eval_every`` excepted).
        run_dir: output directory; resumes from ``checkpoints/latest`` when present.
        device: ``auto`` (``cuda:LOCAL_RANK`` when available, else CPU), ``cpu``, ``cuda:0``, ...
        cache_dir: token cache of :func:`bayeslayer.data.text.load_text_corpus`.
        stop_after: stop (with a checkpoint) once this many total steps are done — an interruption
            on purpose; ``train_lm`` again continues.
        progress: tqdm bar with loss and tokens/s on rank 0.
        keep_checkpoints: how many step checkpoints to keep (the newest).
        on_step: called as ``on_step(step, loss)`` after every optimiser step (all ranks).
        objective: what is trained (:class:`Objective`); default: next-token CE of a fresh
            :func:`build_model`.  Its :meth:`~Objective.describe` is part of the run's identity.
        context_parallel: ranks that share each window, split along T (1: none; docs/context_parallel.md).
            The job's ranks form groups of this many consecutive ranks; the groups are data-parallel
            replicas (``batch_size`` must be a multiple of ``micro_batch_size`` × the number of groups).
            Every mixer must have a context-parallel path: others are refused by name before training.
        compute: a compute-matched run's plan (:func:`bayeslayer.experiments.common.lm_compute.plan_run`: the budget,
            the steps and their FLOPs), written into ``train_summary.json`` as ``"compute"`` with the CPU and
            wall seconds the steps took.
        shard: ``"none"`` (DDP: every rank holds the whole model) or ``"fsdp"`` (FSDP2: each decoder block,
            the embedding and the head sharded over every rank; sharded checkpoints that resume on any number
            of ranks).  A run resumes with the shard it was started with.
        activation_checkpointing: recompute each block's activations in the backward pass (less memory,
            about one more forward pass of time; the losses do not change).

    Returns:
        :class:`LMTrainResult`; ``train_summary.json`` and ``final/`` once all steps are done.
    """
    if not isinstance(config, LMConfig):
        raise TypeError(f"config must be an LMConfig, got {type(config).__name__}")
    if stop_after is not None and (not isinstance(stop_after, int) or isinstance(stop_after, bool)
                                   or not 0 < stop_after <= config.steps):
        raise ValueError(f"stop_after must be an integer in [1, steps={config.steps}], got {stop_after!r}")
    check_int("keep_checkpoints", keep_checkpoints, minimum=1)
    objective = Objective() if objective is None else objective
    if not isinstance(objective, Objective):
        raise TypeError(f"objective must be an Objective, got {type(objective).__name__}")
    check_int("context_parallel", context_parallel, minimum=1)
    shard = check_shard(shard)
    if not isinstance(activation_checkpointing, bool):
        raise TypeError(f"activation_checkpointing must be a bool, got {type(activation_checkpointing).__name__}")
    if shard == "fsdp" and objective.shard_unsupported() is not None:
        raise ValueError(f"objective {objective.name!r} cannot be sharded: {objective.shard_unsupported()}")
    ctx = init_distributed(device, context_parallel=context_parallel)
    micro_batches_per_step(config.batch_size, config.micro_batch_size, ctx)  # checked before the folder is touched
    autocast_dtype = resolve_precision(config.precision, ctx.device)
    run_dir = Path(run_dir)
    # one run per folder: the lock is taken (rank 0) before anything in the folder is read or written
    with OutputLock(run_dir) if ctx.is_main else contextlib.nullcontext():
        return _train_lm(config, run_dir, ctx, autocast_dtype=autocast_dtype, cache_dir=cache_dir,
                         stop_after=stop_after, progress=progress, keep_checkpoints=keep_checkpoints,
                         on_step=on_step, objective=objective, compute=compute, shard=shard,
                         activation_checkpointing=activation_checkpointing)

class _LMCheckpoints(Checkpoints):
    """An LM run's checkpoints: HF model directories (``config.json``, ``model.safetensors``) with the
    trainer state, which records the :class:`LMConfig` (a resume must match it), the world size, the
    tokens and the training time so far."""

    def __init__(self, store: CheckpointStore, model, config: LMConfig, world_size: int) -> None:
        super().__init__(store)
        self.model, self.config, self.world_size = model, config, world_size
        self.module = model  # what a sharded checkpoint holds
        self.context_parallel = 1
        self.seconds_before = 0.0  # training time of earlier calls (from the checkpoint)

    def accept(self, checkpoint: Path, state: dict) -> bool:
        check_resume_config(json.loads(state["config"]), self.config, checkpoint)
        return True

    def write_weights(self, directory: Path) -> None:
        from ...models.loading import save_model_dir

        save_model_dir(self.model, directory)

    def read_weights(self, directory: Path) -> None:
        from ...models.loading import load_model_weights

        load_model_weights(self.model, directory)

    def write_shard_extras(self, directory: Path) -> None:
        self.model.config.save_pretrained(directory)  # what model the shards are of

    def extra_state(self, state: LoopState) -> dict:
        return {"train_seconds": self.seconds_before + state.seconds, "config": json.dumps(self.config.to_json()),
                "world_size": self.world_size, "context_parallel": self.context_parallel,
                "tokens": state.step * self.config.tokens_per_step}

    def restore(self, trainer_state: dict) -> None:
        self.seconds_before = float(trainer_state["train_seconds"])

def _train_lm(config: LMConfig, run_dir: Path, ctx: DistContext, *, autocast_dtype, cache_dir,
              stop_after, progress: bool, keep_checkpoints: int, on_step, objective: Objective, shard: str,
              activation_checkpointing: bool, compute: dict | None = None) -> LMTrainResult:
    world = ctx.world_size
    config_path = run_dir / "config.json"
    store = checkpoint_store(run_dir, keep=keep_checkpoints)
    if ctx.is_main:
        remove_stale_temporaries(run_dir)  # left by a killed run; safe: this process holds the lock
        store.recover()
        if config_path.exists():
            check_resume_config(read_json(config_path, what="the run's configuration"), config, run_dir)
        _check_objective(run_dir, objective, write=False)
    ctx.barrier()

    corpus = load_corpus(config, ctx, cache_dir=cache_dir, splits=("train", "validation"))
    train_windows = corpus.windows("train", config.seq_len)
    val_windows = corpus.windows("validation", config.seq_len)
    val_masks = corpus.annotate("validation", config.seq_len).masks(shifted=True)
    WindowSchedule(train_windows.shape[0], config.batch_size, config.seed)  # an empty split fails before any write

    seed_everything(config.seed)
    trainee = objective.build(config, corpus, ctx.device)
    model = trainee.model
    groups = objective.param_groups(trainee, config)
    if not [p for g in groups for p in g["params"]]:
        raise ValueError(f"objective {objective.name!r} leaves no parameter to train")
    if ctx.context_parallel:  # refuses a mixer without a context-parallel path before anything is written
        trainee = objective.context_parallel(trainee, config, ctx)
    if activation_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    if ctx.is_main:  # the inputs are valid (corpus loaded, model built): record what this run is
        write_record(config_path, config.to_json(), device=ctx.device, seeds=[config.seed],
                     optimizer_groups=DECAY_POLICY)
        _check_objective(run_dir, objective, write=True, device=ctx.device, seed=config.seed)

    log = JsonLog(run_dir / "log.jsonl", ctx.is_main)
    checkpoints = _LMCheckpoints(store, model, config, world)
    checkpoints.context_parallel = ctx.cp_size
    window_losses: list[float] = []

    def after_start(state: LoopState) -> None:
        if state.resumed_from is not None:
            log.truncate_after(state.step)
            log.write(event="resume", step=state.step, world_size=world, time=time.time())
        else:
            log.truncate_after(-1)
            log.write(event="start", step=0, world_size=world, context_parallel=ctx.cp_size, shard=shard,
                      device=str(ctx.device), time=time.time(), parameters=param_counts(model),
                      config=config.to_json())

    def after_step(state: LoopState, info: StepInfo) -> None:
        window_losses.append(info.loss)
        if info.step % config.log_every == 0 or info.step == end:
            tokens_per_s = (info.step - start[0]) * config.tokens_per_step / max(state.seconds, 1e-9)
            log.write(event="train", step=info.step, loss=info.loss, loss_mean=float(np.mean(window_losses)),
                      lr=info.lr, grad_norm=info.grad_norm, tokens=info.step * config.tokens_per_step,
                      tokens_per_s=tokens_per_s, train_seconds=checkpoints.seconds_before + state.seconds,
                      **({"parts": info.parts} if info.parts else {}))
            window_losses.clear()
        if on_step is not None:
            on_step(info.step, info.loss)

    def evaluate(state: LoopState, final: bool) -> dict:
        from ...evaluation.perplexity import grouped_perplexity

        windows, masks = val_windows, val_masks
        if not final and config.eval_windows:
            windows = windows[: config.eval_windows]
            masks = {k: m[: config.eval_windows] for k, m in masks.items()}
        groups = grouped_perplexity(model, windows, masks, batch_size=config.eval_batch_size, ctx=ctx,
                                    precision=config.precision)
        record = {"step": state.step, "split": "validation", "windows": int(windows.shape[0]),
                  "final": final, "groups": groups}
        log.write(event="eval", **record)
        return record

    end = config.steps if stop_after is None else stop_after
    start = [0]  # the step this call started from (tokens/s of this session)

    def started(state: LoopState) -> None:
        start[0] = state.step
        after_start(state)

    state = train_on_windows(
        trainee, train_windows, config.train_config(), ctx=ctx, micro_batch_size=config.micro_batch_size,
        groups=groups, autocast_dtype=autocast_dtype, checkpoints=checkpoints, evaluate=evaluate,
        final_eval_done=lambda s: bool(s.evals) and bool(s.evals[-1].get("final")), after_start=started,
        after_step=after_step, stop_after=stop_after, rank_seed=_rank_seed(config.seed, ctx.rank),
        find_unused_parameters=objective.find_unused_parameters, shard=shard, progress=progress,
        tokens_per_step=config.tokens_per_step, desc=f"lm {config.model_label}")
    result = LMTrainResult(run_dir=run_dir, step=state.step, losses=state.losses, evals=state.evals,
                           seconds=state.seconds, finished=state.finished, resumed_from=state.resumed_from,
                           step_cpu_seconds=state.step_cpu_seconds)
    steps_done = result.step - start[0]
    result.tokens = result.step * config.tokens_per_step
    result.tokens_per_second = steps_done * config.tokens_per_step / result.seconds if steps_done else 0.0
    if result.finished:
        result.summary = finish_run(run_dir, model, config, result, ctx, checkpoints.seconds_before,
                                    objective=objective, checks=objective.finish(trainee),
                                    tokenizer=corpus.tokenizer, compute=compute, shard=shard)
    ctx.barrier()
    return result


__all__ = ["LMTrainResult", "checkpoint_store", "latest_checkpoint", "train_lm"]
