"""Float32 accuracy at wide priors and over long decoding, and the range checks that keep a filter stable.

Tolerance: every float32 result here is within ``TOL = 1e-5`` (max relative error over all tokens,
heads and batch entries, against the same float32 values run in float64) and the state's ``P``
passes a Cholesky at every decoded token.  Before the covariance was carried in float64, ``p0 =
1e8`` gave errors above 100% and negative variances (``benchmarks/numerics.py`` prints the table).
The precision is static: the covariance runs in float64 whatever the data, the state's ``P`` keeps its
dtype, and a float32 state asked to hold a wide prior warns (``PrecisionWarning``) instead of being
promoted.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bayeslayer.design import GATED_DELTANET, KDA, LONGHORN, MAMBA2
from bayeslayer.errors import PrecisionWarning
from bayeslayer.ops import bl_chunk, bl_recurrent, bl_step, initial_bl_state, value_checks

TOL = 1e-5
F64 = torch.float64
ARGS = ("q", "k", "v", "r2", "ell2", "alpha")


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Max error relative to the largest reference value (outputs)."""
    return float((a.double() - ref).abs().max() / ref.abs().max())


def rel_each(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Max elementwise relative error (variances, all ≥ 1)."""
    return float(((a.double() - ref).abs() / ref.abs()).max())


def inputs(T: int, *, regime: str = "wide", B: int = 1, H: int = 2, D: int = 8, m: int = 4, seed: int = 0):
    """float32 values held in float64.  ``wide``: unit keys, r² ∈ [0.1, 1.1]; ``ill``: keys in a 2-dim
    subspace, r² ≈ 1e-3, ℓ² ≈ 1e-6, α ≈ 0.9995 (the covariance grows ill-conditioned as it decodes)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=g, dtype=F64)

    q = torch.randn(B, T, H, D, generator=g, dtype=F64)
    v = torch.randn(B, T, H, m, generator=g, dtype=F64)
    if regime == "wide":
        k = torch.randn(B, T, H, D, generator=g, dtype=F64)
        r2, ell2, alpha = 0.1 + rand(B, T, H), 0.01 + 0.1 * rand(B, T, H), 0.9 + 0.1 * rand(B, T, H)
    elif regime == "benign":
        k = torch.randn(B, T, H, D, generator=g, dtype=F64)
        r2, ell2, alpha = 0.1 + rand(B, T, H), 1e-3 * (0.1 + rand(B, T, H)), 0.999 + 0.001 * rand(B, T, H)
    else:
        basis = torch.linalg.qr(torch.randn(D, 2, generator=g, dtype=F64))[0]
        k = torch.randn(B, T, H, 2, generator=g, dtype=F64) @ basis.T
        r2, ell2 = 1e-3 * (0.5 + rand(B, T, H)), 1e-6 * (0.5 + rand(B, T, H))
        alpha = 0.9995 + 0.0005 * rand(B, T, H)
    x = dict(q=q, k=F.normalize(k, dim=-1), v=v, r2=r2, ell2=ell2, alpha=alpha)
    return {name: t.float().double() for name, t in x.items()}


def assert_psd(P: torch.Tensor, where: str) -> None:
    P = P.double()
    scale = float(P.abs().max())
    eye = torch.eye(P.shape[-1], dtype=F64)
    assert bool((torch.linalg.cholesky_ex(P + 1e-12 * scale * eye).info == 0).all()), f"P not PSD at {where}"


def decode(x: dict, *, p0: float = 1.0, state_dtype=torch.float32):
    """bl_step over every token in float32, checking P at every token."""
    B, T, H, D = x["q"].shape
    c = {name: t.float() for name, t in x.items()}
    state = initial_bl_state(B, H, D, x["v"].shape[-1], p0=p0, dtype=state_dtype)
    outs, variances = [], []
    for t in range(T):
        o, var, state = bl_step(*(c[a][:, t] for a in ARGS), state=state, return_variance=True)
        assert_psd(state[1], f"token {t}")
        outs.append(o)
        variances.append(var)
    return torch.stack(outs, 1), torch.stack(variances, 1), state


