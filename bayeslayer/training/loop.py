"""The one training loop: every model the package trains is stepped by :func:`train_loop`.

The synthetic experiments (MQAR, recall, crowding, through :func:`bayeslayer.experiments.common.harness.train`)
and the language models (``lm train`` and the retrofit's stages, through
:func:`bayeslayer.experiments.common.lm_run.train_lm`) differ only in what they pass in:

* the **trainee** (an ``nn.Module``) and a **loss** ``loss(trainee, micro_batch) -> loss`` or
  ``(loss, {name: float})`` — the objective;
* ``micro_batches(step)``: this rank's micro-batches of optimiser step ``step`` (one micro-batch is
  just a configuration), a pure function of the step so that a resumed run reads what an
  uninterrupted one would;
* a :class:`TrainConfig`: AdamW ``(lr, betas, eps, weight_decay)`` over
  :func:`bayeslayer.training.optim.param_groups` (no decay on ``_no_weight_decay``-flagged, norm and
  bias parameters), learning rate ``lr · s(step)`` (:func:`lr_lambda`: linear warm-up, then cosine
  to ``min_lr_ratio``), global-norm gradient clipping at ``grad_clip``, evaluation every
  ``eval_every`` steps and a checkpoint every ``checkpoint_every`` steps.

One optimiser step: ``set_step(step)`` on the trainee when it has one; for each micro-batch, the
loss under autocast (``autocast_dtype``; ``None`` = fp32), divided by the number of micro-batches, and
its backward pass (DDP synchronises only on the last one); the float64 sum of the micro-batch losses,
averaged over ranks, is the step's loss (a non-finite one raises ``FloatingPointError``); clip; step
the optimiser and the schedule; clear the gradients.

Context parallelism (a :class:`~bayeslayer.training.distributed.DistContext` with ``cp_size > 1``): the
ranks of a context-parallel group share each sequence, so ``loss`` returns this rank's share of it (its
slice's summed losses over the global count: the shares add up to the sequence's loss) and the step's
loss is the sum over the group, averaged over the data-parallel replicas.  The trainee is not wrapped
in DDP then: after the last micro-batch the gradients are summed over every rank and divided by the
number of replicas (the group's shares add up, the replicas average), in one all-reduce.

Sharding (``shard="fsdp"``, :mod:`bayeslayer.training.parallel`): instead of DDP, the models inside the
trainee are sharded with FSDP2 over every rank of the job (``ctx.shard_mesh``) before the optimiser is
built, so each rank holds ``1/N`` of the weights, gradients and AdamW moments; FSDP reduce-scatters the
gradients of every micro-batch (with context parallelism: summed over the group, averaged over the
replicas), clipping takes the global norm over the sharded gradients, and a bf16 ``autocast_dtype`` also
makes FSDP gather the parameters in bf16 and reduce the gradients in fp32
(:func:`~bayeslayer.training.parallel.mixed_precision`).  Its checkpoints are sharded
(:mod:`bayeslayer.training.sharded_state`): every rank writes its shards into the checkpoint's folder,
which loads on any number of ranks.  In one process nothing is sharded, and the checkpoints keep the
sharded format, so a run moves between one process and N ranks.

Checkpoints (:class:`Checkpoints`, over a :class:`~bayeslayer.training.CheckpointStore`) hold the
model, the optimiser and schedule states, the step, the loss history, the evaluations, the wall-clock
and CPU seconds of the steps so far (:class:`LoopState`) and every rank's RNG states (JSON +
safetensors, :mod:`bayeslayer.training.state`); a checkpoint is read back before the first step, so
a run continues bit for bit where the last one stopped.  Ctrl-C stops
after the current step with a checkpoint (:func:`~bayeslayer.training.stop_on_interrupt`) and raises
:class:`~bayeslayer.training.TrainingInterrupted`; a second Ctrl-C stops at once with the last complete
checkpoint standing.
"""

from __future__ import annotations

