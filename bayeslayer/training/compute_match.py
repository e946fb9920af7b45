"""``--compute-match steps|flops|time``: what every model of a comparison gets of the reference model's compute.

The reference is the Bayesian Layer's run (the recall/crowding core ``bayesian``, or ``bayesian_paper`` under
``--core paper``; the MQAR and language-model mixer ``bayesian``); each seed of each other model is matched to
the reference's run of the same seed (and, in MQAR, the same width and learning rate):

* ``steps`` — every model trains the preset's steps (what the commands did before this option existed);
* ``flops`` — the budget is the reference's FLOPs over its steps, counted by :mod:`bayeslayer.ops.flops` on
  the batches it trains on (a batch's cost follows its length); another model trains for the number of
  steps whose FLOPs, on the same sequence of batches, come nearest the budget: more steps for a cheaper
  model, and never further from the budget than half of one step's FLOPs;
* ``time`` — the budget is the reference's measured **CPU time** of its optimiser steps; another model's
  CPU seconds per FLOP are calibrated on :data:`CALIBRATION_STEPS` steps of a throwaway copy (after
  :data:`CALIBRATION_WARMUP` untimed ones, on the run's first batches), and it trains for the number of steps
  whose predicted CPU time comes nearest the budget.  The CPU and wall-clock seconds it then takes are
  recorded beside the budget.  CPU time, not wall time, because a shared machine's other jobs stretch the
  wall clock of a step but not the process's CPU time; with one intra-op thread (the default of these
  commands) the two agree on an idle machine.  Time is machine-dependent; FLOPs are not.

A matched run's learning-rate schedule is stretched to its length (:func:`stretch`): the warm-up keeps its
fraction of the steps, the cosine decays to the new end, and periodic evaluations keep their number.  The
step count is part of the run's training config, so a resumed run continues towards the same end: the
``flops`` count is recomputed exactly, and the ``time`` plan (calibration and steps) is written next to the
run's checkpoints and read back instead of calibrating again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..checks import check_int
from .loop import TrainConfig

MODES = ("steps", "flops", "time")
#: the ``--compute-match`` help of every command (``{reference}``: the command's reference model)
COMPUTE_MATCH_HELP = (
    "what every model gets of the reference {reference}'s compute: 'steps' (default) the preset's steps; 'flops' "
    "as many steps as spend the reference run's FLOPs (bayeslayer.ops.flops); 'time' as many as its measured CPU "
    "time of the training steps (one thread); the schedule is stretched to the new length and the record states "
    "the budget and each model's steps, FLOPs and seconds")
CALIBRATION_WARMUP = 2  # untimed steps before the calibration's timed ones (allocations, first-call costs)
CALIBRATION_STEPS = 8
#: how a record names its convention and its clock
FLOPS_CONVENTION = "bayeslayer.ops.flops: products, convolutions and factorizations, 2 FLOPs per multiply-add"
CLOCK = "CPU time of the process in its optimiser steps (one intra-op thread), wall-clock seconds beside it"


def check_mode(mode) -> str:
    """``mode`` when it is one of :data:`MODES`, else a ``ValueError`` naming ``compute_match``."""
    if mode not in MODES:
        raise ValueError(f"compute_match must be one of {MODES}, got {mode!r}")
    return mode


def stretch(config: TrainConfig, steps: int) -> TrainConfig:
    """``config`` for a run of ``steps`` steps instead of ``config.steps``: warm-up a same fraction of the steps,
    the cosine to the new end, and as many periodic evaluations as before (every ``ceil(steps / (k + 1))``
    steps for ``k`` evaluations before the end)."""
    steps = check_int("steps", steps, minimum=1)
    if steps == config.steps:
        return config
    warmup = round(config.warmup_steps * steps / config.steps)
    warmup = min(warmup, steps - 1) if steps > 1 else 0
    every = config.eval_every
    if every:
        k = len(range(every, config.steps, every))  # evaluations before the end
        every = math.ceil(steps / (k + 1)) if k else steps
    return replace(config, steps=steps, warmup_steps=warmup, eval_every=every)


def steps_for_budget(step_cost: Callable[[int], float], budget: float, *, limit: int = 10**7) -> tuple[int, float]:
    """``(N, spent)``: the number of steps ``N ≥ 1`` whose cost ``Σ_{s<N} step_cost(s)`` comes nearest
    ``budget`` (the smaller ``N`` on a tie), and that cost.  ``step_cost(s) > 0``."""
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
        raise ValueError(f"budget must be a finite positive number, got {budget!r}")
    spent, n = 0.0, 0
    while True:
        cost = step_cost(n)
        if not cost > 0:
            raise ValueError(f"step {n} costs {cost!r}: every step must cost more than 0")
        if spent + cost >= budget:
            if n == 0 or (spent + cost - budget) < (budget - spent):
                return n + 1, spent + cost
            return n, spent
        spent += cost
        n += 1
        if n >= limit:
            raise ValueError(f"the budget {budget:.4g} needs more than {limit:,} steps of this model")


@dataclass(frozen=True)
class Budget:
    """How one model's seeds are matched to the reference (given to
    :func:`~bayeslayer.experiments.common.harness.train_seeds`).

    ``mode`` and ``reference`` (its name in the record); ``is_reference``: this model *is* the reference (it
    trains the preset's steps and its own run sets the budget); ``model_flops(batch)`` and
    ``reference_flops(batch)``: a step's FLOPs on ``batch`` for this model and the reference (the same
    function for the reference itself); ``reference_seconds``: ``time`` only, ``{seed: CPU seconds}`` of the
    reference's run (unused for the reference itself).
    """

    mode: str
    reference: str
    is_reference: bool
    model_flops: Callable[[object], int]
    reference_flops: Callable[[object], int]
    reference_seconds: dict | None = None

    def __post_init__(self):
        check_mode(self.mode)
        if self.mode == "steps":
            raise ValueError("a Budget matches flops or time; steps needs none")
        if self.mode == "time" and not self.is_reference and not self.reference_seconds:
            raise ValueError(f"compute_match='time' needs the reference {self.reference!r}'s measured seconds "
                             "(train it first)")

    def identity(self) -> dict:
        """What a run's cache and checkpoints must match besides its config (the mode and the reference)."""
        return {"compute_match": self.mode, "reference": self.reference}

    def plan(self, config: TrainConfig, seed: int, batch: Callable[[int], object], *,
             calibrate: Callable[[], tuple[float, float]] | None = None, saved: dict | None = None) -> dict:
        """The seed's plan: ``{"train_config": TrainConfig, "compute": {...}}`` (``compute`` goes into the
        seed's record, completed by :meth:`finish`).

        ``batch(step)`` gives the step's batch; ``calibrate()`` (``time``) returns ``(cpu_seconds, flops)`` of
        the calibration's timed steps; ``saved``: a plan written earlier for this seed (``time``), reused when
        its budget is this one's (a resumed run keeps its steps)."""
        seed = check_int("seed", seed, minimum=0)
        ref_steps = config.steps
        ref_cost = _memo(lambda s: self.reference_flops(batch(s)))
        cost = ref_cost if self.is_reference else _memo(lambda s: self.model_flops(batch(s)))
        budget = {"flops": sum(ref_cost(s) for s in range(ref_steps))}  # the reference's FLOPs
        compute = {"match": self.mode, "reference": self.reference, "reference_steps": ref_steps, "budget": budget,
                   "flops_convention": FLOPS_CONVENTION}
        if self.mode == "time":
            compute["clock"] = CLOCK
            # the reference's own run sets its budget (finish); the others are given the reference's seconds
            budget["cpu_seconds"] = None if self.is_reference else float(self.reference_seconds[seed])
        if self.is_reference:
            steps = ref_steps
        elif self.mode == "flops":
            steps, _ = steps_for_budget(cost, budget["flops"])
        else:
            if saved and saved.get("budget") == budget and saved.get("reference_steps") == ref_steps:
                calibration = saved["calibration"]
                steps = int(saved["steps"])
            else:
                if calibrate is None:
                    raise ValueError("compute_match='time' needs calibrate() for a model other than the reference")
                seconds, flops = calibrate()
                calibration = {"steps": CALIBRATION_STEPS, "warmup_steps": CALIBRATION_WARMUP,
                               "cpu_seconds": seconds, "flops": flops}
                steps, _ = steps_for_budget(lambda s: cost(s) * seconds / flops, budget["cpu_seconds"])
            rate = calibration["cpu_seconds"] / calibration["flops"]
            compute["calibration"] = calibration
            compute["predicted_cpu_seconds"] = rate * sum(cost(s) for s in range(steps))
            compute["predicted_max_step_cpu_seconds"] = rate * max(cost(s) for s in range(steps))
        compute["steps"] = steps
        compute["flops"] = sum(cost(s) for s in range(steps))
        compute["max_step_flops"] = max(cost(s) for s in range(steps))
        return {"train_config": stretch(config, steps), "compute": compute}

    def finish(self, compute: dict, step_seconds: float | None, step_cpu_seconds: float | None) -> dict:
        """``compute`` with the run's measured seconds (and, for the reference in ``time``, the budget it set)."""
        out = {**compute, "cpu_seconds": step_cpu_seconds, "wall_seconds": step_seconds}
        if self.mode == "time" and self.is_reference:
            out["budget"] = {**compute["budget"], "cpu_seconds": step_cpu_seconds}
        return out


