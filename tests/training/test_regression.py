"""One training loop, and numbers that did not move when the loops became one.

Every tiny run of :mod:`tests.training.regression` (MQAR, recall, crowding, LM with one and with two
micro-batches per step, the retrofit's three stages) runs once, with a global optimizer-step hook
that records who called ``optimizer.step()``; then

* **one loop**: every optimiser step of every experiment was taken by
  :func:`bayeslayer.training.loop.train_loop` (the first caller outside torch), and there were as many
  as the run's losses say;
* **regression**: the numbers equal ``regression_numbers.json``, written *before* the harness's and
  the LM's loops were merged into :mod:`bayeslayer.training.loop`, **exactly** (``==`` on the floats
  as JSON stores them, at full ``repr`` precision, and on the SHA-256 of the final LM weights).
  Exact, not ``<= 1e-6``: the runs are single-threaded on the CPU with the same seeds, so the same
  operations in the same order give the same bits; a change that moves a loss by one ulp has changed
  an operation or its order (a gradient reduced in another order, an RNG draw moved), which is what
  this test is for.  The bits are a function of the torch build, so on another torch version the
  comparison skips (the one-loop check still runs).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import bayeslayer.training.loop as loop_module

from .regression import FIXTURE, RUNS, tiny_numbers

EXPECTED = json.loads(FIXTURE.read_text())
TORCH_DIR = os.path.dirname(torch.__file__)


def _first_caller_outside_torch() -> tuple[str, str]:
    frame = sys._getframe(2)  # the hook's caller: torch's step wrapper
    while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
        frame = frame.f_back
    assert frame is not None
    return frame.f_code.co_filename, frame.f_code.co_name


@pytest.fixture(scope="module", params=RUNS)
def run(request):
    """``(name, numbers, Counter of (file, function) that stepped an optimiser)`` of one tiny run."""
    callers: Counter = Counter()
    handle = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: callers.update(
        [_first_caller_outside_torch()]))
    try:
        got = tiny_numbers([request.param])[request.param]
    finally:
        handle.remove()
    return request.param, json.loads(json.dumps(got)), callers


def _losses(name: str, numbers) -> int:
    """How many optimiser steps the run's numbers record."""
    if name in ("mqar", "recall", "crowding"):
        return sum(seed["loss_curve"]["step"][-1] for runs in numbers.values() for seeds in runs
                   for seed in (seeds if isinstance(seeds, list) else [seeds]))
    if name == "lm":
        return sum(len(r["losses"]) for r in numbers.values())
    return sum(len(stage["losses"]) for stage in numbers.values()) + 4  # + the teacher's 4 steps


def test_every_optimizer_step_is_taken_by_the_one_loop(run):
    name, got, callers = run
    assert set(callers) == {(loop_module.__file__, "train_loop")}, callers
    assert sum(callers.values()) == _losses(name, got) > 0


@pytest.mark.skipif(EXPECTED["torch"] != torch.__version__,
                    reason=f"fixture recorded with torch {EXPECTED['torch']}, this is {torch.__version__}")
def test_tiny_run_gives_the_recorded_numbers(run):
    name, got, _ = run
    assert got == EXPECTED["runs"][name]
