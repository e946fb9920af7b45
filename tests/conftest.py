"""Shared pytest set-up: deterministic seeds, and a hypothesis profile sized for a 2-core CI machine."""

from __future__ import annotations

import os

import pytest
import torch

# Triton reads TRITON_INTERPRET once, when it is first imported, and flash-linear-attention (the
# test oracle) imports it early; so the whole session must agree before any test module loads.
# Without a GPU the Triton kernels can only run in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis is a test extra; the property tests skip themselves without it
    settings = None

if settings is not None:
    # No per-example deadline: the first example pays for torch's lazy initialisation, and the
    # shared CI cores make wall-clock times noisy.  Examples are few; each draws a whole sequence.
    settings.register_profile(
        "bayeslayer", deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow]
    )
    # On demand: `pytest --hypothesis-profile=bayeslayer-thorough tests/ops/test_properties.py`.
    settings.register_profile(
        "bayeslayer-thorough", parent=settings.get_profile("bayeslayer"), max_examples=500
    )
    settings.load_profile("bayeslayer")


@pytest.fixture(autouse=True)
def _seed_and_restore_value_checks():
    """Every test starts from the same RNG state with value checks on, whatever a previous test did."""
    from bayeslayer.ops import set_value_checks

    torch.manual_seed(0)
    previous = set_value_checks(True)
    yield
    set_value_checks(previous)