@pytest.mark.parametrize("p0", [1e4, 1e6, 1e8])
def test_recurrent_wide_prior_float32_matches_float64(p0):
    x = inputs(40, regime="wide")
    ref_o, ref_var, _ = bl_recurrent(*(x[a] for a in ARGS), p0=p0, return_variance=True)
    with pytest.warns(PrecisionWarning, match=r"float64 state"):
        o, var, (_, P) = bl_recurrent(*(x[a].float() for a in ARGS), p0=p0, return_variance=True,
                                      output_final_state=True)
    assert o.dtype == torch.float32 and var.dtype == torch.float32
    assert rel(o, ref_o) <= TOL and rel_each(var, ref_var) <= TOL
    assert float(var.min()) >= 1.0
    assert P.dtype == torch.float32  # the state keeps its dtype: the warning said what to pass instead
    _, _, (_, P) = bl_recurrent(*(x[a].float() for a in ARGS), return_variance=True, output_final_state=True,
                                initial_state=initial_bl_state(1, 2, 8, 4, p0=p0, dtype=F64))
    assert P.dtype == F64
    assert_psd(P, "the end")


@pytest.mark.parametrize("p0", [1e7, 1e8])
def test_chunk_wide_prior_float32_matches_float64(p0):
    x = inputs(40, regime="wide")
    ref_o, ref_var, (_, ref_P) = bl_recurrent(*(x[a] for a in ARGS), p0=p0, return_variance=True,
                                              output_final_state=True)
    with pytest.warns(PrecisionWarning, match=r"the initial state \(or p0·I\)'s P is torch.float32"):
        o, var, (_, P) = bl_chunk(*(x[a].float() for a in ARGS), p0=p0, return_variance=True,
                                  output_final_state=True, chunk_size=16)
    assert o.dtype == torch.float32 and P.dtype == torch.float32
    assert rel(o, ref_o) <= TOL and rel_each(var, ref_var) <= TOL
    # from a float64 state: no warning, the covariance is returned in float64 and matches the oracle's
    with value_checks(True), warnings_as_errors():
        o, var, (_, P) = bl_chunk(*(x[a].float() for a in ARGS), return_variance=True, output_final_state=True,
                                  chunk_size=16, initial_state=initial_bl_state(1, 2, 8, 4, p0=p0, dtype=F64))
    assert P.dtype == F64 and rel(o, ref_o) <= TOL and rel_each(var, ref_var) <= TOL
    assert rel(P, ref_P) <= TOL
    assert_psd(P, "the end")


def warnings_as_errors():
    import warnings

    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("error", PrecisionWarning)

    class _Exit:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            ctx.__exit__(*exc)
            return False

    return _Exit()


def test_chunk_refuses_a_prior_beyond_float64_with_a_clear_error():
    # one key written 16 times: S = p0·11ᵀ + diag(r²) has pivots ≈ r², below float64's rounding of p0 = 1e18
    x = inputs(16, regime="wide", H=1)
    k = x["k"][:, :1].expand_as(x["k"]).contiguous()
    with pytest.raises(ValueError, match=r"p0.*1e\+18.*float64"):
        bl_chunk(x["q"], k, *(x[a] for a in ("v", "r2", "ell2", "alpha")), p0=1e18, chunk_size=16)