def _memo(fn: Callable[[int], int]) -> Callable[[int], int]:
    cache: dict[int, int] = {}

    def call(step: int) -> int:
        if step not in cache:
            cache[step] = int(fn(step))
        return cache[step]

    return call


def shape_flops(model) -> Callable[[object], int]:
    """``batch -> FLOPs`` of one training step of ``model`` (its ``flops(batch_size, seq_len)``) on a harness
    batch, whose ``inputs`` are ``[batch_size, seq_len, ...]``; memoised by shape."""
    if not callable(getattr(model, "flops", None)):
        raise TypeError(f"model must have flops(batch_size, seq_len), got {type(model).__name__}")
    cache: dict[tuple[int, int], int] = {}

    def of(batch) -> int:
        shape = tuple(int(n) for n in batch.inputs.shape[:2])
        if shape not in cache:
            cache[shape] = model.flops(*shape).total
        return cache[shape]

    return of


class Matching:
    """The compute match of one comparison: each model's :class:`Budget`, and the budgets the reference's runs set.

    A comparison may hold several *points* (MQAR: a width and a learning rate), each with its own reference
    run; ``point`` names one (``None``: a single point).  In ``time`` the reference of a point must be
    :meth:`add`-ed before another model of that point asks for its :meth:`budget`."""

    def __init__(self, mode: str, reference: str) -> None:
        self.mode, self.reference = check_mode(mode), reference
        if mode == "steps":
            raise ValueError("compute_match='steps' needs no Matching")
        self.seconds: dict = {}
        self.budgets: dict = {}

    def budget(self, kind: str, model_flops: Callable[[object], int], reference_flops: Callable[[object], int], *,
               point: str | None = None) -> Budget:
        """``kind``'s :class:`Budget` at ``point`` (``model_flops``/``reference_flops``: a step's FLOPs of a batch)."""
        is_reference = kind == self.reference
        if self.mode == "time" and not is_reference and point not in self.seconds:
            raise ValueError(f"compute_match='time': the reference {self.reference!r} must train before {kind!r}")
        return Budget(self.mode, self.reference, is_reference=is_reference, model_flops=model_flops,
                      reference_flops=reference_flops, reference_seconds=self.seconds.get(point))

    def add(self, kind: str, records: Sequence[dict], *, point: str | None = None) -> None:
        """Take note of ``kind``'s finished seeds at ``point`` (the reference's set the ``time`` budget)."""
        budgets = self.budgets.setdefault(point, {})
        for r in records:
            budgets.setdefault(int(r["seed"]), {})["flops"] = r["compute"]["budget"]["flops"]
        if kind != self.reference or self.mode != "time":
            return
        seconds = {int(r["seed"]): r["compute"]["cpu_seconds"] for r in records}
        missing = [s for s, v in seconds.items() if v is None]
        if missing:
            raise ValueError(f"the reference {kind!r} has no measured CPU time for seeds {missing} (resumed from a "
                             "checkpoint that did not record it); delete its runs/ files and train it again")
        self.seconds[point] = seconds
        for seed, value in seconds.items():
            budgets[seed]["cpu_seconds"] = value

    def describe(self) -> dict:
        """The record's ``"compute_match"``: the mode, the reference, each seed's budget (per point) and the
        conventions."""
        by_seed = {("all" if p is None else p): {str(k): v for k, v in sorted(b.items())}
                   for p, b in self.budgets.items()}  # the keys JSON gives
        out = {"mode": self.mode, "reference": self.reference,
               "budget_by_seed": by_seed["all"] if list(by_seed) == ["all"] else by_seed,
               "flops_convention": FLOPS_CONVENTION}
        if self.mode == "time":
            out["clock"] = CLOCK
        return out


__all__ = ["CALIBRATION_STEPS", "CALIBRATION_WARMUP", "CLOCK", "COMPUTE_MATCH_HELP", "FLOPS_CONVENTION", "MODES",
           "Budget", "Matching", "check_mode", "shape_flops", "steps_for_budget", "stretch"]
