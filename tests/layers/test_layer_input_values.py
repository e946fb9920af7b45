"""A NaN or Inf in a mixer's input is named as the mixer's input, not as the filter's ``q`` downstream."""

from __future__ import annotations

import pytest
import torch

from bayeslayer.layers import MIXERS, build_mixer
from bayeslayer.ops import value_checks

HIDDEN = 16


def make(name: str):
    extra = dict(state_size=4) if name == "mamba2" else {}
    return build_mixer(name, HIDDEN, num_heads=2, head_dim=8, **extra)


@pytest.mark.parametrize("name", sorted(MIXERS))
@pytest.mark.parametrize("T", [4, 1], ids=["prefill", "decode"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_input_is_named_hidden_states(name, T, bad):
    mixer = make(name)
    x = torch.randn(2, T, HIDDEN)
    x[1, -1, 3] = bad
    with pytest.raises(ValueError, match=r"^hidden_states contains NaN or Inf values \(shape \(2, " + str(T)):
        mixer(x)


def test_value_checks_off_skips_the_input_check():
    mixer = make("gated_deltanet")
    x = torch.randn(1, 4, HIDDEN)
    x[0, 0, 0] = float("nan")
    with value_checks(False):
        out = mixer(x)  # no check, no sync: the NaN flows through
    assert bool(torch.isnan(out.o).any())
