"""The numbers of tiny MQAR, recall, crowding, LM and distillation runs do not move.

``regression_numbers.json`` was written by :mod:`tests.training.regression` *before* the harness's
and the LM's training loops were merged into :mod:`bayeslayer.training.loop`; every run here must
give the same numbers again, **exactly** (``==`` on the floats as JSON stores them, which is their
full ``repr`` precision, and on the SHA-256 of the final LM weights).  Exact, not ``<= 1e-6``: the
runs are single-threaded on the CPU with the same seeds, so the same operations in the same order
give the same bits; a merge of two loops that moves a loss by one ulp has changed an operation or
its order (e.g. a gradient reduced in another order, an RNG draw moved) and that is what this test
is for.  The bits are a function of the torch build, so on another torch version the test skips.
"""

from __future__ import annotations

import json

import pytest
import torch

from .regression import FIXTURE, RUNS, tiny_numbers

EXPECTED = json.loads(FIXTURE.read_text())


@pytest.mark.skipif(EXPECTED["torch"] != torch.__version__,
                    reason=f"fixture recorded with torch {EXPECTED['torch']}, this is {torch.__version__}")
@pytest.mark.parametrize("run", RUNS)
def test_tiny_run_gives_the_recorded_numbers(run):
    got = json.loads(json.dumps(tiny_numbers([run])[run]))
    assert got == EXPECTED["runs"][run]
