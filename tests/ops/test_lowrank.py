"""Low-rank-plus-diagonal precision design (bayeslayer.ops.bayesian_layer.lowrank): limits, guarantees, paths,
errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bayeslayer.design import DIAGONAL_COVARIANCE, get_design, lowrank_diagonal
from bayeslayer.layers import BayesianLayer
from bayeslayer.ops import filter_recurrent
from bayeslayer.ops.bayesian_layer.lowrank import (
    initial_lowrank_state,
    lowrank_chunk,
    lowrank_covariance,
    lowrank_recurrent,
)

DT = torch.float64


def inputs(B=2, T=12, H=2, D=6, m=3, G=1, dynamics="scalar", seed=0, key_rank=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, dtype=DT, generator=g)
    k = torch.randn(B, T, H, D, dtype=DT, generator=g)
    if key_rank is not None:  # keys from a fixed key_rank-dim subspace per head
        basis = torch.linalg.qr(torch.randn(H, D, D, dtype=DT, generator=g))[0][..., :key_rank]
        k = torch.einsum("hdr,bthr->bthd", basis, torch.randn(B, T, H, key_rank, dtype=DT, generator=g))
    k = F.normalize(k, dim=-1)
    v = torch.randn(B, T, H, m, dtype=DT, generator=g)
    r2 = torch.rand(B, T, H, *((G,) if G > 1 else ()), dtype=DT, generator=g) + 0.1
    ell2 = torch.rand(B, T, H, dtype=DT, generator=g) * 0.2 + 0.01
    alpha = None
    if dynamics == "scalar":
        alpha = torch.rand(B, T, H, dtype=DT, generator=g) * 0.5 + 0.5
    elif dynamics == "diagonal":
        alpha = torch.rand(B, T, H, D, dtype=DT, generator=g) * 0.5 + 0.5
    return dict(q=q, k=k, v=v, r2=r2, ell2=ell2, alpha=alpha)


def dense(x, **kw):
    return filter_recurrent(x["q"], x["k"], x["v"], write="bayes", r2=x["r2"], ell2=x["ell2"], alpha=x["alpha"],
                            **kw)


def lowrank(x, rank, **kw):
    return lowrank_recurrent(x["q"], x["k"], x["v"], rank=rank, r2=x["r2"], ell2=x["ell2"], alpha=x["alpha"], **kw)


def close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# -- exactness limits --------------------------------------------------------------------------------------
@pytest.mark.parametrize("projection", ["conservative", "lofi"])
@pytest.mark.parametrize("dynamics,G", [("identity", 1), ("scalar", 2), ("diagonal", 1)])
def test_full_rank_is_dense_bl(projection, dynamics, G):
    x = inputs(dynamics=dynamics, G=G, m=4)
    want = dense(x, p0=2.0, output_final_state=True)
    got = lowrank(x, 6, p0=2.0, output_final_state=True, projection=projection)
    close(got.o, want.o)
    close(got.variance, want.variance)
    close(got.gain, want.gain)
    close(lowrank_covariance(got.state[1]), want.state[1])
    close(got.state[0], want.state[0])


@pytest.mark.parametrize("dynamics", ["identity", "scalar"])
def test_rank_at_least_the_key_span_is_dense_bl(dynamics):
    # isotropic υ (P_0 = p0 I, scalar dynamics, isotropic noise) keeps every u_t in the span of the keys:
    # the projection then drops only null directions
    x = inputs(D=8, T=20, dynamics=dynamics, key_rank=3)
    want = dense(x, p0=1.5, output_final_state=True)
    got = lowrank(x, 3, p0=1.5, output_final_state=True)
    close(got.o, want.o)
    close(got.variance, want.variance)
    close(lowrank_covariance(got.state[1]), want.state[1])
    # one column fewer than the span is an approximation
    assert (lowrank(x, 2, p0=1.5).o - want.o).abs().max() > 1e-4


def test_rank_zero_conservative_is_the_reset_with_the_propagated_prior():
    x = inputs(dynamics="scalar", T=15)
    p0 = 1.7
    a2 = x["alpha"] ** 2
    lam = torch.empty_like(x["ell2"])
    prev = torch.full_like(x["ell2"][:, 0], p0)
    for t in range(lam.shape[1]):  # λ_t = α_t² λ_{t−1} + ℓ_t²
        prev = a2[:, t] * prev + x["ell2"][:, t]
        lam[:, t] = prev
    want = filter_recurrent(x["q"], x["k"], x["v"], write="reset", lam=lam, r2=x["r2"], alpha=x["alpha"])
    got = lowrank(x, 0, p0=p0, output_final_state=True)
    close(got.o, want.o)
    close(got.gain, want.gain)
    # the final precision is the prior's, untouched by the writes
    close(got.state[1][..., 0], 1.0 / prev[..., None].expand_as(got.state[1][..., 0]))
    # and it is not the diagonal-covariance ablation
    diag = DIAGONAL_COVARIANCE.recurrent(x["q"], x["k"], x["v"], r2=x["r2"], ell2=x["ell2"], alpha=x["alpha"], p0=p0)
    assert (diag.o - got.o).abs().max() > 1e-3


def test_rank_zero_lofi_is_the_diagonal_precision_filter():
    x = inputs(dynamics="diagonal", T=10, B=1, H=1)
    p0 = 0.8
    ups = torch.full((6,), 1 / p0, dtype=DT)
    M = torch.zeros(6, 3, dtype=DT)
    outs, gains = [], []
    for t in range(10):
        k, q, v, r2 = x["k"][0, t, 0], x["q"][0, t, 0], x["v"][0, t, 0], x["r2"][0, t, 0]
        a = x["alpha"][0, t, 0]
        ups_bar = ups / (a * a + x["ell2"][0, t, 0] * ups)
        u = k / ups_bar
        beta = 1 / (r2 + k @ u)
        Mb = a[:, None] * M
        M = Mb + beta * torch.outer(u, v - Mb.T @ k)
        ups = ups_bar + k * k / r2
        outs.append(M.T @ q)
        gains.append(beta * (k @ u))
    got = lowrank(x, 0, p0=p0, projection="lofi", output_final_state=True)
    close(got.o[0, :, 0], torch.stack(outs))
    close(got.gain[0, :, 0, 0], torch.stack(gains))
    close(got.state[1][0, 0, :, 0], ups)
    diag = DIAGONAL_COVARIANCE.recurrent(x["q"], x["k"], x["v"], r2=x["r2"], ell2=x["ell2"], alpha=x["alpha"], p0=p0)
    assert (diag.o - got.o).abs().max() > 1e-3


# -- what the approximation preserves -----------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("dynamics", ["identity", "scalar", "diagonal"])
@pytest.mark.parametrize("rank", [0, 1, 3])
def test_conservative_is_never_overconfident(seed, dynamics, rank):
    x = inputs(dynamics=dynamics, seed=seed, T=16, D=6)
    exact = dense(x, p0=1.3)
    approx = lowrank(x, rank, p0=1.3)
    # every query's variance is at least the exact filter's ...
    assert (approx.variance - exact.variance).min() >= -1e-10
    # ... and the covariance dominates the exact one in the Loewner order after every prefix
    for T in (1, 5, 11, 16):
        xt = {name: (val[:, :T] if val is not None else None) for name, val in x.items()}
        P_exact = dense(xt, p0=1.3, output_final_state=True).state[1]
        P_approx = lowrank_covariance(lowrank(xt, rank, p0=1.3, output_final_state=True).state[1])
        assert torch.linalg.eigvalsh(P_approx - P_exact).min() >= -1e-10
    # the innovation variance 1/β = r² + kᵀP̄k is ≥ r², i.e. the gain kᵀβu lies in [0, 1)
    assert (approx.gain >= 0).all() and (approx.gain < 1).all()
    assert (approx.variance >= 1).all()


def test_lofi_is_not_conservative_but_keeps_the_precision_diagonal():
    x = inputs(dynamics="scalar", seed=1, T=16)
    exact = dense(x, p0=1.3, output_final_state=True)
    approx = lowrank(x, 1, p0=1.3, projection="lofi", output_final_state=True)
    assert torch.linalg.eigvalsh(lowrank_covariance(approx.state[1]) - exact.state[1]).min() < -1e-3
    assert (approx.gain >= 0).all() and (approx.gain < 1).all()
    # one more token from this state: diag(Λ) after the projection = diag(Λ̄ + k kᵀ/r²) exactly
    _, F_prev = approx.state
    one = {name: (val[:, :1] if val is not None else None) for name, val in inputs(dynamics="scalar", seed=9).items()}
    M0 = torch.zeros(2, 2, 6, 3, dtype=DT)
    after = lowrank(one, 1, projection="lofi", initial_state=(M0, F_prev), output_final_state=True).state[1]
    P_prev = lowrank_covariance(F_prev)
    a = one["alpha"][:, 0, :, None, None]
    P_bar = a * a * P_prev + one["ell2"][:, 0, :, None, None] * torch.eye(6, dtype=DT)
    k = one["k"][:, 0]
    lam_exact = torch.linalg.inv(P_bar) + k[..., :, None] * k[..., None, :] / one["r2"][:, 0, :, None, None]
    lam_after = torch.diag_embed(after[..., 0]) + after[..., 1:] @ after[..., 1:].transpose(-1, -2)
    close(torch.diagonal(lam_after, dim1=-2, dim2=-1), torch.diagonal(lam_exact, dim1=-2, dim2=-1))


# -- paths ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("projection", ["conservative", "lofi"])
@pytest.mark.parametrize("dynamics,G,C,T", [("identity", 1, 4, 13), ("scalar", 2, 8, 20), ("diagonal", 1, 64, 9)])
def test_chunk_equals_oracle(projection, dynamics, G, C, T):
    x = inputs(dynamics=dynamics, G=G, T=T, m=4)
    M0, F0 = initial_lowrank_state(2, 2, 6, 4, rank=2, p0=1.0, groups=G, dtype=DT)
    # a non-trivial start state: run a few tokens first
    warm = lowrank(inputs(dynamics=dynamics, G=G, T=5, m=4, seed=3), 2, output_final_state=True,
                   projection=projection, initial_state=(M0, F0)).state
    want = lowrank(x, 2, initial_state=warm, output_final_state=True, projection=projection)
    got = lowrank_chunk(x["q"], x["k"], x["v"], rank=2, r2=x["r2"], ell2=x["ell2"], alpha=x["alpha"],
                        initial_state=warm, output_final_state=True, return_variance=True, chunk_size=C,
                        projection=projection)
    close(got.o, want.o, 1e-12)
    close(got.variance, want.variance, 1e-12)
    close(got.gain, want.gain, 1e-12)
    close(got.state[0], want.state[0], 1e-12)
    close(got.state[1], want.state[1], 1e-12)


def test_steps_equal_the_oracle_and_the_design_paths():
    x = inputs(dynamics="diagonal", T=7)
    design = lowrank_diagonal(2)
    want = design.recurrent(**x, p0=1.0, output_final_state=True)
    chunk = design.chunk(**x, p0=1.0, output_final_state=True, return_variance=True, chunk_size=4)
    close(chunk.o, want.o)
    close(chunk.variance, want.variance)
    state = design.initial_state(2, 2, 6, 3, p0=1.0, dtype=DT)
    for t in range(7):
        out = design.step(x["q"][:, t], x["k"][:, t], x["v"][:, t], state=state, r2=x["r2"][:, t],
                          ell2=x["ell2"][:, t], alpha=x["alpha"][:, t])
        close(out.o, want.o[:, t])
        close(out.variance, want.variance[:, t])
        state = out.state
    close(lowrank_covariance(state[1]), lowrank_covariance(want.state[1]))


def test_gradcheck():
    x = inputs(B=1, T=4, H=1, D=3, m=2, dynamics="scalar")
    names = ("q", "k", "v", "r2", "ell2", "alpha")

    def f(*args):
        kw = dict(zip(names, args, strict=True))
        out = lowrank_chunk(kw["q"], F.normalize(kw["k"], dim=-1), kw["v"], rank=1, r2=kw["r2"],
                            ell2=kw["ell2"], alpha=kw["alpha"], return_variance=True, chunk_size=2)
        return out.o, out.variance

    args = [x[n].clone().requires_grad_(True) for n in names]
    assert torch.autograd.gradcheck(f, args, atol=1e-6, rtol=1e-5)


def test_gradients_are_finite_from_the_degenerate_start():
    # W_0 = 0: the first r writes leave repeated zero eigenvalues in the projection
    x = inputs(B=2, T=6, D=8, dynamics="identity")
    x = {n: (t.float().requires_grad_(True) if t is not None else None) for n, t in x.items()}
    out = lowrank_chunk(x["q"], x["k"], x["v"], rank=4, r2=x["r2"], ell2=x["ell2"], alpha=None,
                        return_variance=True)
    (out.o.square().sum() + out.variance.sum()).backward()
    for n in ("q", "k", "v", "r2", "ell2"):
        assert torch.isfinite(x[n].grad).all(), n


# -- design and registry ------------------------------------------------------------------------------------
def test_design_registry_and_state_size():
    d = get_design("lowrank_diagonal_4")
    assert (d.write, d.rank, d.projection) == ("lowrank", 4, "conservative")
    assert get_design("lowrank_diagonal_0_lofi").projection == "lofi"
    assert d.state_size(16, 32, groups=2) == 16 * 32 + 2 * 16 * 5
    with pytest.raises(ValueError, match="rank must be <= the key dim D = 16"):
        lowrank_diagonal(17).state_size(16, 32)
    M, Fs = d.initial_state(1, 2, 16, 32, p0=2.0, groups=2)
    assert Fs.shape == (1, 2, 2, 16, 5) and (Fs[..., 0] == 0.5).all() and (Fs[..., 1:] == 0).all()


# -- bad input ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rank,err,match", [
    (-1, ValueError, "rank must be >= 0"),
    (7, ValueError, r"rank must be <= the key dim D = 6"),
    (2.0, TypeError, "rank must be an integer"),
    ("3", TypeError, "rank must be an integer"),
    (True, TypeError, "rank must be an integer"),
    (None, TypeError, "rank must be an integer"),
])
def test_bad_rank(rank, err, match):
    x = inputs(T=3)
    with pytest.raises(err, match=match):
        lowrank(x, rank)
    with pytest.raises(err, match="rank must"):
        lowrank_chunk(x["q"], x["k"], x["v"], rank=rank, r2=x["r2"], ell2=x["ell2"], alpha=x["alpha"])
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        with pytest.raises(err, match="rank must"):
            lowrank_diagonal(rank)
    with pytest.raises((TypeError, ValueError), match="rank"):
        BayesianLayer(12, num_heads=2, head_dim=6, covariance="lowrank", rank=rank)


def test_bad_arguments():
    x = inputs(T=3)
    with pytest.raises(ValueError, match="projection must be one of"):
        lowrank(x, 1, projection="svd")
    with pytest.raises(ValueError, match="rotation dynamics"):
        lowrank_recurrent(x["q"], x["k"], x["v"], rank=1, r2=x["r2"], ell2=x["ell2"],
                          theta=torch.zeros(2, 3, 2, 3, dtype=DT))
    with pytest.raises(ValueError, match="ell2"):
        lowrank_recurrent(x["q"], x["k"], x["v"], rank=1, r2=x["r2"], ell2=None)
    M0, F0 = initial_lowrank_state(2, 2, 6, 3, rank=1, dtype=DT)
    with pytest.raises(ValueError, match=r"initial_state\[1\] \(F = \[υ, W\]\) must be \[2, 2, 6, 3\] for rank=2"):
        lowrank(x, 2, initial_state=(M0, F0))
    with pytest.raises(ValueError, match="must be > 0"):
        lowrank(x, 1, initial_state=(M0, torch.zeros_like(F0)))
    with pytest.raises(TypeError, match=r"initial_state must be a tuple \(M, F\)"):
        lowrank(x, 1, initial_state=M0)
    with pytest.raises(ValueError, match="do not pass lam"):
        lowrank_diagonal(1).recurrent(x["q"], x["k"], x["v"], r2=x["r2"], ell2=x["ell2"], lam=x["r2"])
    with pytest.raises(ValueError, match="rank applies only to write='lowrank'"):
        type(lowrank_diagonal(1))("x", "bayes", rank=2)


def test_layer_option_errors():
    with pytest.raises(ValueError, match="covariance='lowrank' needs rank"):
        BayesianLayer(12, num_heads=2, head_dim=6, covariance="lowrank")
    with pytest.raises(ValueError, match="rank applies only to covariance='lowrank'"):
        BayesianLayer(12, num_heads=2, head_dim=6, rank=2)
    with pytest.raises(ValueError, match="does not support dynamics='rotation'"):
        BayesianLayer(12, num_heads=2, head_dim=6, covariance="lowrank", rank=2, dynamics="rotation")


def test_layer_full_rank_equals_dense_layer():
    torch.manual_seed(0)
    dense_layer = BayesianLayer(12, num_heads=2, head_dim=6, dynamics="diagonal").double()
    lr_layer = BayesianLayer(12, num_heads=2, head_dim=6, dynamics="diagonal", covariance="lowrank",
                             rank=6).double()
    lr_layer.load_state_dict(dense_layer.state_dict())
    x = torch.randn(2, 9, 12, dtype=DT)
    a, b = dense_layer(x, output_variance=True), lr_layer(x, output_variance=True)
    close(b.o, a.o)
    close(b.variance, a.variance)
    assert lr_layer.state_size_per_head() == 6 * 12 + 6 * 7
