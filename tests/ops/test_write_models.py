"""Write models as objects (bayeslayer.ops.bayesian_layer.write_models, bayeslayer.design.write): the registry, what
each object says of itself, and that a name and its object run the same filter."""

from __future__ import annotations

import pytest
import torch

from bayeslayer.design import BAYESIAN, DESIGNS, MAMBA2, RETNET, lowrank_diagonal
from bayeslayer.design.write import DESIGN_WRITES, FilterWrite, LowRankWrite, get_design_write
from bayeslayer.ops import WRITE_MODELS, filter_chunk, filter_recurrent
from bayeslayer.ops.bayesian_layer.write_models import BAYES, DIAGONAL, LATENT, RESET, get_write_model


def test_registry_and_facts():
    assert WRITE_MODELS == ("bayes", "diagonal", "reset", "latent")
    assert [get_write_model(n) for n in WRITE_MODELS] == [BAYES, DIAGONAL, RESET, LATENT]
    assert get_write_model(RESET) is RESET
    assert [w.has_covariance for w in (BAYES, DIAGONAL, RESET, LATENT)] == [True, True, False, False]
    assert [w.erase for w in (BAYES, DIAGONAL, RESET, LATENT)] == [True, True, True, False]
    assert [w.has_variance(True) for w in (BAYES, DIAGONAL, RESET, LATENT)] == [True, True, True, False]
    assert [w.has_variance(False) for w in (BAYES, DIAGONAL, RESET, LATENT)] == [True, True, False, False]
    assert [w.state_size(16, 8, 2) for w in (BAYES, DIAGONAL, RESET, LATENT)] == [
        16 * 8 + 2 * 16 * 16, 16 * 8 + 2 * 16, 16 * 8, 16 * 8]
    for bad in ("kalman", None, 3):
        with pytest.raises(ValueError, match="write must be one of"):
            get_write_model(bad)


def test_design_writes():
    assert list(DESIGN_WRITES) == ["bayes", "diagonal", "reset", "latent", "lowrank"]
    assert isinstance(DESIGN_WRITES["lowrank"], LowRankWrite)
    assert all(isinstance(DESIGN_WRITES[n], FilterWrite) and DESIGN_WRITES[n].model is get_write_model(n)
               for n in WRITE_MODELS)
    assert [n for n, w in DESIGN_WRITES.items() if w.takes_fixed_lam] == ["reset"]
    for d in [*DESIGNS.values(), lowrank_diagonal(2)]:
        assert d.write_model is get_design_write(d.write) and d.write_model.name == d.write
    assert lowrank_diagonal(2).state_size(16, 8, 2) == 16 * 8 + 2 * 16 * 3
    with pytest.raises(ValueError, match="write must be bayes/diagonal/reset/latent/lowrank"):
        get_design_write("kalman")


def test_retnet_is_mamba2_under_a_second_name():
    assert RETNET is MAMBA2 and DESIGNS["retnet"] is DESIGNS["mamba2"] is MAMBA2


def _inputs(T=7, H=2, D=4, m=3):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(1, T, H, D, generator=gen, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(1, T, H, m, generator=gen, dtype=torch.float64)
    noise = torch.rand(1, T, H, generator=gen, dtype=torch.float64) + 0.5
    return q, k, v, noise


@pytest.mark.parametrize("name", WRITE_MODELS)
def test_a_name_and_its_object_run_the_same_filter(name):
    q, k, v, noise = _inputs()
    args = dict(r2=noise, ell2=noise * 0.1) if get_write_model(name).has_covariance else dict(r2=noise, lam=noise)
    for fn, extra in ((filter_recurrent, {}), (filter_chunk, {"return_variance": True})):
        by_name = fn(q, k, v, write=name, **args, **extra)
        by_object = fn(q, k, v, write=get_write_model(name), **args, **extra)
        assert torch.equal(by_name.o, by_object.o) and torch.equal(by_name.gain, by_object.gain)
        assert (by_name.variance is None) == (name == "latent")


def test_bayesian_design_runs_through_its_write_object():
    q, k, v, noise = _inputs()
    out = BAYESIAN.chunk(q, k, v, r2=noise, ell2=noise * 0.1, chunk_size=16, return_variance=True)
    ref = filter_chunk(q, k, v, write="bayes", r2=noise, ell2=noise * 0.1, chunk_size=16, return_variance=True)
    assert torch.equal(out.o, ref.o) and torch.equal(out.variance, ref.variance)
