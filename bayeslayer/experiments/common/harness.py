"""Training and results of every synthetic experiment, on the package's one loop.

Nothing here knows a task.  A task supplies

* a **model**: ``nn.Module`` mapping ``batch.inputs`` to logits ``[B, T, V]``;
* a **batch sampler** ``sample_batch(step, batch_size, generator) -> batch`` where
  ``batch`` has ``.inputs`` (any tensor the model takes) and ``.labels``
  (``[B, T]`` long, ``-100`` where a token carries no loss).  The harness seeds
  ``generator`` from ``(config.seed, step)`` so step ``s`` always sees the same
  batch — that is what makes a resumed run identical to an uninterrupted one;
* optionally an **evaluate** callback ``evaluate(model) -> {name: float}`` run
  every ``eval_every`` steps and at the end (under ``torch.no_grad``, eval mode).

Training: :func:`train` is :func:`bayeslayer.training.loop.train_loop` with one micro-batch per step,
fp32 and cross-entropy on labelled tokens: AdamW ``(lr, betas, weight_decay, eps)`` over
:func:`bayeslayer.training.optim.param_groups`; learning rate ``lr · s(step)`` with linear warmup then
cosine decay (:func:`bayeslayer.training.loop.lr_lambda`); global-norm gradient clipping.
``train(..., checkpoint_path=d)`` keeps its checkpoints in the folder ``d``
(:class:`bayeslayer.training.CheckpointStore`: crash-safe, SHA-256 verified, no pickle):
``model.safetensors`` and the trainer state (optimizer, scheduler, step, loss history, RNG states) as
JSON + safetensors, so a run after an interruption (a kill, Ctrl-C) continues exactly where the last
checkpoint stopped (:mod:`bayeslayer.experiments.common.harness_checkpoints`).  The folder is locked while a
run uses it (:class:`bayeslayer.training.OutputLock`).

Results: :func:`summarize` gives ``{"mean", "std", "values"}`` over seeds and
:func:`write_json` writes a JSON file (a cache) atomically (both from
:mod:`bayeslayer.experiments.common.records`, and importable from here); results records are written by
:func:`bayeslayer.experiments.common.provenance.write_record`, which adds their provenance.  :func:`train_lr_grid` runs
:func:`train_seeds` at each learning rate of a grid and keeps the one whose
validation metric (e.g. query accuracy on a held-out split) is highest.
"""

from __future__ import annotations

import math
import os
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ...files import read_json
from ...training import CheckpointStore, OutputLock
from ...training.compute_match import CALIBRATION_STEPS, CALIBRATION_WARMUP, Budget
from ...training.loop import LoopState, TrainConfig, raise_if_diverged, train_loop
from ...training.loop import lr_lambda as lr_lambda  # the schedule, also imported from here
from ...training.state import seed_everything, weights_digest
from .harness_checkpoints import BOOKKEEPING as BOOKKEEPING  # the checkpoint folders: harness_checkpoints.py
from .harness_checkpoints import HarnessCheckpoints, harness_settings
from .provenance import jsonable
from .records import compute_summary as compute_summary  # the results helpers: records.py
from .records import results_record as results_record
from .records import summarize as summarize
from .records import summarize_curves as summarize_curves
from .records import write_json as write_json

IGNORE_INDEX = -100

@dataclass
class TrainResult:
    """Per-step training losses, the periodic evaluations, the wall time of this call and the wall-clock and
    CPU seconds of the run's optimiser steps, earlier calls included (``None``: a resumed checkpoint did not
    record them)."""

    losses: list[float] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)  # each has "step"
    step: int = 0
    seconds: float = 0.0
    finished: bool = False
    step_seconds: float | None = None
    step_cpu_seconds: float | None = None


