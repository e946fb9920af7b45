"""The collision-study generators produce exactly what their docstrings say."""

import math

import pytest
import torch

from bayeslayer.data.collision_tasks import (
    IGNORE_INDEX,
    QUERY,
    WRITE,
    collision_recall_batch,
    crowding_batch,
    crowding_projection,
    recall_sequence_length,
)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_recall_docstring_example_layout():
    b = collision_recall_batch(3, n_f=1, rho=0.8, generator=gen(), n_b=2, num_pairs=1, address_dim=2)
    x, y, yd = b
    assert x.shape == (3, 4, 1 + 2 + 2)
    assert torch.equal(x[:, :, 0], torch.tensor([WRITE, WRITE, WRITE, QUERY]).expand(3, 4))
    addr, val = x[..., 1:3], x[..., 3:]
    # target written twice, then the distractor, then the target is queried
    assert torch.equal(addr[:, 0], addr[:, 1]) and torch.equal(addr[:, 0], addr[:, 3])
    assert torch.allclose((addr[:, 0] * addr[:, 2]).sum(-1), torch.full((3,), 0.8), atol=1e-6)
    assert torch.allclose(addr.norm(dim=-1), torch.ones(3, 4), atol=1e-6)
    tv, dv = val[:, 0].argmax(-1), val[:, 2].argmax(-1)
    assert torch.equal(val[:, 0], val[:, 1]) and bool((tv != dv).all())
    assert bool((val[:, 3] == 0).all())  # no value on the QUERY token
    assert bool((y[:, :3] == IGNORE_INDEX).all()) and torch.equal(y[:, 3], tv)
    assert bool((yd[:, :3] == IGNORE_INDEX).all()) and torch.equal(yd[:, 3], dv)


@pytest.mark.parametrize("n_f", [0, 1, 5])
def test_recall_structure_and_overlap(n_f):
    B, P, D, n_b = 4, 8, 16, 4
    rho = torch.tensor([0.6, 0.7, 0.8, 0.95])
    x, y, yd = collision_recall_batch(B, n_f=n_f, rho=rho, generator=gen(1), n_b=n_b, num_pairs=P,
                                      address_dim=D)
    T = recall_sequence_length(n_f, n_b, P)
    assert x.shape == (B, T, 33) and y.shape == (B, T) and y.dtype == torch.long
    is_q = x[..., 0] == QUERY
    assert bool((is_q[:, -P:]).all()) and not bool(is_q[:, :-P].any())
    assert torch.equal(y != IGNORE_INDEX, is_q)  # loss on query tokens only
    for b in range(B):
        addr, val = x[b, :, 1 : 1 + D], x[b, :, 1 + D :]
        assert torch.allclose(addr.norm(dim=-1), torch.ones(T), atol=1e-5)
        labels = val[:-P].argmax(-1)
        tgt_phase, dis_phase = slice(0, P * n_b), slice(P * n_b, P * (n_b + n_f))
        # each of the 8 targets is written n_b times with its own label, before any distractor
        tl = labels[tgt_phase]
        assert sorted(torch.bincount(tl, minlength=2 * P)[tl.unique()].tolist()) == [n_b] * P
        queried = y[b, -P:]
        assert sorted(queried.tolist()) == sorted(tl.unique().tolist())  # every target queried once
        assert len(set(queried.tolist()) | set(yd[b, -P:].tolist())) == 2 * P  # 16 distinct labels
        for j in range(P):
            t_addr = addr[-P + j]
            t_lab, d_lab = int(queried[j]), int(yd[b, -P + j])
            w_t = (labels == t_lab).nonzero().flatten()
            assert torch.allclose(addr[w_t], t_addr.expand(len(w_t), D), atol=1e-6)
            w_d = (labels == d_lab).nonzero().flatten()
            assert len(w_d) == n_f and all(dis_phase.start <= i < dis_phase.stop for i in w_d.tolist())
            if n_f:
                d_addr = addr[w_d[0]]
                assert math.isclose(float(t_addr @ d_addr), float(rho[b]), abs_tol=1e-5)
                others = addr[-P:][torch.arange(P) != j]
                assert float((others @ d_addr).abs().max()) < 1e-5  # pairs are mutually orthogonal


