"""The one training loop and results format shared by every synthetic experiment.

Nothing here knows a task.  A task supplies

* a **model**: ``nn.Module`` mapping ``batch.inputs`` to logits ``[B, T, V]``;
* a **batch sampler** ``sample_batch(step, batch_size, generator) -> batch`` where
  ``batch`` has ``.inputs`` (any tensor the model takes) and ``.labels``
  (``[B, T]`` long, ``-100`` where a token carries no loss).  The harness seeds
  ``generator`` from ``(config.seed, step)`` so step ``s`` always sees the same
  batch — that is what makes a resumed run identical to an uninterrupted one;
* optionally an **evaluate** callback ``evaluate(model) -> {name: float}`` run
  every ``eval_every`` steps and at the end (under ``torch.no_grad``, eval mode).

Training: cross-entropy on labelled tokens; AdamW ``(lr, betas, weight_decay,
eps)``; learning rate ``lr · s(step)`` with linear warmup then cosine decay,
``s(t) = (t+1)/W`` for ``t < W`` and ``min_ratio + (1 − min_ratio)·½(1 + cos π·(t−W)/(N−W))``
afterwards; global-norm gradient clipping.  ``train(..., checkpoint_path=d)`` keeps its
checkpoints in the folder ``d`` (:class:`bayeslayer.training.CheckpointStore`: crash-safe, SHA-256
verified, no pickle): ``model.safetensors`` and the trainer state (optimizer, scheduler, step,
loss history, RNG states) as JSON + safetensors, so a run after an interruption (a kill, Ctrl-C)
continues exactly where the last checkpoint stopped.  The folder is locked while a run uses it
(:class:`bayeslayer.training.OutputLock`).

Results: :func:`summarize` gives ``{"mean", "std", "values"}`` over seeds and
:func:`write_json` writes a results file atomically.  :func:`train_lr_grid` runs
:func:`train_seeds` at each learning rate of a grid and keeps the one whose
validation metric (e.g. query accuracy on a held-out split) is highest.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..training import (
    CheckpointError,
    CheckpointStore,
    OutputLock,
    TrainingInterrupted,
    atomic_write_json,
    load_state,
    read_json,
    rng_state,
    save_state,
    set_rng_state,
    stop_on_interrupt,
)
from ..training.optim import param_groups

IGNORE_INDEX = -100


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
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"{name} must be a positive integer, got {val!r}")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "seed"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {val!r}")
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


@dataclass
class TrainResult:
    """Per-step training losses, the periodic evaluations and the wall time of this call."""

    losses: list[float] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)  # each has "step"
    step: int = 0
    seconds: float = 0.0
    finished: bool = False


def lr_lambda(config: TrainConfig) -> Callable[[int], float]:
    """The schedule factor ``s(t)`` of the module docstring (multiplies ``config.lr``)."""
    W, N, lo = config.warmup_steps, config.steps, config.min_lr_ratio

    def factor(t: int) -> float:
        if t < W:
            return (t + 1) / W
        progress = min(1.0, (t - W) / max(1, N - W))
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (call before building a model)."""
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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


def _save_weights(model: nn.Module, path) -> None:
    from safetensors.torch import save_file

    # a tied weight appears under two names; safetensors stores tensors that share memory only once
    seen: set[int] = set()
    weights = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        weights[name] = t.contiguous().clone() if t.data_ptr() in seen or not t.is_contiguous() else t
        seen.add(t.data_ptr())
    save_file(weights, str(path), metadata={"format": "pt"})