def batch_generator(seed: int, step: int) -> torch.Generator:
    """The generator that draws step ``step``'s batch: a pure function of ``(seed, step)``."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step + 1)


def masked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over tokens whose label is not ``-100``; ``logits [B, T, V]``, ``labels [B, T]``."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on [B, T]")
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX)


def query_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of labelled tokens whose arg-max logit is the label."""
    mask = labels != IGNORE_INDEX
    n = int(mask.sum())
    if n == 0:
        raise ValueError("labels have no token with a loss (all -100)")
    return float((logits.argmax(-1)[mask] == labels[mask]).float().mean())


def train(
    model: nn.Module,
    sample_batch: Callable[[int, int, torch.Generator], Any],
    config: TrainConfig,
    *,
    evaluate: Callable[[nn.Module], dict[str, float]] | None = None,
    checkpoint_path: str | os.PathLike | None = None,
    stop_after: int | None = None,
    progress: bool = True,
    desc: str = "train",
    identity: dict[str, Any] | None = None,
    restart_on_mismatch: bool = False,
) -> TrainResult:
    """Train ``model`` for ``config.steps`` steps (see the module docstring).

    ``checkpoint_path``: a folder of checkpoints (:class:`bayeslayer.training.CheckpointStore`,
    the newest two kept).  When it holds one the run resumes from it (saying so on stderr) — its
    config and ``identity`` (any JSON, e.g. the task and model settings) must match, else
    ``ValueError``, or with ``restart_on_mismatch`` a warning and a fresh start.  A checkpoint is
    written every ``checkpoint_every`` steps, when stopping early and at the end; the folder is
    locked for the call (:class:`bayeslayer.training.FolderBusyError` when another run holds it).
    ``stop_after``: stop (and checkpoint) after that many total steps — an interruption on
    purpose, used to test resuming.  Ctrl-C stops after the current step with a checkpoint and
    raises :class:`bayeslayer.training.TrainingInterrupted` (a ``KeyboardInterrupt``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(sample_batch):
        raise TypeError("sample_batch must be callable as sample_batch(step, batch_size, generator)")
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    if stop_after is not None and (not isinstance(stop_after, int) or not 0 < stop_after <= config.steps):
        raise ValueError(f"stop_after must be an integer in [1, steps={config.steps}], got {stop_after!r}")
    if checkpoint_path is None:
        return _train(model, sample_batch, config, evaluate, None, stop_after, progress, desc, identity,
                      restart_on_mismatch)
    with OutputLock(checkpoint_path):
        return _train(model, sample_batch, config, evaluate, CheckpointStore(checkpoint_path, keep=2),
                      stop_after, progress, desc, identity, restart_on_mismatch)


def _train(model, sample_batch, config: TrainConfig, evaluate, store: CheckpointStore | None, stop_after,
           progress: bool, desc: str, identity, restart_on_mismatch: bool) -> TrainResult:
    t0 = time.perf_counter()
    micro_batches = _micro_batches(sample_batch, config)

    def run_eval(state: LoopState, final: bool) -> dict | None:
        if evaluate is None:
            return None
        was_training = model.training
        model.eval()
        with torch.no_grad():
            metrics = evaluate(model)
        model.train(was_training)
        return {"step": state.step, **{k: float(v) for k, v in metrics.items()}}

    checkpoints = None if store is None else HarnessCheckpoints(store, model, config, identity, restart_on_mismatch)
    state = train_loop(
        model, micro_batches, _harness_loss, config,
        checkpoints=checkpoints, evaluate=run_eval,
        # not again when a finished checkpoint (final evaluation included) was resumed
        final_eval_done=lambda s: evaluate is not None and bool(s.evals) and s.evals[-1]["step"] == s.step,
        stop_after=stop_after, progress=progress, progress_leave=False, desc=desc)
    return TrainResult(losses=state.losses, evals=state.evals, step=state.step,
                       seconds=time.perf_counter() - t0, finished=state.finished, step_seconds=state.step_seconds,
                       step_cpu_seconds=state.step_cpu_seconds)


def train_seeds(name: str, build_model: Callable[[int], nn.Module],
                sample_batch: Callable[[int, int, torch.Generator], Any], config: TrainConfig, seeds: Sequence[int],
                final_eval: Callable[[nn.Module], dict[str, Any]], *, run_dir: str | None = None,
                evaluate: Callable[[nn.Module], dict[str, float]] | None = None, progress: bool = True,
                loss_curve_points: int = 100, fingerprint: dict[str, Any] | None = None,
                budget: Budget | None = None) -> list[dict[str, Any]]:
    """Train one model per seed and evaluate it; one record per seed.

    For seed ``s``: :func:`~bayeslayer.training.state.seed_everything` ``(s)``, ``build_model(s)``, :func:`train` with
    ``config`` (its ``seed`` replaced by ``s``), then ``final_eval(model)`` under
    ``torch.no_grad`` in eval mode.  With ``run_dir`` (locked for the call, see
    :class:`bayeslayer.training.OutputLock`) each finished seed is cached as
    ``run_dir/<name>_seed<s>.json`` (reused when its config matches, so an interrupted
    sweep restarts where it stopped; ``fingerprint`` — e.g. the task and model settings — must
    match too) and training checkpoints to the folder ``run_dir/<name>_seed<s>.ckpt``
    (removed once the seed is done).  A checkpoint of other settings, or one that is damaged
    everywhere, is discarded with a warning and the seed trained from scratch; a cache file that is
    not valid JSON is ignored (warning) and the seed retrained.

    Record: ``{"seed", "train_seconds", "final_train_loss" (mean of the last 10% of steps),
    "loss_curve": {"step": [...], "loss": [...]} (≤ loss_curve_points points, each a window
    mean), "evals", **final_eval(model)}``.

    ``budget`` (a :class:`~bayeslayer.training.compute_match.Budget`, ``--compute-match flops|time``)
    sets each seed's steps to the reference's FLOPs or CPU time and stretches the schedule to them
    (:mod:`~bayeslayer.training.compute_match`); the record then holds ``"compute"``: the match, the
    budget, the steps, the FLOPs and the CPU and wall seconds of the steps.  A ``time`` plan is kept as
    ``run_dir/<name>_seed<s>.plan.json``, so a resumed seed keeps its steps.
    """
    if not seeds:
        raise ValueError("seeds must be a non-empty list of non-negative integers")
    if budget is not None and not isinstance(budget, Budget):
        raise TypeError(f"budget must be a compute_match.Budget or None, got {type(budget).__name__}")
    if run_dir is None:
        return [_train_seed(name, build_model, sample_batch, config, seed, final_eval, None, evaluate, progress,
                            loss_curve_points, fingerprint, budget) for seed in seeds]
    with OutputLock(run_dir):
        return [_train_seed(name, build_model, sample_batch, config, seed, final_eval, run_dir, evaluate, progress,
                            loss_curve_points, fingerprint, budget) for seed in seeds]


def _micro_batches(sample_batch, config: TrainConfig) -> Callable[[int], list]:
    def micro_batches(step: int) -> list:  # one micro-batch: the whole batch of the step
        return [sample_batch(step, config.batch_size, batch_generator(config.seed, step))]

    return micro_batches


def _harness_loss(m: nn.Module, batch) -> torch.Tensor:
    return masked_cross_entropy(m(batch.inputs), batch.labels)


def _calibrate(build_model, sample_batch, config: TrainConfig, flops_of: Callable[[Any], int]) -> tuple[float, int]:
    """``(cpu_seconds, flops)`` of ``CALIBRATION_STEPS`` training steps of a throwaway model (after
    ``CALIBRATION_WARMUP`` untimed ones, :mod:`bayeslayer.training.compute_match`) on the run's first batches."""
    model = build_model(config.seed)
    n = CALIBRATION_WARMUP + CALIBRATION_STEPS
    cfg = replace(config, steps=n, warmup_steps=0, eval_every=0, checkpoint_every=0)
    batches = _micro_batches(sample_batch, cfg)
    cpu: list[float] = []
    train_loop(model, batches, _harness_loss, cfg, progress=False, after_step=lambda st, info: cpu.append(
        info.cpu_seconds), desc="calibration")
    return sum(cpu[CALIBRATION_WARMUP:]), sum(flops_of(batches(s)[0]) for s in range(CALIBRATION_WARMUP, n))