def test_recall_value_permutation_differs_between_sequences_and_is_seeded():
    a = collision_recall_batch(16, n_f=2, rho=0.7, generator=gen(3))
    b = collision_recall_batch(16, n_f=2, rho=0.7, generator=gen(3))
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    firsts = {tuple(a.labels[i, -8:].tolist()) for i in range(16)}
    assert len(firsts) > 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_f=-1, rho=0.8), "n_f"),
        (dict(n_f=1, rho=1.0), "rho"),
        (dict(n_f=1, rho=-0.1), "rho"),
        (dict(n_f=1, rho=torch.zeros(3)), "rho"),
        (dict(n_f=1, rho=0.8, num_pairs=9), "num_pairs"),
        (dict(n_f=1, rho=0.8, n_b=0), "n_b"),
    ],
)
def test_recall_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        collision_recall_batch(2, generator=gen(), **kwargs)


def test_recall_non_integer_count_is_a_type_error():
    """Counts go through the package's one integer check (bayeslayer.checks.check_int): a float is a TypeError."""
    with pytest.raises(TypeError, match="n_f must be an integer"):
        collision_recall_batch(2, generator=gen(), n_f=1.5, rho=0.8)


def test_recall_needs_a_generator():
    with pytest.raises(TypeError, match="generator"):
        collision_recall_batch(2, n_f=1, rho=0.8, generator=0)


def test_crowding_projection_is_frozen_row_orthogonal():
    W = crowding_projection(16, 64, seed=0)
    assert W.shape == (16, 64)
    assert torch.allclose(W @ W.T, torch.eye(16), atol=1e-5)
    assert torch.equal(W, crowding_projection(16, 64, seed=0))
    assert not torch.equal(W, crowding_projection(16, 64, seed=1))
    with pytest.raises(ValueError, match="address_dim"):
        crowding_projection(65, 64)


def test_crowding_docstring_layout():
    W = crowding_projection()
    n, nq = 20, 8
    x, y, yd = crowding_batch(5, n=n, projection=W, generator=gen(2), num_queries=nq)
    assert x.shape == (5, n + nq, 1 + 16 + 64)
    assert bool((x[:, :n, 0] == WRITE).all()) and bool((x[:, n:, 0] == QUERY).all())
    assert bool((y[:, :n] == IGNORE_INDEX).all()) and bool((y[:, n:] >= 0).all())
    assert bool((yd == IGNORE_INDEX).all())
    addr = x[..., 1:17]
    assert torch.allclose(addr.norm(dim=-1), torch.ones(5, n + nq), atol=1e-5)
    assert bool((x[:, n:, 17:] == 0).all())
    for b in range(5):
        vals = x[b, :n, 17:].argmax(-1)
        assert torch.allclose(x[b, :n, 17:].sum(-1), torch.ones(n))
        # each query is one distinct written address, labelled with the value written there
        sims = addr[b, n:] @ addr[b, :n].T
        slot = sims.argmax(-1)
        assert torch.allclose(sims.max(-1).values, torch.ones(nq), atol=1e-5)
        assert len(set(slot.tolist())) == nq
        assert torch.equal(y[b, n:], vals[slot])


def test_crowding_bad_arguments():
    W = crowding_projection()
    with pytest.raises(ValueError, match="num_queries"):
        crowding_batch(2, n=4, projection=W, generator=gen())
    with pytest.raises(ValueError, match="orthonormal"):
        crowding_batch(2, n=16, projection=2 * W, generator=gen())
    with pytest.raises(ValueError, match="projection"):
        crowding_batch(2, n=16, projection=torch.ones(16), generator=gen())
    with pytest.raises(ValueError, match="n must"):
        crowding_batch(2, n=0, projection=W, generator=gen())