def _load_weights(model: nn.Module, path) -> None:
    from safetensors.torch import load_file

    model.load_state_dict(load_file(str(path), device="cpu"))


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
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(param_groups(model, config.weight_decay), lr=config.lr, betas=config.betas,
                                  eps=config.eps, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
    result = TrainResult()
    saved_at: str | None = None  # the last complete checkpoint on disk
    saved_step = -1
    if store is not None:
        store.recover()
        try:
            ckpt = store.load()
        except CheckpointError as exc:
            if not restart_on_mismatch:
                raise
            warnings.warn(f"{exc}; starting this run from scratch", RuntimeWarning, stacklevel=3)
            store.discard()
            ckpt = None
        if ckpt is not None:
            state = load_state(ckpt, "trainer_state")
            if state["config"] != asdict(config) or state.get("identity") != identity:
                which = ("config", state["config"], asdict(config)) if state["config"] != asdict(config) else (
                    "task/model settings", state.get("identity"), identity)
                message = (f"checkpoint {ckpt} was written with {which[0]} {which[1]}, not {which[2]}")
                if not restart_on_mismatch:
                    raise ValueError(f"{message}; remove {store.root} or use the same {which[0]}")
                warnings.warn(f"{message}; starting this run from scratch", RuntimeWarning, stacklevel=3)
                ckpt = None
        if ckpt is not None:
            _load_weights(model, ckpt / "model.safetensors")
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            set_rng_state(state["rng"])
            result.losses, result.evals, result.step = list(state["losses"]), list(state["evals"]), state["step"]
            saved_at, saved_step = str(ckpt), result.step
            if result.step < config.steps:
                print(f"{desc}: resuming from step {result.step} ({ckpt})", file=sys.stderr, flush=True)

    def save() -> None:
        nonlocal saved_at, saved_step
        if store is None:
            return
        state = {"config": asdict(config), "identity": identity, "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "rng": rng_state(), "losses": result.losses,
                 "evals": result.evals, "step": result.step}

        def write(directory) -> None:
            _save_weights(model, directory / "model.safetensors")
            save_state(directory, "trainer_state", state)

        saved_at = str(store.save(result.step, write))
        saved_step = result.step

    def run_eval() -> None:
        if evaluate is None:
            return
        was_training = model.training
        model.eval()
        with torch.no_grad():
            metrics = evaluate(model)
        model.train(was_training)
        result.evals.append({"step": result.step, **{k: float(v) for k, v in metrics.items()}})

    end = config.steps if stop_after is None else stop_after
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=config.steps, initial=result.step, desc=desc, leave=False, dynamic_ncols=True)
    t0 = time.perf_counter()
    model.train()
    try:
        with stop_on_interrupt() as stop:
            while result.step < end:
                step = result.step
                batch = sample_batch(step, config.batch_size, batch_generator(config.seed, step))
                loss = masked_cross_entropy(model(batch.inputs), batch.labels)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"{desc}: loss became {loss.item()} at step {step}")
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
                optimizer.step()
                scheduler.step()
                result.losses.append(float(loss.detach()))
                result.step = step + 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{result.losses[-1]:.3f}")
                if config.eval_every and result.step % config.eval_every == 0 and result.step < config.steps:
                    run_eval()
                if config.checkpoint_every and result.step % config.checkpoint_every == 0:
                    save()
                if stop.requested:
                    if not (config.checkpoint_every and result.step % config.checkpoint_every == 0):
                        save()
                    raise TrainingInterrupted(f"{desc}: interrupted at step {result.step}; "
                                              + (f"saved it to {saved_at}; rerun the same command to resume"
                                                 if saved_at else "no checkpoint was saved"),
                                              step=result.step, checkpoint=saved_at)
    except TrainingInterrupted:
        raise
    except KeyboardInterrupt:  # a second Ctrl-C, mid-step: the last complete checkpoint stands
        saved = f"the last complete checkpoint is {saved_at}; rerun the same command to resume" if saved_at \
            else "no checkpoint was saved"
        raise TrainingInterrupted(f"{desc}: interrupted after step {result.step}; {saved}",
                                  step=result.step, checkpoint=saved_at) from None
    finally:
        if bar is not None:
            bar.close()
    result.finished = result.step >= config.steps
    if result.finished and (evaluate is None or not result.evals or result.evals[-1]["step"] != result.step):
        run_eval()  # not again when a finished checkpoint (final evaluation included) was resumed
        saved_step = -1
    if saved_step != result.step:
        save()
    result.seconds = time.perf_counter() - t0
    return result


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """Mean and sample standard deviation (``ddof = 1``; 0 for one seed) of per-seed numbers."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("summarize needs at least one value")
    arr = np.asarray(vals)
    std = float(arr.std(ddof=1)) if len(vals) > 1 else 0.0
    return {"mean": float(arr.mean()), "std": std, "values": vals}


def summarize_curves(curves: Sequence[Sequence[float]]) -> dict[str, list]:
    """Point-wise :func:`summarize` of per-seed curves of equal length: ``{"mean": [...], "std": [...]}``."""
    if not curves or len({len(c) for c in curves}) != 1:
        raise ValueError(f"curves must be a non-empty list of equal-length lists, got lengths "
                         f"{[len(c) for c in curves]}")
    cols = [summarize(col) for col in zip(*curves, strict=True)]
    return {"mean": [c["mean"] for c in cols], "std": [c["std"] for c in cols]}


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    return obj


def write_json(path: str | os.PathLike, obj: dict) -> None:
    """Write ``obj`` as indented JSON atomically and durably (:func:`bayeslayer.training.atomic_write_json`)."""
    atomic_write_json(path, _jsonable(obj))


def results_record(experiment: str, preset: str, config: dict, models: dict, **extra: Any) -> dict:
    """The common results layout: ``{"experiment", "preset", "config", "models", ...extra}``.

    ``models[name]`` holds ``"seeds"`` (one dict of raw metrics per seed) and
    ``"summary"`` (mean ± std over seeds, from :func:`summarize` / :func:`summarize_curves`).
    """
    return {"experiment": experiment, "preset": preset, "config": config, "models": models, **extra}


def train_seeds(
    name: str,
    build_model: Callable[[int], nn.Module],
    sample_batch: Callable[[int, int, torch.Generator], Any],
    config: TrainConfig,
    seeds: Sequence[int],
    final_eval: Callable[[nn.Module], dict[str, Any]],
    *,
    run_dir: str | None = None,
    evaluate: Callable[[nn.Module], dict[str, float]] | None = None,
    progress: bool = True,
    loss_curve_points: int = 100,
    fingerprint: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Train one model per seed and evaluate it; one record per seed.

    For seed ``s``: :func:`seed_everything(s)`, ``build_model(s)``, :func:`train` with
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
    """
    if not seeds:
        raise ValueError("seeds must be a non-empty list of non-negative integers")
    if run_dir is None:
        return [_train_seed(name, build_model, sample_batch, config, seed, final_eval, None, evaluate, progress,
                            loss_curve_points, fingerprint) for seed in seeds]
    with OutputLock(run_dir):
        return [_train_seed(name, build_model, sample_batch, config, seed, final_eval, run_dir, evaluate, progress,
                            loss_curve_points, fingerprint) for seed in seeds]


