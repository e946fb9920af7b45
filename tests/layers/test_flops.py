"""Every mixer's FLOP count (``Mixer.flops``) against PyTorch's ``FlopCounterMode`` on the PyTorch path:
within 10%, forward and backward, for every registered mixer and the variants the experiments run."""

from __future__ import annotations

import pytest
import torch

from bayeslayer.layers import MIXERS, build_mixer
from bayeslayer.ops.flops import Tally
from bayeslayer.training.flop_counter import measure_training_flops

pytestmark = pytest.mark.usefixtures("no_opt_einsum")

HIDDEN, B, T = 32, 2, 40

# case -> (registry name, constructor keywords): every registered mixer, and what recall, crowding, MQAR and
# the language model build of them (conv-free, gate off, widened values, groups, the low-rank covariance)
CASES = {
    "bayesian": ("bayesian", {}),
    "bayesian_identity": ("bayesian", {"dynamics": "identity"}),
    "bayesian_diagonal_decay": ("bayesian", {"dynamics": "diagonal"}),
    "bayesian_groups": ("bayesian", {"groups": 2}),
    "bayesian_diagonal_covariance": ("bayesian", {"covariance": "diagonal"}),
    "bayesian_lowrank": ("bayesian", {"covariance": "lowrank", "rank": 3}),
    "bayesian_noconv_nogate": ("bayesian_noconv", {"use_gate": False}),
    "gated_deltanet": ("gated_deltanet", {}),
    "gated_deltanet_state_matched": ("gated_deltanet", {"expand_v": 3.0}),
    "gated_deltanet_nogate": ("gated_deltanet", {"use_gate": False}),
    "gated_deltanet_noconv": ("gated_deltanet_noconv", {}),
    "deltanet": ("deltanet", {}),
    "deltanet_noconv": ("deltanet_noconv", {}),
    "linear_attention": ("linear_attention", {}),
    "gla": ("gla", {}),
    "mamba2": ("mamba2", {"state_size": 8}),
    "mamba2_groups": ("mamba2", {"num_heads": 4, "head_dim": 4, "state_size": 8, "n_groups": 2}),
    "attention": ("attention", {}),
}


def test_every_registered_mixer_has_a_case():
    assert {name for name, _ in CASES.values()} == set(MIXERS)


@pytest.mark.parametrize("case", sorted(CASES))
def test_count_within_10_percent_of_flop_counter(case):
    name, kwargs = CASES[case]
    torch.manual_seed(0)
    sizes = {"num_heads": 2, "head_dim": 8, **({} if name == "attention" else {"chunk_size": 16})}
    mixer = build_mixer(name, HIDDEN, **{**sizes, **kwargs})
    # a linear map in front, so the mixer's input needs a gradient as inside a model
    front = torch.nn.Linear(HIDDEN, HIDDEN)
    x = torch.randn(B, T, HIDDEN)
    meas = measure_training_flops(lambda: mixer(front(x)).o.square().sum())
    t = Tally()
    t.linear(B * T, HIDDEN, HIDDEN, grad_input=False)
    count = mixer.flops(B, T) + t.count()
    for phase in ("forward", "backward"):
        ours, theirs = getattr(count, phase), getattr(meas.flops, phase)
        assert abs(ours - theirs) <= 0.10 * theirs, (case, phase, ours, theirs, meas.by_op)


def test_bayesian_layer_costs_more_than_gated_deltanet_at_one_shape():
    """The covariance pass is extra work on top of GDN's projections and mean pass."""
    bl = build_mixer("bayesian", 256, num_heads=4, head_dim=64).flops(1, 1024)
    gdn = build_mixer("gated_deltanet", 256, num_heads=4, head_dim=64).flops(1, 1024)
    assert bl.forward > gdn.forward and bl.backward > gdn.backward


def test_rotation_has_no_count_and_says_why():
    mixer = build_mixer("bayesian", HIDDEN, num_heads=2, head_dim=8, dynamics="rotation")
    with pytest.raises(ValueError, match="rotation"):
        mixer.flops(B, T)


@pytest.mark.parametrize("name", ["bayesian", "mamba2", "attention"])
def test_bad_sizes_are_named(name):
    mixer = build_mixer(name, HIDDEN, num_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="batch_size"):
        mixer.flops(0, T)
    with pytest.raises(TypeError, match="seq_len"):
        mixer.flops(B, 2.5)