import contextlib
import gc
import math
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..checks import check_int
from ..errors import NonFiniteError
from .checkpoint import CheckpointStore
from .distributed import DistContext, autocast
from .interrupt import TrainingInterrupted, stop_on_interrupt
from .optim import param_groups
from .parallel import check_shard, local_tensor, mixed_precision, shard_trainee
from .sharded_state import load_sharded, save_sharded
from .state import load_state, rng_state, save_state, set_rng_state


@dataclass(frozen=True)
class TrainConfig:
    """Optimiser, schedule and bookkeeping of one training run (one seed)."""

    steps: int = 2500
    batch_size: int = 256
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-4
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    eval_every: int = 0  # 0: evaluate only at the end
    checkpoint_every: int = 0  # 0: checkpoint only when stopping
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "seed"):
            check_int(name, getattr(self, name), minimum=0)
        if self.warmup_steps >= self.steps and self.steps > 1:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be < steps ({self.steps})")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be finite and > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"weight_decay must be finite and >= 0, got {self.weight_decay}")
        if not (self.eps > 0):
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if not (self.grad_clip > 0):
            raise ValueError(f"grad_clip must be > 0 (use math.inf for no clipping), got {self.grad_clip}")
        if not (0 <= self.min_lr_ratio <= 1):
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


def lr_lambda(config: TrainConfig) -> Callable[[int], float]:
    """The schedule factor ``s(t)`` that multiplies ``config.lr``.

    ``s(t) = (t+1)/W`` for ``t < W`` (warm-up), then ``min_ratio + (1 − min_ratio)·½(1 + cos π·(t−W)/(N−W))``.
    """
    W, N, lo = config.warmup_steps, config.steps, config.min_lr_ratio

    def factor(t: int) -> float:
        if t < W:
            return (t + 1) / W
        progress = min(1.0, (t - W) / max(1, N - W))
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@dataclass
class LoopState:
    """Where a run stands: the whole run's losses and evaluations (resumed parts included).

    Step times: ``seconds`` (wall clock) and ``cpu_seconds`` (this process's CPU time, every thread) of the
    optimiser steps of this call, evaluations and checkpoints excluded; ``seconds_before`` and
    ``cpu_seconds_before`` the same of the run's earlier calls, read from the checkpoint (``None`` when it was
    written by a version that did not record them), so :attr:`step_seconds` and :attr:`step_cpu_seconds`
    are the whole run's.  With one intra-op thread on an idle machine the two agree; on a shared machine
    the CPU time is the one other jobs do not inflate.
    """

    step: int = 0
    losses: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    seconds: float = 0.0  # time spent in optimiser steps during this call (evaluations excluded)
    cpu_seconds: float = 0.0  # CPU time of this process in those steps
    seconds_before: float | None = 0.0  # the run's earlier calls (from the checkpoint)
    cpu_seconds_before: float | None = 0.0
    finished: bool = False
    resumed_from: int | None = None  # the step of the checkpoint this call started from
    saved_step: int = -1  # the step of the last complete checkpoint on disk (-1: none)
    saved_at: str | None = None  # and its folder

    @property
    def step_seconds(self) -> float | None:
        """Wall-clock seconds of every optimiser step of the run so far (None: an earlier call's are unknown)."""
        return None if self.seconds_before is None else self.seconds_before + self.seconds

    @property
    def step_cpu_seconds(self) -> float | None:
        """CPU seconds of every optimiser step of the run so far (None: an earlier call's are unknown)."""
        return None if self.cpu_seconds_before is None else self.cpu_seconds_before + self.cpu_seconds


@dataclass(frozen=True)
class StepInfo:
    """What one optimiser step did (passed to ``after_step``)."""

    step: int  # steps done, this one included
    loss: float
    parts: dict[str, float]
    grad_norm: float
    lr: float
    seconds: float
    cpu_seconds: float = 0.0  # this process's CPU time of the step