def _train_seed(name, build_model, sample_batch, config: TrainConfig, seed: int, final_eval, run_dir, evaluate,
                progress: bool, loss_curve_points: int, fingerprint) -> dict[str, Any]:
    cfg = TrainConfig(**{**asdict(config), "seed": int(seed)})
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
                if (isinstance(cached, dict) and cached.get("train_config") == _jsonable(asdict(cfg))
                        and cached.get("fingerprint") == _jsonable(fingerprint)):
                    return cached["record"]
            except (ValueError, KeyError, TypeError) as exc:
                warnings.warn(f"{exc}; training seed {seed} again", RuntimeWarning, stacklevel=3)
    seed_everything(int(seed))
    model = build_model(int(seed))
    res = train(model, sample_batch, cfg, evaluate=evaluate, checkpoint_path=ckpt, progress=progress,
                desc=f"{name} seed {seed}", identity={"fingerprint": _jsonable(fingerprint)},
                restart_on_mismatch=True)
    model.eval()
    with torch.no_grad():
        final = final_eval(model)
    n = len(res.losses)
    width = max(1, math.ceil(n / loss_curve_points))
    curve_steps = list(range(width, n + 1, width))
    curve = [float(np.mean(res.losses[s - width : s])) for s in curve_steps]
    tail = res.losses[-max(1, n // 10):]
    record = {"seed": int(seed), "train_seconds": res.seconds, "final_train_loss": float(np.mean(tail)),
              "loss_curve": {"step": curve_steps, "loss": curve}, "evals": res.evals, **final}
    if cache is not None:
        write_json(cache, {"train_config": asdict(cfg), "fingerprint": fingerprint, "record": record})
        shutil.rmtree(ckpt, ignore_errors=True)
    return _jsonable(record)


def train_lr_grid(
    name: str,
    build_model: Callable[[int], nn.Module],
    sample_batch: Callable[[int, int, torch.Generator], Any],
    config: TrainConfig,
    lrs: Sequence[float],
    seeds: Sequence[int],
    final_eval: Callable[[nn.Module], dict[str, Any]],
    *,
    select_key: str,
    run_dir: str | None = None,
    evaluate: Callable[[nn.Module], dict[str, float]] | None = None,
    progress: bool = True,
    fingerprint: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """:func:`train_seeds` at every learning rate of ``lrs``; select the lr by a validation metric.

    For each ``lr`` the seeds run with ``config`` (its ``lr`` replaced) under the name
    ``<name>_lr<lr>`` (so each grid point has its own cache and checkpoints and an interrupted grid
    resumes).  The score of an lr is the mean over seeds of ``record[select_key]`` — a number that
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
                                  fingerprint=fingerprint)
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

