"""Design models refuse arguments that do not fit them, naming the argument (never a silent wrong answer).

A design fixes its dynamics (GDN is scalar, KDA diagonal, ...) and its write model decides
which noise arguments it takes; anything else raises.  The ops' own checks (shapes, ranges,
devices, dtypes) run underneath and are exercised through the designs here too.
"""

from __future__ import annotations

import math

import pytest
import torch

from bayeslayer.design import (
    BAYESIAN,
    DELTANET,
    DIAGONAL_COVARIANCE,
    GATED_DELTANET,
    GLA,
    KDA,
    LINEAR_ATTENTION,
    LONGHORN,
    MAMBA2,
    DesignModel,
    fixed_prior,
    get_design,
)

B, T, H, D, m = 2, 5, 2, 4, 6


def qkv():
    return torch.randn(B, T, H, D), torch.randn(B, T, H, D) / 2, torch.randn(B, T, H, m)


def scalar_alpha():
    return torch.full((B, T, H), 0.9)


def diag_alpha():
    return torch.full((B, T, H, D), 0.9)


def gain():
    return torch.full((B, T, H), 0.5)


# (id, design, keyword arguments, exception, regex)
CASES = [
    ("gdn-diagonal-alpha", GATED_DELTANET, dict(gain=gain(), alpha=diag_alpha()), ValueError,
     r"design 'gated_deltanet' has scalar dynamics but got alpha \(2, 5, 2, 4\).*\(diagonal\)"),
    ("gdn-no-alpha", GATED_DELTANET, dict(gain=gain()), ValueError, r"'gated_deltanet' has scalar dynamics.*identity"),
    ("deltanet-alpha", DELTANET, dict(gain=gain(), alpha=scalar_alpha()), ValueError,
     r"'deltanet' has identity dynamics"),
    ("kda-scalar-alpha", KDA, dict(gain=gain(), alpha=scalar_alpha()), ValueError, r"'kda' has diagonal dynamics"),
    ("gla-theta", GLA, dict(gain=gain(), alpha=diag_alpha(), theta=torch.zeros(B, T, H, D // 2)), ValueError,
     r"'gla' has diagonal dynamics.*rotation"),
    ("mamba2-alpha-float", MAMBA2, dict(gain=gain(), alpha=0.9), TypeError,
     r"alpha must be a torch.Tensor or None, got float"),
    ("bayes-theta-list", BAYESIAN, dict(r2=0.5, ell2=0.1, theta=[0.1]), TypeError, r"theta must be a torch.Tensor"),
    ("longhorn-scalar-noise", LONGHORN, dict(r2=torch.ones(B, T, H), lam=1.0), ValueError,
     r"'longhorn' needs a per-value-column r2 or gain \[B, T, H, m\] \(m=6\), got \(2, 5, 2\)"),
    ("longhorn-groups-not-columns", LONGHORN, dict(gain=torch.full((B, T, H, 2), 0.5)), ValueError,
     r"'longhorn' needs a per-value-column r2 or gain.*got \(2, 5, 2, 2\)"),
    ("longhorn-number", LONGHORN, dict(r2=0.5, lam=1.0), ValueError, r"'longhorn' needs a per-value-column.*float"),
    ("fixed-prior-given-lam", fixed_prior(0.5), dict(r2=0.5, lam=1.0), ValueError,
     r"'fixed_prior_0.5' fixes lam=0.5; pass only r2"),
    ("fixed-prior-given-gain", fixed_prior(0.5), dict(gain=gain()), ValueError, r"fixes lam=0.5; pass only r2"),
    ("bayes-given-lam", BAYESIAN, dict(r2=0.5, ell2=0.1, lam=1.0), ValueError, r"do not pass gain or lam"),
    ("diagcov-given-gain", DIAGONAL_COVARIANCE, dict(r2=0.5, ell2=0.1, gain=gain()), ValueError,
     r"do not pass gain or lam"),
    ("bayes-missing-ell2", BAYESIAN, dict(r2=0.5), ValueError, r"ell2 \(process noise variance\) is required"),
    ("reset-given-ell2", DELTANET, dict(gain=gain(), ell2=0.1), ValueError, r"do not pass ell2"),
    ("reset-gain-and-r2", DELTANET, dict(gain=gain(), r2=0.5), ValueError, r"pass either gain or r2"),
    ("reset-missing-lam", DELTANET, dict(r2=0.5), ValueError, r"lam \(prior/write variance\) or gain is required"),
    ("latent-missing-r2", LINEAR_ATTENTION, dict(lam=1.0), ValueError, r"r2 \(observation noise variance\)"),
    ("gain-zero", GATED_DELTANET, dict(gain=torch.zeros(B, T, H), alpha=scalar_alpha()), ValueError,
     r"gain must be > 0"),
    ("gain-nan", LINEAR_ATTENTION, dict(gain=torch.full((B, T, H), math.nan)), ValueError, r"gain contains NaN"),
    ("alpha-above-one", GATED_DELTANET, dict(gain=gain(), alpha=torch.full((B, T, H), 1.2)), ValueError,
     r"alpha must lie in \(0, 1\]"),
    ("gain-meta", LINEAR_ATTENTION, dict(gain=torch.ones(B, T, H, device="meta")), ValueError,
     r"gain is on meta but q is on cpu"),
    ("gain-int", LINEAR_ATTENTION, dict(gain=torch.ones(B, T, H, dtype=torch.int64)), TypeError,
     r"gain must be a floating-point tensor"),
    ("bayes-state-one-tensor", BAYESIAN, dict(r2=0.5, ell2=0.1, initial_state=torch.zeros(B, H, D, m)), TypeError,
     r"initial_state must be a tuple \(M, P\)"),
    ("reset-state-shape", DELTANET, dict(gain=gain(), initial_state=(torch.zeros(B, H, D, m - 1), None)), ValueError,
     r"initial_state\[0\] \(M\) must be \[B, H, D, m\]"),
]


@pytest.mark.parametrize("method", ["recurrent", "chunk"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_design_paths_reject(method, case):
    _, design, kwargs, exc, pattern = case
    q, k, v = qkv()
    with pytest.raises(exc, match=pattern):
        getattr(design, method)(q, k, v, **kwargs)


def test_chunk_rejects_bad_chunk_size():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"chunk_size must be a positive integer"):
        GATED_DELTANET.chunk(q, k, v, gain=gain(), alpha=scalar_alpha(), chunk_size=0)


STEP_CASES = [
    ("no-state", GATED_DELTANET, dict(gain=torch.full((B, H), 0.5), alpha=torch.full((B, H), 0.9), state=None),
     ValueError, r"state is required for step\(\)"),
    ("wrong-dynamics", GATED_DELTANET, dict(gain=torch.full((B, H), 0.5), alpha=torch.full((B, H, D), 0.9)),
     ValueError, r"'gated_deltanet' has scalar dynamics"),
    ("alpha-float", GATED_DELTANET, dict(gain=torch.full((B, H), 0.5), alpha=0.9), TypeError,
     r"alpha must be a torch.Tensor or None, got float"),
    ("reset-ell2", DELTANET, dict(gain=torch.full((B, H), 0.5), ell2=torch.full((B, H), 0.1)), ValueError,
     r"do not pass ell2"),
    ("bayes-r2-with-time-axis", BAYESIAN, dict(r2=torch.ones(B, 1, H), ell2=torch.full((B, H), 0.1)), ValueError,
     r"r2 must have shape \[B, H\]"),
    ("bayes-state-groups", BAYESIAN, dict(r2=torch.ones(B, H, 3), ell2=torch.full((B, H), 0.1)), ValueError,
     r"state\[1\] \(P\) must be \[B, H, G, D, D\]"),
]


@pytest.mark.parametrize("case", STEP_CASES, ids=lambda c: c[0])
def test_design_step_rejects(case):
    _, design, kwargs, exc, pattern = case
    kwargs = dict(kwargs)
    state = kwargs.pop("state", design.initial_state(B, H, D, m))
    with pytest.raises(exc, match=pattern):
        design.step(torch.randn(B, H, D), torch.randn(B, H, D), torch.randn(B, H, m), state=state, **kwargs)


@pytest.mark.parametrize(
    "kwargs, exc, pattern",
    [
        (dict(batch_size=0), ValueError, r"batch_size must be a positive integer"),
        (dict(value_dim=6, groups=4), ValueError, r"value_dim=6 is not divisible by groups=4"),
        (dict(p0=-1.0), ValueError, r"p0 must be a finite number > 0"),
        (dict(dtype=torch.int32), TypeError, r"dtype must be a floating-point torch.dtype"),
    ],
)
@pytest.mark.parametrize("design", [BAYESIAN, GLA], ids=lambda d: d.name)
def test_design_initial_state_rejects(design, kwargs, exc, pattern):
    args = dict(batch_size=1, num_heads=2, key_dim=4, value_dim=6)
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        design.initial_state(args.pop("batch_size"), args.pop("num_heads"), args.pop("key_dim"),
                             args.pop("value_dim"), **args)


@pytest.mark.parametrize(
    "name, exc, pattern",
    [
        ("mamba3", ValueError, r"unknown design 'mamba3'; known: \[.*'bayesian'.*\] or fixed_prior_<c>"),
        ("fixed_prior_", ValueError, r"unknown design 'fixed_prior_'"),
        ("fixed_prior_abc", ValueError, r"unknown design 'fixed_prior_abc'"),
        ("fixed_prior_-1", ValueError, r"unknown design 'fixed_prior_-1'"),
        ("fixed_prior_0", ValueError, r"unknown design 'fixed_prior_0'"),
        ("fixed_prior_inf", ValueError, r"unknown design 'fixed_prior_inf'"),
        ("fixed_prior_nan", ValueError, r"unknown design 'fixed_prior_nan'"),
        (3, TypeError, r"design name must be a str, got int"),
        (None, TypeError, r"design name must be a str, got NoneType"),
    ],
)
def test_get_design_rejects(name, exc, pattern):
    with pytest.raises(exc, match=pattern):
        get_design(name)


@pytest.mark.parametrize("c", [0, -0.5, math.inf, math.nan, True, "0.5", None])
def test_fixed_prior_rejects(c):
    with pytest.raises(ValueError, match=r"fixed prior variance c must be a finite positive number"):
        fixed_prior(c)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(name="x", write="kalman"),
             r"write must be one of \('bayes', 'diagonal', 'reset', 'latent', 'lowrank'\), got 'kalman'"),
        (dict(name="x", write="reset", dynamics="complex"), r"dynamics must be one of .*got 'complex'"),
        (dict(name="x", write="bayes", fixed_lam=1.0), r"fixed_lam needs write='reset' and a positive value"),
        (dict(name="x", write="reset", fixed_lam=-1.0), r"fixed_lam needs write='reset' and a positive value"),
    ],
)
def test_design_model_construction_rejects(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        DesignModel(**kwargs)