class Checkpoints:
    """How a run's checkpoints look on disk; :func:`train_loop` decides when they are written and read.

    A checkpoint is a folder of ``store`` holding the weights (:meth:`write_weights`) and the trainer
    state ``trainer_state.json`` + ``trainer_state.safetensors`` (:func:`bayeslayer.training.save_state`):
    ``step``, ``losses``, ``evals``, ``optimizer``, ``scheduler``, ``rng`` (one RNG state per rank) and
    whatever :meth:`extra_state` adds.  Subclasses say how the weights are stored and which saved runs
    they accept (:meth:`accept`).
    """

    state_name = "trainer_state"
    #: the module whose weights a sharded checkpoint holds (``train_loop(shard="fsdp")``); ``None``: the trainee
    module: nn.Module | None = None

    def __init__(self, store: CheckpointStore) -> None:
        if not isinstance(store, CheckpointStore):
            raise TypeError(f"store must be a CheckpointStore, got {type(store).__name__}")
        self.store = store

    def find(self) -> Path | None:
        """The checkpoint to resume from (rank 0 only), or ``None`` to start afresh."""
        return self.store.load()

    def accept(self, checkpoint: Path, state: dict) -> bool:
        """Whether ``state`` (read from ``checkpoint``) belongs to this run; ``False`` starts afresh.

        Raise to refuse the run instead.
        """
        return True

    def write_weights(self, directory: Path) -> None:
        raise NotImplementedError

    def read_weights(self, directory: Path) -> None:
        raise NotImplementedError

    def write_shard_extras(self, directory: Path) -> None:
        """What a sharded checkpoint holds besides the shards and the trainer state (e.g. the model's
        config); called on rank 0 in place of :meth:`write_weights`."""

    def extra_state(self, state: LoopState) -> dict:
        """More of the trainer state (e.g. the run's config), saved next to the loop's own."""
        return {}

    def restore(self, trainer_state: dict) -> None:
        """Take back what :meth:`extra_state` saved (called after the loop restored its own part)."""

    def save(self, step: int, trainer_state: dict, *, started: Path | None = None) -> Path:
        """Write checkpoint ``step``; ``started``: the folder (from ``store.begin()``) every rank wrote its shards
        into (a sharded checkpoint), which gets :meth:`write_shard_extras` instead of :meth:`write_weights`."""
        def write(directory: Path) -> None:
            if started is None:
                self.write_weights(directory)
            else:
                self.write_shard_extras(directory)
            save_state(directory, self.state_name, trainer_state)

        return self.store.save(step, write, started=started)


def raise_if_diverged(err: BaseException, params, *, desc: str, step: int) -> None:
    """Raise ``FloatingPointError`` ("training diverged ... at step N") from ``err`` when an update
    diverged and ``err`` is only where a forward pass met it: after the first update, a parameter of ``params``
    is NaN or Inf, or a layer met a non-finite value (:class:`~bayeslayer.errors.NonFiniteError`: huge but
    finite weights overflow inside a layer).  Otherwise return, and the caller re-raises ``err``."""
    if step == 0:  # no update has run: the fault is in the inputs or the initial weights
        return
    # a sharded parameter: this rank's shard (a collective here, on one rank's error path, could hang)
    if not isinstance(err, NonFiniteError) and all(bool(torch.isfinite(local_tensor(p.detach())).all())
                                                   for p in params):
        return
    raise FloatingPointError(f"{desc}: training diverged: the weights, or values computed from them, were NaN or "
                             f"Inf at step {step} ({' '.join(str(err).split())}); lower the learning rate") from err


