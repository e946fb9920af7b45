"""One training loop, and numbers that did not move when the loops became one.

Every tiny run of :mod:`tests.training.regression` (MQAR, recall, crowding, LM with one and with two
micro-batches per step, the retrofit's three stages) runs once, with a global optimizer-step hook
that records who called ``optimizer.step()``; then

* **one loop**: every optimiser step of every experiment was taken by
  :func:`bayeslayer.training.loop.train_loop` (the first caller outside torch), and there were as many
  as the run's losses say;
* **regression**: the numbers equal ``regression_numbers.json``, whose reference record was written
  *before* the harness's and the LM's loops were merged into :mod:`bayeslayer.training.loop`.

The bits of a run depend on the code and on the machine.  Same torch build, same seeds, one thread: the
same operations in the same order give the same bits, but PyTorch's vectorised kernels, MKL's matrix
products and oneDNN's convolutions each pick their instruction set (AVX2, AVX-512, AMX) at run time, and
with it the order in which they sum.  So the fixture keys each record by
:func:`~tests.training.regression.machine` (torch version, CPU vendor and model, PyTorch's CPU
capability, MKL's and oneDNN's instruction sets), and

* on a machine the fixture has a record of, the numbers must equal it **exactly** (``==`` on the
  floats as JSON stores them, at full ``repr`` precision, and on the SHA-256 of the final weights): a
  change that moves a loss by one ulp has changed an operation or its order (a gradient reduced in
  another order, a sum flipped), which is what this test is for;
* on any other machine with the same torch version every float must lie within
  ``ABS_TOL + REL_TOL·|x|`` (``2e-7 + 1e-5·|x|``) of every record, everything else (accuracies, counts,
  shapes) equal, the weights' SHA-256 not compared.

Measured, for the tolerance: the tiny runs on the reference AMD EPYC and on an Intel Xeon (AVX-512 with AMX)
under its own instruction sets, with ``ATEN_CPU_CAPABILITY=avx2``,
``MKL_ENABLE_INSTRUCTIONS=AVX2``, ``ONEDNN_MAX_CPU_ISA=AVX2`` each alone, all three, and
``ATEN_CPU_CAPABILITY=default`` — eight settings, each with bits of its own — differ from each other by
at most 3.2e-6 relative on the numbers above 1e-3 (a Phase B loss) and by at most 5.4e-8 absolute on
the smaller ones (Phase B's KL terms, ~1e-4); AVX2 against AVX-512 on the Xeon alone, 1.1e-6 and 2.2e-8.
The tolerance is about three times that.  It catches a moved RNG draw (one extra ``torch.rand`` before the
first step moves the LM's numbers by up to 7e-3 relative) and a changed formula (the key normalisation's eps
doubled moves a Phase A loss by 2.3e-5 relative); it cannot catch a pure reordering of a sum (summing
``l2norm``'s squares backwards moved nothing by more than 2.3e-6 relative), which moves the numbers no
more than another instruction set does.  That is left to the exact comparison: ``.ci/run`` runs this file
a second time with ``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2``, so a
machine with a record of both settings checks two instruction sets bit for bit.  On another torch version
the comparison skips (the one-loop check still runs).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections import Counter

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import bayeslayer.training.loop as loop_module

from .regression import FIXTURE, RUNS, differences, machine, tiny_numbers

RECORDS = json.loads(FIXTURE.read_text())["records"]
SAME_TORCH = [r for r in RECORDS if r["machine"].get("torch") == torch.__version__]
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


@pytest.mark.skipif(not SAME_TORCH, reason=f"no record made with torch {torch.__version__} (recorded: "
                    f"{sorted({r['machine'].get('torch') for r in RECORDS})})")
def test_tiny_run_gives_the_recorded_numbers(run):
    name, got, _ = run
    exact = [r for r in SAME_TORCH if r["machine"] == machine()]
    if exact:
        assert got == exact[0]["runs"][name]
    else:
        for record in SAME_TORCH:
            assert differences(got, record["runs"][name], name) == [], record["machine"]


def test_the_records_agree_within_the_tolerance():
    """The machines' records differ by less than the tolerance: the numbers moved with the machine only."""
    for a, b in itertools.combinations(RECORDS, 2):
        if a["machine"].get("torch") == b["machine"].get("torch"):
            assert differences(a["runs"], b["runs"]) == [], (a["machine"], b["machine"])


def test_the_tolerance_sees_a_change_the_machines_do_not_make():
    """A loss moved by 1e-4 relative (less than a moved RNG draw moves it) is out; the reference passes."""
    reference = RECORDS[0]["runs"]["lm"]
    moved = json.loads(json.dumps(reference))
    moved["one_micro_batch"]["losses"][-1] *= 1 + 1e-4
    assert differences(reference, reference) == []
    assert [line.split(":")[0] for line in differences(moved, reference)] == ["/one_micro_batch/losses[5]"]