def _plan_seed(name, build_model, sample_batch, cfg: TrainConfig, run_dir, budget: Budget) -> dict:
    """The seed's compute-matched plan (:meth:`Budget.plan`); a ``time`` plan is written next to its checkpoints
    and read back by a resumed run."""
    path = os.path.join(run_dir, f"{name}_seed{cfg.seed}.plan.json") if run_dir is not None else None
    saved = None
    if path is not None and budget.mode == "time" and os.path.exists(path):
        try:
            saved = read_json(path, what="compute-match plan")
        except ValueError as exc:
            warnings.warn(f"{exc}; calibrating seed {cfg.seed} again", RuntimeWarning, stacklevel=4)
    batches = _micro_batches(sample_batch, cfg)
    plan = budget.plan(cfg, cfg.seed, lambda step: batches(step)[0], saved=saved,
                       calibrate=lambda: _calibrate(build_model, sample_batch, cfg, budget.model_flops))
    if path is not None and budget.mode == "time" and not budget.is_reference:
        write_json(path, {k: plan["compute"][k] for k in ("budget", "reference_steps", "steps", "calibration")})
    return plan


def _train_seed(name, build_model, sample_batch, config: TrainConfig, seed: int, final_eval, run_dir, evaluate,
                progress: bool, loss_curve_points: int, fingerprint, budget: Budget | None = None) -> dict[str, Any]:
    cfg = TrainConfig(**{**asdict(config), "seed": int(seed)})
    compute = None
    if budget is not None:
        plan = _plan_seed(name, build_model, sample_batch, cfg, run_dir, budget)
        cfg, compute = plan["train_config"], plan["compute"]
        fingerprint = {**(fingerprint or {}), **budget.identity()}
    cache = ckpt = None
    if run_dir is not None:
        cache = os.path.join(run_dir, f"{name}_seed{seed}.json")
        ckpt = os.path.join(run_dir, f"{name}_seed{seed}.ckpt")
        legacy = os.path.join(run_dir, f"{name}_seed{seed}.pt")
        if os.path.exists(legacy):  # pickle-based checkpoints of older versions are never read
            warnings.warn(f"{legacy} is a checkpoint of an older version (pickle) and is not loaded; "
                          "delete it", RuntimeWarning, stacklevel=3)
        if os.path.exists(cache):
            try:
                cached = read_json(cache, what="cached seed result")
                saved = cached.get("train_config") if isinstance(cached, dict) else None
                if (isinstance(saved, dict) and harness_settings(saved) == harness_settings(jsonable(asdict(cfg)))
                        and cached.get("fingerprint") == jsonable(fingerprint)):
                    return cached["record"]
            except (ValueError, KeyError, TypeError) as exc:
                warnings.warn(f"{exc}; training seed {seed} again", RuntimeWarning, stacklevel=3)
    seed_everything(int(seed))
    model = build_model(int(seed))
    res = train(model, sample_batch, cfg, evaluate=evaluate, checkpoint_path=ckpt, progress=progress,
                desc=f"{name} seed {seed}", identity={"fingerprint": jsonable(fingerprint)},
                restart_on_mismatch=True)
    digest = weights_digest(model)
    model.eval()
    try:
        with torch.no_grad():
            final = final_eval(model)
    except Exception as err:  # noqa: BLE001 - a diverged run (NaN weights) is a FloatingPointError for the lr grid
        raise_if_diverged(err, list(model.parameters()), desc=f"{name} seed {seed}", step=len(res.losses))
        raise
    n = len(res.losses)
    width = max(1, math.ceil(n / loss_curve_points))
    curve_steps = list(range(width, n + 1, width))
    curve = [float(np.mean(res.losses[s - width : s])) for s in curve_steps]
    tail = res.losses[-max(1, n // 10):]
    record = {"seed": int(seed), "train_seconds": res.seconds, "final_train_loss": float(np.mean(tail)),
              "loss_curve": {"step": curve_steps, "loss": curve}, "evals": res.evals, "weights_sha256": digest, **final}
    if budget is not None:
        record["compute"] = budget.finish(compute, res.step_seconds, res.step_cpu_seconds)
    if cache is not None:
        write_json(cache, {"train_config": asdict(cfg), "fingerprint": fingerprint, "record": record})
        shutil.rmtree(ckpt, ignore_errors=True)
    return jsonable(record)


def train_lr_grid(name: str, build_model: Callable[[int], nn.Module],
                  sample_batch: Callable[[int, int, torch.Generator], Any], config: TrainConfig, lrs: Sequence[float],
                  seeds: Sequence[int], final_eval: Callable[[nn.Module], dict[str, Any]], *, select_key: str,
                  run_dir: str | None = None, evaluate: Callable[[nn.Module], dict[str, float]] | None = None,
                  progress: bool = True, fingerprint: dict[str, Any] | None = None,
                  budget: Callable[[float], Budget | None] | None = None) -> dict[str, Any]:
    """:func:`train_seeds` at every learning rate of ``lrs``; select the lr by a validation metric.

    For each ``lr`` the seeds run with ``config`` (its ``lr`` replaced) under the name
    ``<name>_lr<lr>`` (so each grid point has its own cache and checkpoints and an interrupted grid
    resumes; ``budget(lr)``, when given, is each grid point's :class:`Budget` for :func:`train_seeds`).  The
    score of an lr is the mean over seeds of ``record[select_key]`` — a number that
    ``final_eval`` computes on held-out *validation* data, never the test points; the highest score
    wins (ties: the earlier lr in ``lrs``).  An lr whose training diverges (the harness raises
    ``FloatingPointError``) gets the score NaN and a ``"diverged"`` message; when every lr diverges the
    error is raised.

    Returns ``{"select_key", "best_lr", "grid": [{"lr", "score"}, ...], "records": the best lr's
    per-seed records, "all_records": {lr: records}}``.
    """
    lrs = [float(lr) for lr in lrs]
    if not lrs or not all(math.isfinite(lr) and lr > 0 for lr in lrs):
        raise ValueError(f"lrs must be a non-empty list of finite positive learning rates, got {lrs}")
    if len(set(lrs)) != len(lrs):
        raise ValueError(f"lrs has repeated values: {lrs}")
    if not isinstance(select_key, str) or not select_key:
        raise ValueError(f"select_key must name a number returned by final_eval, got {select_key!r}")
    grid, all_records = [], {}
    for lr in lrs:
        try:
            records = train_seeds(f"{name}_lr{lr:g}", build_model, sample_batch, replace(config, lr=lr), seeds,
                                  final_eval, run_dir=run_dir, evaluate=evaluate, progress=progress,
                                  fingerprint=fingerprint, budget=budget(lr) if budget is not None else None)
        except FloatingPointError as err:  # a diverged lr is an outcome of the grid, not a crash of it
            grid.append({"lr": lr, "score": float("nan"), "diverged": str(err)})
            continue
        missing = [r["seed"] for r in records if select_key not in r]
        if missing:
            raise KeyError(f"final_eval returned no {select_key!r} (seeds {missing}); it returned "
                           f"{sorted(records[0])}")
        score = float(np.mean([float(r[select_key]) for r in records]))
        grid.append({"lr": lr, "score": score})
        all_records[lr] = records
    finite = [g for g in grid if math.isfinite(g["score"])]
    if not finite:
        raise FloatingPointError(f"{name}: every learning rate of the grid diverged: {grid}")
    best = max(finite, key=lambda g: g["score"])  # max keeps the first of equal scores
    return {"select_key": select_key, "best_lr": best["lr"], "grid": grid,
            "records": all_records[best["lr"]], "all_records": all_records}

