"""Write models as objects (bayeslayer.ops.bayesian_layer.write_models, bayeslayer.ops.bayesian_layer.lowrank): the
one family, what each object says of itself, that a name and its object run the same filter, and that a design
model runs its write model through the ops."""

from __future__ import annotations

import pytest
import torch

from bayeslayer.design import BAYESIAN, DELTANET, DESIGNS, MAMBA2, RETNET, lowrank_diagonal
from bayeslayer.ops import WRITE_MODELS, BackendError, WriteModel, filter_chunk, filter_recurrent
from bayeslayer.ops.backend import dispatch_chunk, dispatch_step
from bayeslayer.ops.bayesian_layer.lowrank import LowRankWrite, lowrank_chunk, lowrank_recurrent
from bayeslayer.ops.bayesian_layer.write_models import BAYES, DIAGONAL, LATENT, RESET, WRITES, get_write_model


def test_registry_and_facts():
    assert WRITE_MODELS == ("bayes", "diagonal", "reset", "latent", "lowrank")
    assert list(WRITES) == list(WRITE_MODELS[:4])
    assert [get_write_model(n) for n in WRITES] == [BAYES, DIAGONAL, RESET, LATENT]
    assert get_write_model(RESET) is RESET
    low = LowRankWrite(3)
    ones = (BAYES, DIAGONAL, RESET, LATENT, low)
    assert [w.name for w in ones] == list(WRITE_MODELS)
    assert [w.has_covariance for w in ones] == [True, True, False, False, True]
    assert [w.erase for w in ones] == [True, True, True, False, True]
    assert [w.has_variance(True) for w in ones] == [True, True, True, False, True]
    assert [w.has_variance(False) for w in ones] == [True, True, False, False, True]
    assert [w.takes_fixed_lam for w in ones] == [False, False, True, False, False]
    assert [w.own_filter for w in ones] == [False, False, False, False, True]
    assert [w.state_size(16, 8, 2) for w in ones] == [
        16 * 8 + 2 * 16 * 16, 16 * 8 + 2 * 16, 16 * 8, 16 * 8, 16 * 8 + 2 * 16 * 4]
    for bad in ("kalman", None, 3):
        with pytest.raises(ValueError, match="write must be one of"):
            get_write_model(bad)
    with pytest.raises(ValueError, match=r"write='lowrank' needs its rank: .*LowRankWrite\(rank, projection\)"):
        get_write_model("lowrank")


def test_lowrank_write_model_object():
    assert LowRankWrite(2) == LowRankWrite(2, "conservative") != LowRankWrite(2, "lofi")
    assert len({LowRankWrite(2), LowRankWrite(2)}) == 1 and isinstance(LowRankWrite(0), WriteModel)
    assert repr(LowRankWrite(1, "lofi")) == "LowRankWrite(rank=1, projection='lofi')"
    with pytest.raises(TypeError, match="rank must be an integer"):
        LowRankWrite(None)
    with pytest.raises(ValueError, match="projection must be one of"):
        LowRankWrite(1, "svd")
    with pytest.raises(ValueError, match="rank=3 disagrees with this write model's rank 2"):
        LowRankWrite(2).check_config(rank=3)
    with pytest.raises(ValueError, match="does not support rotation dynamics"):
        LowRankWrite(2).check_config(rank=2, dynamics="rotation")
    with pytest.raises(ValueError, match="rank applies only to write='lowrank', not 'bayes'"):
        BAYES.check_config(rank=2)
    M, F = LowRankWrite(2).initial_state(1, 2, 6, 4, p0=0.5, dtype=torch.float64)
    assert M.shape == (1, 2, 6, 4) and F.shape == (1, 2, 6, 3) and bool((F[..., 0] == 2.0).all())
    assert RESET.initial_state(1, 2, 6, 4)[1] is None and BAYES.initial_state(1, 2, 6, 4)[1].shape == (1, 2, 6, 6)


def test_designs_name_their_write_model():
    for d in [*DESIGNS.values(), lowrank_diagonal(2)]:
        assert d.write_model.name == d.write
        if d.write != "lowrank":
            assert d.write_model is get_write_model(d.write)
    assert lowrank_diagonal(2, "lofi").write_model == LowRankWrite(2, "lofi")
    assert lowrank_diagonal(2).state_size(16, 8, 2) == 16 * 8 + 2 * 16 * 3
    assert DELTANET.initial_state(1, 2, 4, 3)[1] is None


