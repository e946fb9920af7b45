"""``lm train --compute-match flops|time``: the language-model run's steps from the reference BL run's compute.

The reference is the Bayesian Layer run of the same configuration (:func:`reference_config`: mixer
``bayesian`` at its defaults, ``--match params``) and the preset's steps.  Every step of a language-model run
costs the same (``batch_size`` windows of ``seq_len`` tokens), so

* ``flops``: the budget is the reference's ``steps × FLOPs per step`` (``model.flops``, with the corpus's
  vocabulary), and the run trains the number of steps whose FLOPs come nearest it;
* ``time``: the budget is the CPU time of the reference run's steps (``--reference-run``: its
  ``train_summary.json``), the run's CPU seconds per FLOP are calibrated on a few steps of a throwaway
  model on the run's own first windows, and it trains the number of steps whose predicted CPU time comes
  nearest the budget.

The schedule is stretched to the new length (:func:`~bayeslayer.training.compute_match.stretch`).
The plan is written to ``<run>/compute_plan.json`` and read back by a resumed ``time`` run, so it keeps its
steps instead of calibrating again; a ``flops`` plan is recomputed exactly.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from ...files import read_json
from ...training.compute_match import CALIBRATION_STEPS, CALIBRATION_WARMUP, Budget, check_mode
from ...training.lm_config import LMConfig
from ...training.loop import train_loop
from .provenance import write_record

PLAN_NAME = "compute_plan.json"
REFERENCE = "bayesian"


def reference_config(config: LMConfig) -> LMConfig:
    """The reference run of ``config``: the same run with the default Bayesian Layer as every mixer."""
    return replace(config, mixer=REFERENCE, mixer_kwargs={}, match="params", label="", compute_match="steps")


def read_reference_seconds(run_dir: str | os.PathLike, config: LMConfig) -> float:
    """The CPU seconds of the finished reference run ``run_dir``'s steps (its ``train_summary.json``), checked to be
    a BL run of ``config``'s steps, batch and window length."""
    path = Path(run_dir) / "train_summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"--reference-run {run_dir} has no train_summary.json: train the reference BL run "
                                "to the end first")
    summary = read_json(path, what="the reference run's summary")
    ref = LMConfig.from_json(read_json(Path(run_dir) / "config.json", what="the reference run's configuration"))
    want = reference_config(config)
    for field in ("mixer", "steps", "batch_size", "seq_len", "hidden_size", "num_layers", "num_heads", "head_dim"):
        if getattr(ref, field) != getattr(want, field):
            raise ValueError(f"--reference-run {run_dir} has {field}={getattr(ref, field)!r}, but the reference of "
                             f"this run has {field}={getattr(want, field)!r}")
    seconds = summary.get("train_cpu_seconds") if isinstance(summary, dict) else None
    if not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"--reference-run {run_dir}: its train_summary.json records no CPU time of its steps "
                         "(train_cpu_seconds; runs of older versions lack it): train the reference again")
    return float(seconds)


def plan_run(config: LMConfig, out: str | os.PathLike, *, vocab_size: int, calibrate=None,
             reference_seconds: float | None = None) -> tuple[LMConfig, dict]:
    """``(config with its steps and schedule matched, compute)`` for ``config.compute_match`` ``flops`` or
    ``time``; ``compute`` goes into ``train_summary.json`` (and ``<out>/compute_plan.json``).

    ``vocab_size``: the corpus's; ``calibrate()`` (``time``): ``(cpu_seconds, flops)`` of the calibration's
    timed steps; ``reference_seconds`` (``time``): the budget.  A plan in ``out`` with the same budget is
    reused (a resumed run keeps its steps)."""
    from ...training.lm import build_model

    mode = check_mode(config.compute_match)
    if mode == "steps":
        raise ValueError("compute_match='steps' needs no plan")
    model_flops = build_model(config, vocab_size).flops(config.batch_size, config.seq_len).total
    ref = reference_config(config)
    ref_flops = build_model(ref, vocab_size).flops(ref.batch_size, ref.seq_len).total
    budget = Budget(mode, REFERENCE, is_reference=config.mixer == REFERENCE and not config.mixer_kwargs
                    and config.model.match == "params", model_flops=lambda _: model_flops,
                    reference_flops=lambda _: ref_flops,
                    reference_seconds={config.seed: reference_seconds} if reference_seconds is not None else None)
    if mode == "time" and budget.is_reference:
        raise ValueError("--compute-match time: this run is the reference BL run itself; train it with "
                         "--compute-match steps (or flops) and pass its folder as --reference-run to the others")
    path = Path(out) / PLAN_NAME
    saved = read_json(path, what="the run's compute plan") if path.is_file() else None
    plan = budget.plan(config.train_config(), config.seed, lambda step: None, calibrate=calibrate,
                       saved=saved.get("compute") if isinstance(saved, dict) else None)
    compute = plan["compute"]
    train = plan["train_config"]
    matched = replace(config, steps=train.steps, warmup_steps=train.warmup_steps, eval_every=train.eval_every)
    write_record(path, {"compute": compute, "config": matched.to_json()}, seeds=[config.seed])
    return matched, compute


def calibration(config: LMConfig, corpus, device) -> tuple[float, int]:
    """``(cpu_seconds, flops)`` of ``CALIBRATION_STEPS`` steps of a throwaway model of ``config`` (after
    ``CALIBRATION_WARMUP`` untimed ones, :mod:`bayeslayer.training.compute_match`) on the run's first windows, one
    process."""
    from ...data.text.windows import WindowSchedule
    from ...training.lm import SINGLE_PROCESS, NextTokenTrainee, build_model, rank_micro_batches

    n = CALIBRATION_WARMUP + CALIBRATION_STEPS
    windows = corpus.windows("train", config.seq_len)
    schedule = WindowSchedule(windows.shape[0], config.batch_size, config.seed)
    trainee = NextTokenTrainee(build_model(config, corpus.vocab_size, corpus.eos_id).to(device))
    n_micro = config.batch_size // config.micro_batch_size
    cpu: list[float] = []
    train_loop(trainee, lambda step: rank_micro_batches(windows, schedule, step, SINGLE_PROCESS,
                                                        config.micro_batch_size, n_micro),
               lambda module, ids: module(ids),
               replace(config.train_config(), steps=n, warmup_steps=0, eval_every=0, checkpoint_every=0),
               progress=False, after_step=lambda state, info: cpu.append(info.cpu_seconds), desc="calibration")
    step_flops = trainee.model.flops(config.batch_size, config.seq_len).total
    return sum(cpu[CALIBRATION_WARMUP:]), step_flops * CALIBRATION_STEPS


__all__ = ["PLAN_NAME", "REFERENCE", "calibration", "plan_run", "read_reference_seconds", "reference_config"]