def train_loop(
    trainee: nn.Module,
    micro_batches: Callable[[int], Sequence[Any]],
    loss: Callable[[nn.Module, Any], Any],
    config: TrainConfig,
    *,
    groups: Sequence[dict] | None = None,
    ctx: DistContext | None = None,
    autocast_dtype: torch.dtype | None = None,
    checkpoints: Checkpoints | None = None,
    evaluate: Callable[[LoopState, bool], dict | None] | None = None,
    final_eval_done: Callable[[LoopState], bool] | None = None,
    after_start: Callable[[LoopState], None] | None = None,
    after_step: Callable[[LoopState, StepInfo], None] | None = None,
    stop_after: int | None = None,
    rank_seed: int | None = None,
    find_unused_parameters: bool = False,
    shard: str = "none",
    progress: bool = True,
    progress_leave: bool = True,
    tokens_per_step: int | None = None,
    desc: str = "train",
) -> LoopState:
    """Train ``trainee`` for ``config.steps`` optimiser steps (see the module docstring); resume first.

    Args:
        trainee: the module whose parameters are trained (and, for DDP, wrapped).
        micro_batches: ``micro_batches(step)`` → this rank's micro-batches of the step (a non-empty sequence).
        loss: ``loss(module, micro_batch)`` → a scalar tensor or ``(tensor, {name: float})``; ``module`` is
            ``trainee`` or its DDP wrapper.
        config: optimiser, schedule, clipping, ``steps``, ``eval_every``, ``checkpoint_every``.
        groups: parameter groups chosen by the caller (split by :func:`~bayeslayer.training.optim.param_groups`
            into decayed and exempt halves); ``None``: every trainable parameter of ``trainee``.  Gradients
            are clipped over the parameters of the groups, in their order.
        ctx: the distributed context (:func:`~bayeslayer.training.distributed.init_distributed`); ``None``:
            one process on the CPU.
        autocast_dtype: autocast dtype of the forward passes (``None``: fp32).
        checkpoints: where and how checkpoints are written (``None``: never).
        evaluate: ``evaluate(state, final)`` → an evaluation record to append to ``state.evals`` (or
            ``None``); called after every ``eval_every``-th step but the last and, once all steps are
            done, with ``final=True`` unless ``final_eval_done(state)`` says the (resumed) run already has it.
        after_start: called once the checkpoint (if any) is restored, before the first step.
        after_step: called after every optimiser step with a :class:`StepInfo` (before evaluation and
            checkpointing of that step).
        stop_after: stop (with a checkpoint) once this many total steps are done.
        rank_seed: seed torch's global RNG with it before training (the dropout stream of this rank), and
            with ``rank_seed + step`` when a checkpoint of another world size is resumed.
        find_unused_parameters: passed to DDP.
        shard: ``"none"`` (DDP across ranks) or ``"fsdp"`` (FSDP2: the models inside the trainee sharded over
            every rank, sharded checkpoints; see the module docstring).
        progress, progress_leave, tokens_per_step, desc: the progress bar (rank 0) and the messages.

    Returns:
        the :class:`LoopState` (its ``finished`` says whether all steps are done).
    """
    _check_loop_arguments(trainee, micro_batches, loss, config, stop_after, checkpoints)
    shard = check_shard(shard)
    ctx = DistContext() if ctx is None else ctx
    if not isinstance(ctx, DistContext):
        raise TypeError(f"ctx must be a DistContext, got {type(ctx).__name__}")
    sharded = shard == "fsdp" and ctx.distributed  # in one process there is nothing to shard
    if sharded and ctx.shard_mesh is None:
        raise ValueError("shard='fsdp' needs the DistContext's shard_mesh: build the context with init_distributed")
    prepare = (lambda: shard_trainee(trainee, ctx.shard_mesh, mp_policy=mixed_precision(autocast_dtype),
                                     gradient_divide_factor=ctx.dp_size)) if sharded else None
    params, optimizer, scheduler = _optimizer_and_schedule(trainee, groups, config, desc, prepare)
    shards_of = None
    if shard == "fsdp" and checkpoints is not None:
        shards_of = checkpoints.module if checkpoints.module is not None else trainee
        _check_shards_module(shards_of, optimizer)
    if rank_seed is not None:
        torch.manual_seed(rank_seed)
    state = LoopState()
    _resume(state, checkpoints, optimizer, scheduler, ctx, rank_seed, config, desc, shards_of)
    if after_start is not None:
        after_start(state)
    keeper = _RunKeeper(state, ctx, checkpoints, optimizer, scheduler, evaluate, params, desc, shards_of)

    trainee.train()
    module = trainee if shard == "fsdp" else _distributed_module(trainee, ctx, find_unused_parameters)
    end = config.steps if stop_after is None else stop_after
    bar = _progress_bar(progress, ctx, state, end, config.steps, desc, progress_leave)
    session_steps = 0
    try:
        with stop_on_interrupt() as stop:
            while state.step < end:
                step = state.step
                t0, c0 = time.perf_counter(), time.process_time()
                batches = micro_batches(step)
                if len(batches) < 1:
                    raise ValueError(f"{desc}: micro_batches({step}) gave no micro-batch")
                if hasattr(trainee, "set_step"):
                    trainee.set_step(step)
                optimizer.zero_grad(set_to_none=True)
                loss_value, parts = _accumulate_gradients(module, trainee, batches, loss, ctx, autocast_dtype,
                                                          params, desc, step, sharded)
                grad_norm = _clip(params, config.grad_clip)
                lr = scheduler.get_last_lr()[0]
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                state.step = step + 1
                state.losses.append(loss_value)
                seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
                state.seconds += seconds
                state.cpu_seconds += cpu_seconds
                session_steps += 1
                _show_progress(bar, state, loss_value, session_steps, tokens_per_step)
                if after_step is not None:
                    after_step(state, StepInfo(step=state.step, loss=loss_value, parts=parts,
                                               grad_norm=grad_norm, lr=lr, seconds=seconds,
                                               cpu_seconds=cpu_seconds))
                keeper.after_step(config, stop)
    except TrainingInterrupted:
        raise
    except KeyboardInterrupt:  # a second Ctrl-C, mid-step: the last complete checkpoint stands
        raise _interrupted_mid_step(state, desc) from None
    finally:
        if bar is not None:
            bar.close()
    keeper.finish(config, final_eval_done)
    if module is not trainee:
        # free DDP (its reducer holds the process group) now, not whenever the cyclic GC runs: a DDP
        # object collected during interpreter shutdown, after destroy_process_group, can abort the process
        del module
        gc.collect()
    return state


