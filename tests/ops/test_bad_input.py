"""Bad input gets a clear error, never a silent wrong answer.

Each case asserts the exception type and that the message names the offending argument (and,
for shape errors, the shape that was seen).  Mismatched shapes, non-positive r2/ell2/p0, alpha
outside (0, 1], odd D with rotations, m % G != 0, non-finite values, tensors on different
devices (the ``meta`` device stands in for a GPU), integer dtypes; for ``bl_recurrent``,
``bl_chunk``, ``bl_step``, ``initial_bl_state`` and the general ``filter_*`` entry points.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from bayeslayer.ops import (
    bl_chunk,
    bl_recurrent,
    bl_step,
    filter_chunk,
    filter_recurrent,
    initial_bl_state,
    value_checks,
)

from .inputs import random_psd

B, T, H, D, m = 2, 5, 3, 4, 6
SEQUENCE_OPS = [bl_recurrent, bl_chunk]


def good(**over):
    """Valid float32 arguments for a sequence op, with some replaced."""
    kw = dict(
        q=torch.randn(B, T, H, D),
        k=torch.randn(B, T, H, D) / 2,
        v=torch.randn(B, T, H, m),
        r2=torch.full((B, T, H), 0.5),
        ell2=torch.full((B, T, H), 0.1),
    )
    kw.update(over)
    return kw


def state(G: int = 1, **over):
    P = random_psd(B, H, *((G,) if G > 1 else ()), D=D, dtype=torch.float32)
    M, P = over.get("M", torch.zeros(B, H, D, m)), over.get("P", P)
    return (M, P)


def _on_meta(x):
    return x.to("meta")


def _nan_at_end(x):
    x = x.clone()
    x.view(-1)[-1] = float("nan")
    return x


def _inf_at_start(x):
    x = x.clone()
    x.view(-1)[0] = float("inf")
    return x


# (id, keyword overrides, exception type, regex the message must match)
SHAPE_CASES = [
    ("k-shape", dict(k=torch.randn(B, T, H, D + 1)), ValueError, r"k must have the shape of q.*\(2, 5, 3, 5\)"),
    ("v-lead", dict(v=torch.randn(B, T + 1, H, m)), ValueError, r"v must be .*\(2, 6, 3, 6\)"),
    ("q-3d", dict(q=torch.randn(T, H, D)), ValueError, r"q must be \[B, T, H, D\].*\(5, 3, 4\)"),
    ("r2-T", dict(r2=torch.ones(B, T - 1, H)), ValueError, r"r2 must have shape .*\(2, 4, 3\)"),
    ("r2-5d", dict(r2=torch.ones(B, T, H, 2, 1)), ValueError, r"r2 must have shape"),
    ("ell2-grouped", dict(ell2=torch.ones(B, T, H, 2)), ValueError, r"ell2 must have shape .*\(2, 5, 3, 2\)"),
    ("alpha-D", dict(alpha=torch.ones(B, T, H, D - 1)), ValueError, r"alpha must have shape .*\(2, 5, 3, 3\)"),
    ("alpha-0d", dict(alpha=torch.tensor(0.9)), ValueError, r"alpha must have shape"),
    ("alpha-D-with-theta", dict(alpha=torch.ones(B, T, H, D), theta=torch.zeros(B, T, H, D // 2)), ValueError,
     r"alpha must have shape .*D/2"),
    ("theta-shape", dict(theta=torch.zeros(B, T, H, D)), ValueError, r"theta must have shape .*\(2, 5, 3, 4\)"),
    ("M-shape", dict(initial_state=(torch.zeros(B, H, D, m + 1), torch.eye(D).expand(B, H, D, D))), ValueError,
     r"initial_state\[0\] \(M\).*\(2, 3, 4, 7\)"),
    ("P-shape", dict(initial_state=(torch.zeros(B, H, D, m), torch.eye(D + 1).expand(B, H, D + 1, D + 1))),
     ValueError, r"initial_state\[1\] \(P\).*\(2, 3, 5, 5\)"),
    ("P-groups", dict(r2=torch.ones(B, T, H, 2), initial_state=state(G=1)), ValueError,
     r"initial_state\[1\] \(P\) must be \[B, H, G, D, D\]"),
    ("P-missing", dict(initial_state=(torch.zeros(B, H, D, m), None)), ValueError, r"initial_state\[1\] \(P\)"),
    ("state-one-tensor", dict(initial_state=torch.zeros(B, H, D, m)), TypeError, r"initial_state must be a tuple"),
    ("state-triple", dict(initial_state=(1, 2, 3)), TypeError, r"initial_state must be a tuple"),
    ("p0-shape", dict(p0=torch.ones(H + 1)), ValueError, r"p0 must be .*\(4,\)"),
]

VALUE_CASES = [
    ("r2-zero", dict(r2=torch.zeros(B, T, H)), ValueError, r"r2 must be > 0"),
    ("r2-negative", dict(r2=-torch.ones(B, T, H)), ValueError, r"r2 must be > 0"),
    ("r2-number-zero", dict(r2=0.0), ValueError, r"r2 must be finite and > 0"),
    ("r2-number-nan", dict(r2=math.nan), ValueError, r"r2 must be finite and > 0"),
    ("r2-number-inf", dict(r2=math.inf), ValueError, r"r2 must be finite and > 0"),
    ("ell2-zero", dict(ell2=torch.zeros(B, T, H)), ValueError, r"ell2 must be > 0"),
    ("ell2-number-negative", dict(ell2=-0.1), ValueError, r"ell2 must be finite and > 0"),
    ("p0-zero", dict(p0=0.0), ValueError, r"p0 must be finite and > 0"),
    ("p0-negative", dict(p0=-1.0), ValueError, r"p0 must be finite and > 0"),
    ("p0-nan", dict(p0=math.nan), ValueError, r"p0 must be finite and > 0"),
    ("p0-inf", dict(p0=math.inf), ValueError, r"p0 must be finite and > 0"),
    ("p0-tensor-zero", dict(p0=torch.tensor([1.0, 0.0, 1.0])), ValueError, r"p0 must be > 0"),
    ("p0-string", dict(p0="1.0"), TypeError, r"p0 must be a positive number"),
    ("p0-bool", dict(p0=True), TypeError, r"p0 must be a positive number"),
    ("alpha-zero", dict(alpha=torch.zeros(B, T, H)), ValueError, r"alpha must lie in \(0, 1\]"),
    ("alpha-above-one", dict(alpha=torch.full((B, T, H), 1.5)), ValueError, r"alpha must lie in \(0, 1\].*1\.5"),
    ("alpha-negative-diag", dict(alpha=-torch.rand(B, T, H, D)), ValueError, r"alpha must lie in \(0, 1\]"),
    ("alpha-rot-above-one", dict(alpha=torch.full((B, T, H, D // 2), 1.01), theta=torch.zeros(B, T, H, D // 2)),
     ValueError, r"alpha must lie in \(0, 1\]"),
    ("P-asymmetric", dict(initial_state=(torch.zeros(B, H, D, m), torch.randn(B, H, D, D))), ValueError,
     r"initial_state\[1\] \(P\) must be symmetric"),
    ("P-negative-diagonal", dict(initial_state=(torch.zeros(B, H, D, m), -torch.eye(D).expand(B, H, D, D))),
     ValueError, r"initial_state\[1\] \(P\) must be positive semi-definite"),
    ("P-indefinite", dict(initial_state=(torch.zeros(B, H, D, m), (2 * torch.ones(D, D) - torch.eye(D)).expand(
        B, H, D, D))), ValueError, r"initial_state\[1\] \(P\) must be positive semi-definite"),
]

GROUP_CASES = [
    ("m-not-divisible", dict(r2=torch.ones(B, T, H, 4)), ValueError, r"r2 has G=4 .*m=6"),
    ("G-zero", dict(r2=torch.ones(B, T, H, 0)), ValueError, r"r2"),
]


def _odd_D_with_theta():
    kw = good(q=torch.randn(B, T, H, 5), k=torch.randn(B, T, H, 5))
    kw["theta"] = torch.zeros(B, T, H, 2)
    return kw


DTYPE_CASES = [
    ("q-int", dict(q=torch.ones(B, T, H, D, dtype=torch.int64)), TypeError,
     r"q must be a floating-point tensor.*int64"),
    ("k-int", dict(k=torch.ones(B, T, H, D, dtype=torch.int32)), TypeError, r"k must be a floating-point tensor"),
    ("v-bool", dict(v=torch.ones(B, T, H, m, dtype=torch.bool)), TypeError, r"v must be a floating-point tensor"),
    ("r2-int", dict(r2=torch.ones(B, T, H, dtype=torch.int64)), TypeError, r"r2 must be a floating-point tensor"),
    ("ell2-int", dict(ell2=torch.ones(B, T, H, dtype=torch.int64)), TypeError, r"ell2 must be a floating-point"),
    ("alpha-int", dict(alpha=torch.ones(B, T, H, dtype=torch.int64)), TypeError, r"alpha must be a floating-point"),
    ("theta-int", dict(theta=torch.zeros(B, T, H, D // 2, dtype=torch.int64)), TypeError,
     r"theta must be a floating-point"),
    ("M-int", dict(initial_state=(torch.zeros(B, H, D, m, dtype=torch.int64), torch.eye(D).expand(B, H, D, D))),
     TypeError, r"initial_state\[0\] \(M\) must be a floating-point"),
    ("P-int", dict(initial_state=(torch.zeros(B, H, D, m), torch.eye(D, dtype=torch.int64).expand(B, H, D, D))),
     TypeError, r"initial_state\[1\] \(P\) must be a floating-point"),
    ("p0-int-tensor", dict(p0=torch.ones(H, dtype=torch.int64)), TypeError, r"p0 must be a floating-point"),
    ("q-complex", dict(q=torch.ones(B, T, H, D, dtype=torch.complex64)), TypeError, r"q must be a floating-point"),
    ("qk-dtype-mix", dict(k=torch.randn(B, T, H, D, dtype=torch.float64)), TypeError,
     r"q, k, v must share one dtype.*float32.*float64"),
    ("q-list", dict(q=[[0.0]]), TypeError, r"q must be a torch.Tensor"),
    ("r2-bool", dict(r2=True), TypeError, r"r2 must be a torch.Tensor"),
    ("alpha-float", dict(alpha=0.9), TypeError, r"alpha must be a torch.Tensor"),
    # every tensor on the meta device (shapes without values): refused by name, not at a Tensor.item()
    ("all-meta", {name: x.to("meta") for name, x in good().items()}, ValueError, r"q is a meta tensor"),
]


def _nonfinite_cases():
    cases = []
    for name in ("q", "k", "v", "r2", "ell2"):
        for spoil, tag in ((_nan_at_end, "nan"), (_inf_at_start, "inf")):
            cases.append((f"{name}-{tag}", name, spoil))
    return cases


def _call(fn, kw):
    return fn(**kw)


@pytest.mark.parametrize("fn", SEQUENCE_OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", SHAPE_CASES + VALUE_CASES + GROUP_CASES + DTYPE_CASES, ids=lambda c: c[0])
def test_sequence_ops_reject(fn, case):
    _, over, exc, pattern = case
    with pytest.raises(exc, match=pattern):
        _call(fn, good(**over))


@pytest.mark.parametrize("fn", SEQUENCE_OPS, ids=lambda f: f.__name__)
def test_odd_key_dim_with_rotations(fn):
    with pytest.raises(ValueError, match=r"theta \(rotations\) needs an even key dim D, got D=5"):
        fn(**_odd_D_with_theta())


@pytest.mark.parametrize("fn", SEQUENCE_OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", _nonfinite_cases(), ids=lambda c: c[0])
def test_non_finite_values(fn, case):
    _, name, spoil = case
    kw = good()
    kw[name] = spoil(kw[name])
    with pytest.raises(ValueError, match=rf"{name} contains NaN or Inf values \(shape "):
        fn(**kw)


@pytest.mark.parametrize("fn", SEQUENCE_OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("name", ["alpha", "theta", "M", "P", "p0"])
def test_non_finite_dynamics_state_and_prior(fn, name):
    kw = good()
    if name == "alpha":
        kw["alpha"] = _nan_at_end(torch.full((B, T, H), 0.9))
        pattern = r"alpha contains NaN or Inf"
    elif name == "theta":
        kw["theta"] = _inf_at_start(torch.zeros(B, T, H, D // 2))
        pattern = r"theta contains NaN or Inf"
    elif name == "M":
        kw["initial_state"] = state(M=_nan_at_end(torch.zeros(B, H, D, m)))
        pattern = r"initial_state\[0\] \(M\) contains NaN or Inf"
    elif name == "P":
        kw["initial_state"] = state(P=_inf_at_start(torch.eye(D).expand(B, H, D, D).clone()))
        pattern = r"initial_state\[1\] \(P\) contains NaN or Inf"
    else:
        kw["p0"] = torch.tensor([1.0, math.inf, 1.0])
        pattern = r"p0 contains NaN or Inf"
    with pytest.raises(ValueError, match=pattern):
        fn(**kw)


DEVICE_ARGS = {
    "k": lambda kw: kw.update(k=_on_meta(kw["k"])),
    "v": lambda kw: kw.update(v=_on_meta(kw["v"])),
    "r2": lambda kw: kw.update(r2=_on_meta(kw["r2"])),
    "ell2": lambda kw: kw.update(ell2=_on_meta(kw["ell2"])),
    "alpha": lambda kw: kw.update(alpha=torch.ones(B, T, H, device="meta")),
    "theta": lambda kw: kw.update(theta=torch.zeros(B, T, H, D // 2, device="meta")),
    "p0": lambda kw: kw.update(p0=torch.ones(H, device="meta")),
    "initial_state[0] (M)": lambda kw: kw.update(initial_state=state(M=torch.zeros(B, H, D, m, device="meta"))),
    "initial_state[1] (P)": lambda kw: kw.update(initial_state=state(P=torch.eye(D, device="meta").expand(B, H, D, D))),
}


@pytest.mark.parametrize("fn", SEQUENCE_OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("name", list(DEVICE_ARGS))
def test_tensors_on_different_devices(fn, name):
    kw = good()
    DEVICE_ARGS[name](kw)
    with pytest.raises(ValueError, match=re.escape(name) + r" is on meta but q is on cpu"):
        fn(**kw)


@pytest.mark.parametrize("chunk_size", [0, -3, 1.5, "64", None, True])
def test_bl_chunk_rejects_bad_chunk_size(chunk_size):
    with pytest.raises(ValueError, match=r"chunk_size must be a positive integer"):
        bl_chunk(**good(), chunk_size=chunk_size)


def test_value_checks_can_be_disabled_but_shape_checks_cannot():
    """``value_checks(False)`` skips the finite/range passes (a production opt-out); shapes stay checked."""
    with value_checks(False):
        o, _ = bl_chunk(**good(r2=torch.full((B, T, H), 0.5), alpha=torch.full((B, T, H), 0.9)))
        assert o.shape == (B, T, H, m)
        with pytest.raises(ValueError, match=r"r2 must have shape"):
            bl_chunk(**good(r2=torch.ones(B, T + 1, H)))
    with pytest.raises(ValueError, match=r"r2 must be > 0"):
        bl_chunk(**good(r2=torch.zeros(B, T, H)))


# -- bl_step ---------------------------------------------------------------------------------------
def step_args(**over):
    kw = dict(q=torch.randn(B, H, D), k=torch.randn(B, H, D) / 2, v=torch.randn(B, H, m),
              r2=torch.full((B, H), 0.5), ell2=torch.full((B, H), 0.1), state=initial_bl_state(B, H, D, m))
    kw.update(over)
    return kw


STEP_CASES = [
    ("no-state", dict(state=None), ValueError, r"state is required for bl_step"),
    ("q-with-time-axis", dict(q=torch.randn(B, 1, H, D)), ValueError, r"q must be \[B, H, D\].*\(2, 1, 3, 4\)"),
    ("k-shape", dict(k=torch.randn(B, H, D + 1)), ValueError, r"k must have the shape of q"),
    ("v-shape", dict(v=torch.randn(B, H + 1, m)), ValueError, r"v must be \[B, H, m\]"),
    ("r2-with-time-axis", dict(r2=torch.ones(B, 1, H)), ValueError, r"r2 must have shape \[B, H\].*\(2, 1, 3\)"),
    ("ell2-shape", dict(ell2=torch.ones(B)), ValueError, r"ell2 must have shape \[B, H\]"),
    ("r2-zero", dict(r2=torch.zeros(B, H)), ValueError, r"r2 must be > 0"),
    ("ell2-negative", dict(ell2=-torch.ones(B, H)), ValueError, r"ell2 must be > 0"),
    ("alpha-above-one", dict(alpha=torch.full((B, H), 2.0)), ValueError, r"alpha must lie in \(0, 1\]"),
    ("alpha-shape", dict(alpha=torch.ones(B, T, H)), ValueError, r"alpha must have shape \[B, H\]"),
    ("theta-shape", dict(theta=torch.zeros(B, H, D)), ValueError, r"theta must have shape \[B, H, D/2\]"),
    ("m-not-divisible", dict(r2=torch.ones(B, H, 4)), ValueError, r"r2 has G=4 .*m=6"),
    ("state-M-shape", dict(state=initial_bl_state(B, H, D + 1, m)), ValueError, r"state\[0\] \(M\)"),
    ("state-groups", dict(r2=torch.ones(B, H, 2)), ValueError, r"state\[1\] \(P\) must be \[B, H, G, D, D\]"),
    ("state-asymmetric", dict(state=(torch.zeros(B, H, D, m), torch.randn(B, H, D, D))), ValueError,
     r"state\[1\] \(P\) must be symmetric"),
    ("q-nan", dict(q=_nan_at_end(torch.randn(B, H, D))), ValueError, r"q contains NaN or Inf"),
    ("v-int", dict(v=torch.ones(B, H, m, dtype=torch.int64)), TypeError, r"v must be a floating-point tensor"),
    ("r2-meta", dict(r2=torch.ones(B, H, device="meta")), ValueError, r"r2 is on meta but q is on cpu"),
    ("state-meta", dict(state=initial_bl_state(B, H, D, m, device="meta")), ValueError,
     r"state\[0\] \(M\) is on meta"),
    ("all-meta", {name: (tuple(t.to("meta") for t in x) if name == "state" else x.to("meta"))
                  for name, x in step_args().items()}, ValueError, r"q is a meta tensor"),
]


@pytest.mark.parametrize("case", STEP_CASES, ids=lambda c: c[0])
def test_bl_step_rejects(case):
    _, over, exc, pattern = case
    with pytest.raises(exc, match=pattern):
        bl_step(**step_args(**over))


def test_bl_step_odd_key_dim_with_rotations():
    kw = step_args(q=torch.randn(B, H, 5), k=torch.randn(B, H, 5), state=initial_bl_state(B, H, 5, m),
                   theta=torch.zeros(B, H, 2))
    with pytest.raises(ValueError, match=r"theta \(rotations\) needs an even key dim D, got D=5"):
        bl_step(**kw)


# -- initial_bl_state ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, exc, pattern",
    [
        (dict(batch_size=0), ValueError, r"batch_size must be a positive integer, got 0"),
        (dict(num_heads=-1), ValueError, r"num_heads must be a positive integer"),
        (dict(key_dim=2.5), ValueError, r"key_dim must be a positive integer, got 2.5"),
        (dict(value_dim=True), ValueError, r"value_dim must be a positive integer, got True"),
        (dict(groups=0), ValueError, r"groups must be a positive integer"),
        (dict(value_dim=6, groups=4), ValueError, r"value_dim=6 is not divisible by groups=4"),
        (dict(p0=0.0), ValueError, r"p0 must be a finite number > 0"),
        (dict(p0=-2.0), ValueError, r"p0 must be a finite number > 0"),
        (dict(p0=math.inf), ValueError, r"p0 must be a finite number > 0, got inf"),
        (dict(p0=math.nan), ValueError, r"p0 must be a finite number > 0"),
        (dict(p0="1"), ValueError, r"p0 must be a finite number > 0"),
        (dict(dtype=torch.int64), TypeError, r"dtype must be a floating-point torch.dtype"),
    ],
    ids=lambda x: str(x) if not isinstance(x, dict) else "-".join(f"{k}={v}" for k, v in x.items()),
)
def test_initial_bl_state_rejects(kwargs, exc, pattern):
    args = dict(batch_size=1, num_heads=2, key_dim=4, value_dim=6)
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        initial_bl_state(args.pop("batch_size"), args.pop("num_heads"), args.pop("key_dim"), args.pop("value_dim"),
                         **args)


# -- the general entry points: which noise arguments a write model takes ---------------------------
@pytest.mark.parametrize("fn", [filter_recurrent, filter_chunk], ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(write="kalman", r2=0.5, ell2=0.1), r"write must be one of"),
        (dict(write="lowrank", r2=0.5, ell2=0.1), r"write='lowrank' needs its rank: pass .*LowRankWrite"),
        (dict(write="bayes", ell2=0.1), r"r2 \(observation noise variance\) is required"),
        (dict(write="bayes", r2=0.5), r"ell2 \(process noise variance\) is required"),
        (dict(write="diagonal", r2=0.5, ell2=0.1, lam=1.0), r"do not pass gain or lam"),
        (dict(write="bayes", r2=0.5, ell2=0.1, gain=0.5), r"do not pass gain or lam"),
        (dict(write="reset", r2=0.5), r"lam \(prior/write variance\) or gain is required"),
        (dict(write="reset", gain=0.5, lam=1.0), r"pass either gain or lam"),
        (dict(write="reset", gain=0.5, r2=0.5), r"pass either gain or r2"),
        (dict(write="latent", gain=0.5, ell2=0.1), r"has no process noise; do not pass ell2"),
        (dict(write="latent", lam=1.0), r"r2 \(observation noise variance\) is required"),
        (dict(write="reset", lam=0.0, r2=0.5), r"lam must be finite and > 0"),
        (dict(write="latent", gain=torch.zeros(B, T, H)), r"gain must be > 0"),
        (dict(write="latent", gain=torch.ones(B, T, H, 4)), r"gain has G=4 .*m=6"),
    ],
    ids=lambda x: x.get("write", "") + "-" + "-".join(sorted(set(x) - {"write"})) if isinstance(x, dict) else "",
)
def test_write_model_arguments(fn, kwargs, pattern):
    kw = good()
    for name in ("r2", "ell2"):
        kw.pop(name)
    with pytest.raises(ValueError, match=pattern):
        fn(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kwargs)
