"""Every design model: chunked path equals the recurrent oracle, and ``step`` equals the oracle.

Covers each design in ``bayeslayer.design.DESIGNS`` plus the fixed-isotropic-prior ablation,
each with the dynamics it admits (all kinds for ``any``), each noise parametrisation it
accepts (reset/latent: ``lam`` with ``r2``, or the coefficient as ``gain``, grouped; Longhorn:
one noise per value column), with an initial state; float64, forward and gradients.
"""

from __future__ import annotations

import pytest
import torch

from bayeslayer.design import (
    BAYESIAN,
    DELTANET,
    DESIGNS,
    DIAGONAL_COVARIANCE,
    GATED_DELTANET,
    GLA,
    KDA,
    LINEAR_ATTENTION,
    LONGHORN,
    MAMBA2,
    RETNET,
    DesignModel,
    fixed_prior,
    get_design,
)
from bayeslayer.ops import filter_recurrent

from ..ops.inputs import dynamics_inputs, fixed_weights, random_psd

DT = torch.float64
B, T, H, D, m = 2, 45, 2, 6, 4
TOL = dict(atol=1e-9, rtol=1e-9)
ALL_DESIGNS = [*DESIGNS.values(), fixed_prior(0.5)]
_KIND_OF = {"identity": "identity", "scalar": "scalar", "diagonal": "diagonal", "rotation": "rotation_pairs"}


def _modes(design: DesignModel) -> list[str]:
    if design.has_covariance:
        return ["G1", "G2"]
    if design.fixed_lam is not None:
        return ["r2"]
    if design.per_column:
        return ["lam_columns", "gain_columns"]
    return ["lam", "gain_G2"]


def _kinds(design: DesignModel) -> list[str]:
    if design.dynamics == "any":
        return ["identity", "scalar", "diagonal", "rotation_pairs"]
    return [_KIND_OF[design.dynamics]]


CASES = [(d, kind, mode) for d in ALL_DESIGNS for kind in _kinds(d) for mode in _modes(d)]


def _case_id(case):
    d, kind, mode = case
    return f"{d.name}-{kind}-{mode}"


def design_inputs(design: DesignModel, kind: str, mode: str, *, T: int = T) -> tuple[dict, dict]:
    """(tensors, options) for ``design.recurrent/chunk``: tensors are the differentiable inputs."""
    x = dict(
        q=torch.randn(B, T, H, D, dtype=DT),
        k=torch.randn(B, T, H, D, dtype=DT) / D**0.5,
        v=torch.randn(B, T, H, m, dtype=DT),
    )
    x["alpha"], x["theta"] = dynamics_inputs(kind, B, T, H, D, low=0.85)
    if design.has_covariance:
        G = 2 if mode == "G2" else 1
        x["r2"] = 0.1 + torch.rand(B, T, H, *((G,) if G > 1 else ()), dtype=DT)
        x["ell2"] = 0.01 + 0.1 * torch.rand(B, T, H, dtype=DT)
        # a dense P0 also for the diagonal-covariance design: both paths must use only its diagonal
        P0 = random_psd(B, H, *((G,) if G > 1 else ()), D=D)
        x["M0"], x["P0"] = torch.randn(B, H, D, m, dtype=DT), P0
    else:
        x["M0"] = torch.randn(B, H, D, m, dtype=DT)
        if mode == "r2":
            x["r2"] = 0.1 + torch.rand(B, T, H, dtype=DT)
        elif mode == "lam":
            x["r2"], x["lam"] = 0.1 + torch.rand(B, T, H, dtype=DT), 0.2 + torch.rand(B, T, H, dtype=DT)
        elif mode == "lam_columns":
            x["r2"], x["lam"] = 0.1 + torch.rand(B, T, H, m, dtype=DT), 0.2 + torch.rand(B, T, H, dtype=DT)
        # a reset gain must keep gain·‖k‖² ≤ 2 (the erase may not expand the memory): keep it ≤ 0.95
        unit = (x["k"] * x["k"]).sum(-1, keepdim=True).clamp_min(1.0)
        if mode == "gain_G2":
            x["gain"] = (0.05 + 0.9 * torch.rand(B, T, H, 2, dtype=DT)) / unit
        elif mode == "gain_columns":
            x["gain"] = (0.05 + 0.9 * torch.rand(B, T, H, m, dtype=DT)) / unit
    return {k: v for k, v in x.items() if v is not None}, {}