# -- the steps of train_loop ------------------------------------------------------------------------
def _check_loop_arguments(trainee, micro_batches, loss, config, stop_after, checkpoints) -> None:
    if not isinstance(trainee, nn.Module):
        raise TypeError(f"trainee must be a torch.nn.Module, got {type(trainee).__name__}")
    if not callable(micro_batches) or not callable(loss):
        raise TypeError("micro_batches and loss must be callable")
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    if stop_after is not None and (not isinstance(stop_after, int) or isinstance(stop_after, bool)
                                   or not 0 < stop_after <= config.steps):
        raise ValueError(f"stop_after must be an integer in [1, steps={config.steps}], got {stop_after!r}")
    if checkpoints is not None and not isinstance(checkpoints, Checkpoints):
        raise TypeError(f"checkpoints must be a Checkpoints, got {type(checkpoints).__name__}")


def _optimizer_and_schedule(trainee: nn.Module, groups: Sequence[dict] | None, config: TrainConfig,
                            desc: str, prepare: Callable[[], None] | None = None,
                            ) -> tuple[list[nn.Parameter], torch.optim.Optimizer, Any]:
    """``(params, AdamW, LambdaLR)``: the parameters clipped (the groups', in order) and the one optimiser.

    ``prepare()``, when given, replaces the trainee's parameters (sharding): the weight-decay split is
    made before it (it reads flags set on the parameters), and the groups are carried over by name."""
    if groups is None:
        groups = [{"params": [p for p in trainee.parameters() if p.requires_grad]}]
    params = [p for g in groups for p in g["params"]]
    if not params:
        raise ValueError(f"{desc}: no parameter to train")
    split = param_groups(trainee, config.weight_decay, groups)
    if prepare is not None:
        names = {id(p): n for n, p in trainee.named_parameters()}
        prepare()
        now = dict(trainee.named_parameters())
        params = [now[names[id(p)]] for p in params]
        split = [{**g, "params": [now[names[id(p)]] for p in g["params"]]} for g in split]
    optimizer = torch.optim.AdamW(split, lr=config.lr, betas=config.betas, eps=config.eps,
                                  weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
    return params, optimizer, scheduler


def _check_shards_module(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A sharded checkpoint names the optimiser's parameters within ``module``: it must hold them all."""
    inside = {id(p) for p in module.parameters()}
    if any(id(p) not in inside for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(f"the checkpoints' module ({type(module).__name__}) must hold every trained parameter "
                         "for a sharded checkpoint")


def _clip(params: Sequence[torch.Tensor], max_norm: float) -> float:
    """Clip the gradients of ``params`` to the global norm ``max_norm``; their norm before clipping.  Sharded
    gradients (DTensors) give the norm over every rank's shards."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def _distributed_module(trainee: nn.Module, ctx: DistContext, find_unused_parameters: bool) -> nn.Module:
    """``trainee`` itself in one process or with context parallelism, else its DDP wrapper (what the loss is
    called with)."""
    if not ctx.distributed or ctx.context_parallel:
        return trainee
    return torch.nn.parallel.DistributedDataParallel(
        trainee, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
        find_unused_parameters=find_unused_parameters)


def _progress_bar(progress: bool, ctx: DistContext, state: LoopState, end: int, steps: int, desc: str,
                  leave: bool):
    """A tqdm bar on rank 0 when there are steps left to take, else ``None``."""
    if not (progress and ctx.is_main and state.step < end):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=steps, initial=state.step, desc=desc, unit="step", leave=leave, dynamic_ncols=True)


def _show_progress(bar, state: LoopState, loss_value: float, session_steps: int,
                   tokens_per_step: int | None) -> None:
    if bar is None:
        return
    bar.update(1)
    postfix = {"loss": f"{loss_value:.3f}"}
    if tokens_per_step:
        postfix["tok_s"] = f"{session_steps * tokens_per_step / max(state.seconds, 1e-9):,.0f}"
    bar.set_postfix(**postfix)


def _accumulate_gradients(module: nn.Module, trainee: nn.Module, batches: Sequence[Any], loss, ctx: DistContext,
                          autocast_dtype: torch.dtype | None, params, desc: str,
                          step: int, sharded: bool = False) -> tuple[float, dict[str, float]]:
    """Forward and backward every micro-batch of one step; ``(the step's loss, its parts)``, averaged.

    Each loss is divided by the number of micro-batches before its backward pass (DDP synchronises only
    on the last one); the float64 sum, averaged over ranks, is the step's loss, which must be finite.
    """
    n_micro = len(batches)
    loss_sum = None  # float64, on the device of the loss (a harness model may sit on a GPU)
    parts_sum: dict[str, float] = {}
    for i, batch in enumerate(batches):
        sync = module is trainee or i == n_micro - 1
        with contextlib.nullcontext() if sync else module.no_sync():
            try:
                with autocast(ctx.device, autocast_dtype):
                    out = loss(module, batch)
                    value, parts = out if isinstance(out, tuple) else (out, {})
                    value = value / n_micro
                value.backward()
            except Exception as err:  # noqa: BLE001 - re-raised as is unless the weights went non-finite
                # the last update left NaN/Inf weights, which a layer's input check meets first
                raise_if_diverged(err, params, desc=desc, step=step)
                raise
        part = value.detach().double()
        loss_sum = part if loss_sum is None else loss_sum + part
        for k, v in parts.items():
            parts_sum[k] = parts_sum.get(k, 0.0) + float(v) / n_micro
    if ctx.context_parallel and not sharded:  # FSDP's reduce-scatter did it
        _sync_context_parallel_gradients(trainee, ctx)
    if ctx.distributed:
        dist.all_reduce(loss_sum)
        loss_sum /= ctx.dp_size  # context parallel: a group's ranks hold shares of one loss
    loss_value = float(loss_sum)
    if not math.isfinite(loss_value):
        raise FloatingPointError(f"{desc}: training diverged: the loss became {loss_value} at step {step}")
    return loss_value, parts_sum


def _sync_context_parallel_gradients(trainee: nn.Module, ctx: DistContext) -> None:
    """Sum every trainable parameter's gradient over all ranks and divide by the number of data-parallel
    replicas, in one all-reduce: the shares of a context-parallel group add up, the replicas average.  A
    parameter that got no gradient on any rank keeps none (as in one process, the optimiser skips it)."""
    params = [p for p in trainee.parameters() if p.requires_grad]
    if not params:
        return
    dtype = params[0].dtype
    for p in params[1:]:
        dtype = torch.promote_types(dtype, p.dtype)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype)
                      for p in params]
                     + [torch.tensor([float(p.grad is not None) for p in params], dtype=dtype,
                                     device=params[0].device)])
    dist.all_reduce(flat)
    got = flat[-len(params):]
    offset = 0
    for i, p in enumerate(params):
        n = p.numel()
        if got[i] > 0:
            p.grad = (flat[offset:offset + n] / ctx.dp_size).view_as(p).to(p.dtype)
        offset += n


def _interrupted_mid_step(state: LoopState, desc: str) -> TrainingInterrupted:
    saved = (f"the last complete checkpoint is {state.saved_at}; rerun the same command to resume"
             if state.saved_at else "no checkpoint was saved")
    return TrainingInterrupted(f"{desc}: interrupted after step {state.step}; {saved}",
                               step=state.saved_step if state.saved_at else state.step, checkpoint=state.saved_at)


class _RunKeeper:
    """What :func:`train_loop` does around the steps: evaluations, checkpoints and stopping on Ctrl-C."""

    def __init__(self, state: LoopState, ctx: DistContext, checkpoints: Checkpoints | None, optimizer, scheduler,
                 evaluate: Callable[[LoopState, bool], dict | None] | None, params, desc: str,
                 shards_of: nn.Module | None = None) -> None:
        self.state, self.ctx, self.checkpoints = state, ctx, checkpoints
        self.optimizer, self.scheduler = optimizer, scheduler
        self.evaluate, self.params, self.desc = evaluate, params, desc
        self.shards_of = shards_of  # sharded checkpoints: the module whose weights they hold

    def save(self) -> None:
        """Write a checkpoint of the run as it stands (collective: every rank contributes its RNG state and,
        sharded, its shards)."""
        checkpoints, ctx, state = self.checkpoints, self.ctx, self.state
        if checkpoints is None:
            return
        rng = rng_state(ctx.device)
        if ctx.distributed:
            gathered: list = [None] * ctx.world_size
            dist.all_gather_object(gathered, rng)
            rng = gathered
        else:
            rng = [rng]
        trainer_state = {"step": state.step, "losses": state.losses, "evals": state.evals,
                         "step_seconds": {"wall": state.step_seconds, "cpu": state.step_cpu_seconds},
                         **checkpoints.extra_state(state), "optimizer": None,
                         "scheduler": self.scheduler.state_dict(), "rng": rng}
        if self.shards_of is None:
            trainer_state["optimizer"] = self.optimizer.state_dict()
            if ctx.is_main:
                state.saved_at = str(checkpoints.save(state.step, trainer_state))
        else:
            started = self._shared_folder()
            try:
                groups = save_sharded(started, self.shards_of, self.optimizer)  # every rank writes its shards
            except BaseException:
                if ctx.is_main:
                    shutil.rmtree(started, ignore_errors=True)
                raise
            trainer_state.update(optimizer={"param_groups": groups}, sharded=True)
            if ctx.is_main:
                state.saved_at = str(checkpoints.save(state.step, trainer_state, started=started))
        ctx.barrier()
        if not ctx.is_main:
            pointed = checkpoints.store.pointed()
            state.saved_at = str(pointed) if pointed is not None else None
        state.saved_step = state.step

    def _shared_folder(self) -> Path:
        """The temporary folder of a sharded checkpoint: rank 0 makes it, every rank learns its name."""
        name = [str(self.checkpoints.store.begin()) if self.ctx.is_main else None]
        if self.ctx.distributed:
            dist.broadcast_object_list(name, src=0)
        return Path(name[0])

    def run_eval(self, final: bool) -> None:
        if self.evaluate is None:
            return
        try:
            record = self.evaluate(self.state, final)
        except Exception as err:  # noqa: BLE001 - re-raised as is unless the weights went non-finite
            raise_if_diverged(err, self.params, desc=self.desc, step=self.state.step)
            raise
        if record is not None:
            self.state.evals.append(record)

    def stop_requested(self, stop) -> bool:
        if not self.ctx.distributed:
            return stop.requested
        flag = torch.tensor([float(stop.requested)], device=self.ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        return bool(flag.item())

    def after_step(self, config: TrainConfig, stop) -> None:
        """Evaluate and checkpoint when the step is due; on Ctrl-C save and raise ``TrainingInterrupted``."""
        state = self.state
        if config.eval_every and state.step % config.eval_every == 0 and state.step < config.steps:
            self.run_eval(final=False)
        if config.checkpoint_every and state.step % config.checkpoint_every == 0:
            self.save()
        if self.stop_requested(stop):
            if self.checkpoints is not None and state.saved_step != state.step:
                self.save()
            raise TrainingInterrupted(
                f"{self.desc}: interrupted at step {state.step}; "
                + (f"saved it to {state.saved_at}; rerun the same command to resume" if state.saved_at
                   else "no checkpoint was saved"), step=state.step, checkpoint=state.saved_at)

    def finish(self, config: TrainConfig, final_eval_done: Callable[[LoopState], bool] | None) -> None:
        """After the last step of this call: the final evaluation (once per run) and the last checkpoint."""
        state = self.state
        state.finished = state.step >= config.steps
        if state.finished and not (final_eval_done is not None and final_eval_done(state)):
            self.run_eval(final=True)
            state.saved_step = -1  # the evaluation is part of the trainer state
        if self.checkpoints is not None and state.saved_step != state.step:
            self.save()


def _resume(state: LoopState, checkpoints: Checkpoints | None, optimizer, scheduler, ctx: DistContext,
            rank_seed: int | None, config: TrainConfig, desc: str, shards_of: nn.Module | None = None) -> None:
    """Load the newest acceptable checkpoint (rank 0 chooses, every rank loads it) into the run."""
    if checkpoints is None:
        return
    ckpt = checkpoints.find() if ctx.is_main else None
    if ctx.distributed:  # rank 0 verified (and perhaps fell back): every rank loads the same one
        chosen = [str(ckpt) if ckpt is not None else None]
        dist.broadcast_object_list(chosen, src=0)
        ckpt = Path(chosen[0]) if chosen[0] is not None else None
    if ckpt is None:
        return
    saved = load_state(ckpt, checkpoints.state_name)
    if not checkpoints.accept(ckpt, saved):
        return
    written = "fsdp" if saved.get("sharded") else "none"
    if written != ("none" if shards_of is None else "fsdp"):
        raise ValueError(f"{ckpt} was written with shard={written!r} and this run has shard="
                         f"{'none' if shards_of is None else 'fsdp'!r}: resume it with shard={written!r}")
    if shards_of is None:
        checkpoints.read_weights(ckpt)
        optimizer.load_state_dict(saved["optimizer"])
    else:
        load_sharded(ckpt, shards_of, optimizer, saved["optimizer"]["param_groups"])
    scheduler.load_state_dict(saved["scheduler"])
    state.step, state.losses, state.evals = saved["step"], list(saved["losses"]), list(saved["evals"])
    timed = saved.get("step_seconds") or {}  # absent in checkpoints of older versions: unknown
    state.seconds_before, state.cpu_seconds_before = timed.get("wall"), timed.get("cpu")
    rng = saved["rng"]
    rng = [rng] if isinstance(rng, dict) else list(rng)  # a single-process run of older versions: one dict
    if len(rng) == ctx.world_size:
        set_rng_state(rng[ctx.rank], ctx.device)
    else:
        warnings.warn(f"{ckpt} was written by {len(rng)} rank(s), this job has {ctx.world_size}: the data "
                      "order and weights resume exactly, the dropout RNG streams do not", RuntimeWarning,
                      stacklevel=3)
        torch.manual_seed((rank_seed or 0) + state.step)
    checkpoints.restore(saved)
    state.resumed_from = state.saved_step = state.step
    state.saved_at = str(ckpt)
    if ctx.is_main and state.step < config.steps:
        print(f"{desc}: resuming from step {state.step} ({ckpt})", file=sys.stderr, flush=True)


__all__ = ["Checkpoints", "LoopState", "StepInfo", "TrainConfig", "lr_lambda", "train_loop"]