def ill_chunk_inputs(keys: str, T: int = 256, H: int = 2, D: int = 16, seed: int = 0):
    """Unit keys spread 1e-3 around one direction per head (``collinear``) or in a 2-dim ``subspace``;
    r² ≈ 1e-3, ℓ² ≈ 1e-6, α ≈ 0.9995: float32 values held in float64 (``benchmarks/numerics.py --ill``)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=g, dtype=F64)

    q, v = torch.randn(1, T, H, D, generator=g, dtype=F64), torch.randn(1, T, H, D, generator=g, dtype=F64)
    if keys == "collinear":
        k = torch.randn(H, D, generator=g, dtype=F64) + 1e-3 * torch.randn(1, T, H, D, generator=g, dtype=F64)
    else:
        k = torch.randn(1, T, H, 2, generator=g, dtype=F64) @ torch.linalg.qr(torch.randn(D, 2, generator=g,
                                                                                         dtype=F64))[0].T
    x = dict(q=q, k=F.normalize(k, dim=-1), v=v, r2=1e-3 * (0.5 + rand(1, T, H)), ell2=1e-6 * (0.5 + rand(1, T, H)),
             alpha=0.9995 + 0.0005 * rand(1, T, H))
    return {name: t.float().double() for name, t in x.items()}


@pytest.mark.parametrize("keys, p0", [("collinear", 1.0), ("subspace", 1.0), ("subspace", 1e8)])
@pytest.mark.filterwarnings("ignore::bayeslayer.errors.PrecisionWarning")
def test_chunk_ill_conditioned_float32_within_10x_of_the_recurrent_path(keys, p0):
    """Before the covariance pass ran in float64 the chunk path erred 4.8e-4 (collinear) and 7.3e-4 (subspace)
    here, the recurrent path 6.6e-7 and 2.2e-7."""
    x = ill_chunk_inputs(keys)
    ref, _ = bl_recurrent(*(x[a] for a in ARGS), p0=p0)
    o_rec, _ = bl_recurrent(*(x[a].float() for a in ARGS), p0=p0)
    o, (_, P) = bl_chunk(*(x[a].float() for a in ARGS), p0=p0, output_final_state=True)
    assert o.dtype == torch.float32
    assert rel(o, ref) <= 10 * rel(o_rec, ref), (rel(o, ref), rel(o_rec, ref))
    assert P.dtype == torch.float32  # the state's dtype is the input's: the rule reads no data


def test_chunk_precision_is_static_and_reads_no_value(monkeypatch):
    """The PyTorch chunk path's covariance pass runs in float64 for float32 inputs whatever their values,
    and with value checks off a forward and backward read no tensor value on the host (no ``.item()``,
    ``bool()``, ``.tolist()``), so a compiled graph has nothing to break on."""
    from bayeslayer.ops.bayesian_layer import chunk as chunk_module

    seen = []
    original = chunk_module.covariance_pass
    monkeypatch.setattr(chunk_module, "covariance_pass", lambda *a: seen.append(a[-1].dtype) or original(*a))
    x = ill_chunk_inputs("collinear", T=80)
    leaves = {a: x[a].float().requires_grad_() for a in ARGS}

    def refuse(*_a, **_k):
        raise AssertionError("a tensor value was read on the host")

    with value_checks(False), monkeypatch.context() as host:
        for name in ("item", "__bool__", "tolist"):
            host.setattr(torch.Tensor, name, refuse)
        o, var, _ = bl_chunk(*(leaves[a] for a in ARGS), p0=1e8, return_variance=True, output_final_state=True,
                             chunk_size=16)
        (o.sum() + var.sum()).backward()
    assert seen and set(seen) == {F64}
    assert all(bool(torch.isfinite(leaves[a].grad).all()) for a in ARGS)


def test_step_wide_prior_decodes_like_float64():
    x = inputs(24, regime="wide")
    ref_o, ref_var, _ = bl_recurrent(*(x[a] for a in ARGS), p0=1e8, return_variance=True)
    o, var, state = decode(x, p0=1e8, state_dtype=F64)
    assert rel(o, ref_o) <= TOL and rel_each(var, ref_var) <= TOL
    assert state[1].dtype == F64
    # a float32 state cannot hold p0 = 1e8 next to r² ≈ 1: the step says what to pass instead of promoting
    state = initial_bl_state(1, 2, 8, 4, p0=1e8)
    with pytest.warns(PrecisionWarning, match=r"state's P is torch.float32.*dtype=torch.float64"):
        _, state = bl_step(*(x[a][:, 0].float() for a in ARGS), state=state)
    assert state[1].dtype == torch.float32


@pytest.mark.parametrize("T", [200, pytest.param(1500, marks=pytest.mark.slow)])
def test_step_long_decode_ill_conditioned_float64_state(T):
    """Fast variant of the 100k-token test: by 1500 tokens a float32 P drifts (1e-3 before); the default run
    decodes 200 tokens one at a time, the 1500 are ``slow``."""
    x = inputs(T, regime="ill")
    ref_o, ref_var, _ = bl_recurrent(*(x[a] for a in ARGS), return_variance=True)
    o, var, _ = decode(x, state_dtype=F64)
    assert rel(o, ref_o) <= TOL and rel_each(var, ref_var) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("regime, state_dtype", [("benign", torch.float32), ("ill", F64)])
def test_step_decodes_100k_tokens(regime, state_dtype):
    x = inputs(100_000, regime=regime, B=1, H=1, D=8, m=4)
    ref_o, ref_var, _ = bl_recurrent(*(x[a] for a in ARGS), return_variance=True)
    o, var, _ = decode(x, state_dtype=state_dtype)
    assert rel(o, ref_o) <= TOL and rel_each(var, ref_var) <= TOL


def test_step_refuses_an_indefinite_state():
    B, H, D, m = 1, 1, 2, 2
    M, _ = initial_bl_state(B, H, D, m)
    P = torch.tensor([[1.0, 2.0], [2.0, 1.0]]).expand(B, H, D, D)  # positive diagonal, eigenvalue −1
    q = k = torch.ones(B, H, D)
    with pytest.raises(ValueError, match=r"state\[1\] \(P\) must be positive semi-definite"):
        bl_step(q, k, torch.ones(B, H, m), 0.5, 0.1, state=(M, P))


def unit_keys(B=1, T=32, H=2, D=8, m=4):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, T, H, D, generator=g)
    return q, F.normalize(torch.randn(B, T, H, D, generator=g), dim=-1), torch.randn(B, T, H, m, generator=g)


@pytest.mark.parametrize("path", ["chunk", "recurrent"])
def test_reset_gain_that_would_expand_the_memory_is_refused(path):
    q, k, v = unit_keys()
    alpha = torch.full(q.shape[:3], 0.99)
    with pytest.raises(ValueError, match=r"gain.*gain·‖k‖² ≤ 2.*got max gain·‖k‖² = 10"):
        getattr(GATED_DELTANET, path)(q, k, v, gain=torch.full(q.shape[:3], 10.0), alpha=alpha)
    # the rule is on gain·‖k‖²: a gain of 0.5 on keys of norm 3 expands too
    with pytest.raises(ValueError, match="gain"):
        getattr(KDA, path)(q, 3 * k, v, gain=0.5, alpha=alpha[..., None].expand_as(q).contiguous())


def test_reset_gain_range_edges():
    q, k, v = unit_keys()
    alpha = torch.full(q.shape[:3], 0.99)
    out = GATED_DELTANET.chunk(q, k, v, gain=torch.full(q.shape[:3], 2.0), alpha=alpha)  # allow_neg_eigval's edge
    assert bool(torch.isfinite(out.o).all())
    B, T, H, D = q.shape
    with pytest.raises(ValueError, match="gain"):  # per value column (Longhorn): each column's gain is checked
        LONGHORN.chunk(q, k, v, gain=torch.full((B, T, H, v.shape[-1]), 2.5))
    with pytest.raises(ValueError, match="gain"):  # the decoding step too
        GATED_DELTANET.step(q[:, 0], k[:, 0], v[:, 0], state=GATED_DELTANET.initial_state(B, H, D, 4)[0],
                            gain=torch.full((B, H), 3.0), alpha=alpha[:, 0])
    # the latent family's write is additive: a step size above 1 (Mamba-2's Δ) is legitimate
    out = MAMBA2.chunk(q, k, v, gain=torch.full(q.shape[:3], 10.0), alpha=alpha)
    assert bool(torch.isfinite(out.o).all())