def _run(design, fn_name, x, **kw):
    fn = getattr(design, fn_name)
    state = (x["M0"], x.get("P0"))
    noise = {k: x[k] for k in ("r2", "ell2", "lam", "gain", "alpha", "theta") if k in x}
    return fn(x["q"], x["k"], x["v"], initial_state=state, output_final_state=True, **noise, **kw)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_design_chunk_matches_recurrent(case):
    design, kind, mode = case
    x, _ = design_inputs(design, kind, mode)
    leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
    results = {}
    for fn_name, kw in (("recurrent", {}), ("chunk", dict(chunk_size=16, return_variance=True))):
        out = _run(design, fn_name, leaves, **kw)
        tensors = [out.o, out.gain, out.state[0]]
        if out.variance is not None:
            tensors.append(out.variance)
        if out.state[1] is not None:
            tensors.append(out.state[1])
        loss = sum((w * t).sum() for w, t in zip(fixed_weights(tensors), tensors, strict=True))
        grads = torch.autograd.grad(loss, list(leaves.values()))
        results[fn_name] = (out, dict(zip(leaves, grads, strict=True)))
    (rec, g_rec), (chk, g_chk) = results["recurrent"], results["chunk"]

    torch.testing.assert_close(chk.o, rec.o, **TOL)
    torch.testing.assert_close(chk.gain, rec.gain, **TOL)
    torch.testing.assert_close(chk.state[0], rec.state[0], **TOL)
    assert (chk.variance is None) == (rec.variance is None)
    if rec.variance is not None:
        torch.testing.assert_close(chk.variance, rec.variance, **TOL)
    assert (chk.state[1] is None) == (not design.has_covariance) == (rec.state[1] is None)
    if design.has_covariance:
        torch.testing.assert_close(chk.state[1], rec.state[1], **TOL)
    for name in leaves:
        a, b = g_chk[name], g_rec[name]
        if name == "P0":  # compare on the symmetric matrices (see tests/ops/test_chunk_vs_recurrent.py)
            a, b = 0.5 * (a + a.transpose(-1, -2)), 0.5 * (b + b.transpose(-1, -2))
        assert bool(b.abs().max() > 0), f"gradient of {name} is identically zero"
        torch.testing.assert_close(a, b, **TOL, msg=lambda s, n=name: f"grad {n}: {s}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_design_step_matches_recurrent(case):
    design, kind, mode = case
    x, _ = design_inputs(design, kind, mode, T=7)
    rec = _run(design, "recurrent", x)
    state = (x["M0"], x.get("P0"))
    per_token = ("q", "k", "v", "r2", "ell2", "lam", "gain", "alpha", "theta")
    outs, gains, variances = [], [], []
    for t in range(7):
        args = {k: x[k][:, t] for k in per_token if k in x}
        out = design.step(args.pop("q"), args.pop("k"), args.pop("v"), state=state, **args)
        state = out.state
        outs.append(out.o)
        gains.append(out.gain)
        variances.append(out.variance)
    torch.testing.assert_close(torch.stack(outs, 1), rec.o, **TOL)
    torch.testing.assert_close(torch.stack(gains, 1), rec.gain, **TOL)
    if rec.variance is not None:
        torch.testing.assert_close(torch.stack(variances, 1), rec.variance, **TOL)
    torch.testing.assert_close(state[0], rec.state[0], **TOL)
    if design.has_covariance:
        torch.testing.assert_close(state[1], rec.state[1], **TOL)


@pytest.mark.parametrize("design", [DELTANET, LINEAR_ATTENTION], ids=lambda d: d.name)
def test_lam_and_gain_parametrisations_agree(design):
    """``lam`` with ``r2`` is the same filter as its coefficient passed as ``gain``:
    reset ``η = λ/(r² + λ‖k‖²)``, latent ``ω = λ/(λ + r²)`` (docs/theory.md §3)."""
    x, _ = design_inputs(design, "identity", "lam")
    lam, r2, k = x["lam"], x["r2"], x["k"]
    coef = lam / (r2 + lam * (k * k).sum(-1)) if design.write == "reset" else lam / (lam + r2)
    state = (x["M0"], None)
    a = design.chunk(x["q"], k, x["v"], lam=lam, r2=r2, initial_state=state, output_final_state=True)
    b = design.chunk(x["q"], k, x["v"], gain=coef, initial_state=state, output_final_state=True)
    torch.testing.assert_close(a.o, b.o, **TOL)
    torch.testing.assert_close(a.state[0], b.state[0], **TOL)


def test_fixed_prior_is_a_reset_with_constant_lam():
    x, _ = design_inputs(fixed_prior(0.5), "diagonal", "r2")
    ablation = fixed_prior(0.5).recurrent(x["q"], x["k"], x["v"], r2=x["r2"], alpha=x["alpha"])
    reset = filter_recurrent(x["q"], x["k"], x["v"], write="reset", lam=0.5, r2=x["r2"], alpha=x["alpha"])
    torch.testing.assert_close(ablation.o, reset.o, **TOL)
    torch.testing.assert_close(ablation.variance, reset.variance, **TOL)


def test_registry_and_structure():
    expected = {
        "bayesian": ("bayes", "any"), "diagonal_covariance": ("diagonal", "any"),
        "deltanet": ("reset", "identity"), "gated_deltanet": ("reset", "scalar"),
        "kda": ("reset", "diagonal"),
        "longhorn": ("reset", "identity"), "linear_attention": ("latent", "identity"),
        "retnet": ("latent", "scalar"), "gla": ("latent", "diagonal"), "mamba2": ("latent", "scalar"),
    }
    assert {name: (d.write, d.dynamics) for name, d in DESIGNS.items()} == expected
    for name, d in DESIGNS.items():
        assert get_design(name) is d
    assert LONGHORN.per_column and not DELTANET.per_column
    fp = get_design("fixed_prior_0.05")
    assert fp.write == "reset" and fp.fixed_lam == 0.05 and fp.dynamics == "any"
    assert [d.has_covariance for d in (BAYESIAN, DIAGONAL_COVARIANCE, GATED_DELTANET, GLA)] == [
        True, True, False, False]
    assert BAYESIAN.state_size(16, 8, groups=2) == 16 * 8 + 2 * 16 * 16
    assert DIAGONAL_COVARIANCE.state_size(16, 8) == 16 * 8 + 16
    assert KDA.state_size(16, 8) == RETNET.state_size(16, 8) == MAMBA2.state_size(16, 8) == 16 * 8


@pytest.mark.parametrize("design", [BAYESIAN, DIAGONAL_COVARIANCE, GATED_DELTANET, GLA], ids=lambda d: d.name)
def test_initial_state_layout(design):
    M, P = design.initial_state(2, 3, 4, 6, p0=2.0, groups=2, dtype=DT)
    assert M.shape == (2, 3, 4, 6) and M.dtype == DT and bool((M == 0).all())
    if design.has_covariance:
        torch.testing.assert_close(P, 2.0 * torch.eye(4, dtype=DT).expand(2, 3, 2, 4, 4))
    else:
        assert P is None