def test_deprecated_design_write_names_warn():
    import bayeslayer.design.write as old

    with pytest.warns(DeprecationWarning, match="DESIGN_WRITES is deprecated"):
        assert list(old.DESIGN_WRITES) == list(WRITE_MODELS)
    with pytest.warns(DeprecationWarning, match="DesignWrite is deprecated"):
        assert old.DesignWrite is WriteModel
    with pytest.warns(DeprecationWarning, match="get_design_write is deprecated"):
        assert old.get_design_write("reset") is RESET
    with pytest.raises(AttributeError):
        old.NoSuchName  # noqa: B018


def test_retnet_is_mamba2_under_a_second_name():
    assert RETNET is MAMBA2 and DESIGNS["retnet"] is DESIGNS["mamba2"] is MAMBA2


def _inputs(T=7, H=2, D=4, m=3):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(1, T, H, D, generator=gen, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(1, T, H, m, generator=gen, dtype=torch.float64)
    noise = torch.rand(1, T, H, generator=gen, dtype=torch.float64) + 0.5
    return q, k, v, noise


@pytest.mark.parametrize("name", list(WRITES))
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


def _lowrank_inputs(T=7, H=2, D=4, m=3):
    q, k, v, noise = _inputs(T, H, D, m)
    alpha = torch.sigmoid(torch.randn(1, T, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)) + 0.2
    return q, k, v, dict(r2=noise, ell2=noise * 0.1, alpha=alpha.clamp(max=1.0))


@pytest.mark.parametrize("projection", ["conservative", "lofi"])
def test_the_lowrank_write_model_runs_through_the_general_entry_points(projection):
    """filter_recurrent, filter_chunk and the dispatch run LowRankWrite's own filter: the same numbers as the
    low-rank functions called directly, and the design model runs the same."""
    q, k, v, args = _lowrank_inputs()
    write = LowRankWrite(2, projection)
    ref = lowrank_recurrent(q, k, v, rank=2, projection=projection, **args, p0=0.7, output_final_state=True)
    ref_c = lowrank_chunk(q, k, v, rank=2, projection=projection, **args, p0=0.7, output_final_state=True,
                          return_variance=True, chunk_size=4)
    design = lowrank_diagonal(2, projection)
    for out in (filter_recurrent(q, k, v, write=write, **args, p0=0.7, output_final_state=True),
                design.recurrent(q, k, v, **args, p0=0.7, output_final_state=True)):
        assert torch.equal(out.o, ref.o) and torch.equal(out.variance, ref.variance)
        assert all(torch.equal(a, b) for a, b in zip(out.state, ref.state, strict=True))
    for out in (filter_chunk(q, k, v, write=write, **args, p0=0.7, output_final_state=True, return_variance=True,
                             chunk_size=4),
                dispatch_chunk(q, k, v, write=write, **args, p0=0.7, output_final_state=True, return_variance=True,
                               chunk_size=4, backend="torch"),
                design.chunk(q, k, v, **args, p0=0.7, output_final_state=True, return_variance=True, chunk_size=4)):
        assert torch.equal(out.o, ref_c.o) and torch.equal(out.variance, ref_c.variance)
        assert all(torch.equal(a, b) for a, b in zip(out.state, ref_c.state, strict=True))
    state = design.initial_state(1, 2, 4, 3, p0=0.7, dtype=torch.float64)
    one = {n: x[:, 0] for n, x in args.items()}
    step = dispatch_step(q[:, 0], k[:, 0], v[:, 0], write=write, state=state, **one)
    first = lowrank_recurrent(q[:, :1], k[:, :1], v[:, :1], rank=2, projection=projection,
                              **{n: x[:, :1] for n, x in args.items()}, p0=0.7, output_final_state=True)
    assert torch.equal(step.o, first.o[:, 0]) and torch.equal(step.state[1], first.state[1])
    assert torch.equal(design.step(q[:, 0], k[:, 0], v[:, 0], state=state, **one).o, step.o)


def test_the_lowrank_write_model_refuses_what_it_cannot_run():
    q, k, v, args = _lowrank_inputs()
    write = LowRankWrite(2)
    with pytest.raises(ValueError, match="derives its gain from r2/ell2; do not pass lam"):
        filter_chunk(q, k, v, write=write, **args, lam=args["r2"])
    with pytest.raises(ValueError, match="derives its gain from r2/ell2; do not pass gain"):
        filter_recurrent(q, k, v, write=write, **args, gain=args["r2"])
    # a forced Triton backend names the reason (checked before Triton's availability)
    for run in (lambda: dispatch_chunk(q, k, v, write=write, **args, backend="triton"),
                lambda: lowrank_diagonal(2).chunk(q, k, v, **args, backend="triton")):
        with pytest.raises(BackendError, match="cannot run this chunk: write model 'lowrank' has no Triton kernel"):
            run()
