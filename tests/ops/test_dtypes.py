"""Low-precision inputs: the filter arithmetic runs in float32, outputs come back in the input dtype.

The check is exact: a bf16/fp16 call must give bit for bit the float32 call on the same values
(upcast) with its output rounded once to the input dtype.  Any arithmetic in the low precision
would round intermediates and break that equality.  The state and the variance stay float32,
so a decode loop in bf16 does not accumulate bf16 rounding in its covariance.
"""

from __future__ import annotations

import pytest
import torch

from bayeslayer.design import BAYESIAN, GATED_DELTANET, GLA
from bayeslayer.ops import bl_chunk, bl_recurrent

from .inputs import bl_inputs

LOW = [torch.bfloat16, torch.float16]


def _cast(inp: dict, dtype) -> dict:
    """q, k, v in ``dtype``; noise, dynamics and state stay as given (float32)."""
    return {k: (x.to(dtype) if k in ("q", "k", "v") else x) for k, x in inp.items()}


@pytest.mark.parametrize("fn", [bl_recurrent, bl_chunk], ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("dynamics", ["scalar", "rotation_pairs"])
def test_low_precision_runs_in_fp32(fn, dtype, dynamics):
    inp = bl_inputs(T=40, G=2, dynamics=dynamics, initial_state=True, dtype=torch.float32)
    low = _cast(inp, dtype)
    up = {k: (x.float() if k in ("q", "k", "v") else x) for k, x in low.items()}  # same values, fp32
    kw = dict(output_final_state=True, return_variance=True)
    if fn is bl_chunk:
        kw["chunk_size"] = 16
    o, var, (M, P) = fn(**low, **kw)
    o32, var32, (M32, P32) = fn(**up, **kw)
    assert o.dtype == dtype
    assert var.dtype == M.dtype == P.dtype == torch.float32
    assert torch.equal(o, o32.to(dtype)), "low-precision output is not the rounded float32 result"
    assert torch.equal(var, var32) and torch.equal(M, M32) and torch.equal(P, P32)


@pytest.mark.parametrize("fn", [bl_recurrent, bl_chunk], ids=lambda f: f.__name__)
def test_float32_is_accurate(fn):
    """float32 arithmetic agrees with the float64 oracle to float32 accuracy."""
    inp = bl_inputs(T=100, G=2, dynamics="diagonal", initial_state=True, dtype=torch.float64)
    o64, (M64, P64) = bl_recurrent(**inp, output_final_state=True)
    inp32 = {k: (tuple(s.float() for s in x) if isinstance(x, tuple) else (x.float() if x is not None else None))
             for k, x in inp.items()}
    o, (M, P) = fn(**inp32, output_final_state=True)
    assert o.dtype == M.dtype == P.dtype == torch.float32
    torch.testing.assert_close(o.double(), o64, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(M.double(), M64, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(P.double(), P64, atol=1e-5, rtol=1e-4)


def test_float64_inputs_compute_in_float64():
    inp = bl_inputs(T=30, dynamics="scalar")
    o, var, (M, P) = bl_chunk(**inp, output_final_state=True, return_variance=True)
    assert o.dtype == var.dtype == M.dtype == P.dtype == torch.float64


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_low_precision_backward(dtype):
    """Gradients flow back to bf16/fp16 leaves in their own dtype and are finite."""
    inp = _cast(bl_inputs(T=33, dynamics="diagonal", dtype=torch.float32), dtype)
    leaves = {k: inp[k].detach().requires_grad_() for k in ("q", "k", "v")}
    r2 = inp["r2"].detach().requires_grad_()
    o, _ = bl_chunk(leaves["q"], leaves["k"], leaves["v"], r2, inp["ell2"], alpha=inp["alpha"], chunk_size=16)
    o.float().square().sum().backward()
    for name, x in leaves.items():
        assert x.grad.dtype == dtype, name
        assert bool(torch.isfinite(x.grad).all()) and bool(x.grad.abs().max() > 0), name
    assert r2.grad.dtype == torch.float32 and bool(torch.isfinite(r2.grad).all())


@pytest.mark.parametrize("design", [BAYESIAN, GATED_DELTANET, GLA], ids=lambda d: d.name)
def test_designs_return_input_dtype(design):
    B, T, H, D, m = 1, 20, 2, 4, 4
    q, k, v = (torch.randn(B, T, H, n).bfloat16() for n in (D, D, m))
    k = torch.nn.functional.normalize(k, dim=-1)  # unit keys: a reset gain of 0.5 must not expand the memory
    if design is BAYESIAN:
        kw = dict(r2=torch.full((B, T, H), 0.5), ell2=torch.full((B, T, H), 0.1))
    elif design is GATED_DELTANET:
        kw = dict(gain=torch.full((B, T, H), 0.5), alpha=torch.full((B, T, H), 0.9))
    else:
        kw = dict(gain=1.0, alpha=torch.full((B, T, H, D), 0.9))
    for out in (design.recurrent(q, k, v, output_final_state=True, **kw),
                design.chunk(q, k, v, output_final_state=True, chunk_size=8, **kw)):
        assert out.o.dtype == torch.bfloat16
        assert out.state[0].dtype == torch.float32 and out.gain.dtype == torch.float32
