"""``bl_step`` applied token by token equals ``bl_recurrent`` (outputs, variance, state)."""

from __future__ import annotations

import pytest
import torch

from bayeslayer.ops import bl_recurrent, bl_step, initial_bl_state

from .inputs import DYNAMICS, bl_inputs

TOL = dict(atol=1e-12, rtol=1e-11)


def _at(x, t):
    return None if x is None else x[:, t]


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("dynamics", DYNAMICS)
def test_steps_equal_recurrent(dynamics, G):
    inp = bl_inputs(T=12, G=G, dynamics=dynamics, initial_state=True)
    o_ref, var_ref, (M_ref, P_ref) = bl_recurrent(**inp, output_final_state=True, return_variance=True)
    state = inp["initial_state"]
    outs, variances = [], []
    for t in range(inp["q"].shape[1]):
        o, var, state = bl_step(
            inp["q"][:, t], inp["k"][:, t], inp["v"][:, t], inp["r2"][:, t], inp["ell2"][:, t],
            alpha=_at(inp["alpha"], t), theta=_at(inp["theta"], t), state=state, return_variance=True,
        )
        B, H, m = inp["v"].shape[0], inp["v"].shape[2], inp["v"].shape[3]
        assert o.shape == (B, H, m) and var.shape == (B, H, G)
        outs.append(o)
        variances.append(var)
    torch.testing.assert_close(torch.stack(outs, 1), o_ref, **TOL)
    torch.testing.assert_close(torch.stack(variances, 1), var_ref, **TOL)
    torch.testing.assert_close(state[0], M_ref, **TOL)
    torch.testing.assert_close(state[1], P_ref, **TOL)
    assert state[1].shape == P_ref.shape


@pytest.mark.parametrize("G", [1, 3])
def test_steps_from_initial_bl_state_equal_recurrent_prior(G):
    """``initial_bl_state(p0=c)`` is the prior ``bl_recurrent`` uses with ``p0=c`` and no state."""
    B, T, H, D, m = 2, 9, 3, 4, 6
    inp = bl_inputs(B=B, T=T, H=H, D=D, m=m, G=G, dynamics="diagonal")
    o_ref, (M_ref, P_ref) = bl_recurrent(**inp, p0=2.5, output_final_state=True)
    state = initial_bl_state(B, H, D, m, p0=2.5, groups=G, dtype=torch.float64)
    assert state[1].shape == ((B, H, D, D) if G == 1 else (B, H, G, D, D))
    outs = []
    for t in range(T):
        o, state = bl_step(inp["q"][:, t], inp["k"][:, t], inp["v"][:, t], inp["r2"][:, t], inp["ell2"][:, t],
                           alpha=inp["alpha"][:, t], state=state)
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 1), o_ref, **TOL)
    torch.testing.assert_close(state[0], M_ref, **TOL)
    torch.testing.assert_close(state[1], P_ref, **TOL)


def test_initial_bl_state_layout():
    M, P = initial_bl_state(2, 3, 4, 5, p0=0.5)
    assert M.shape == (2, 3, 4, 5) and P.shape == (2, 3, 4, 4)
    assert M.dtype == P.dtype == torch.float32
    assert bool((M == 0).all())
    torch.testing.assert_close(P, 0.5 * torch.eye(4).expand(2, 3, 4, 4))
    # a writable tensor, not an expanded view: in-place updates of one head must not leak
    P[0, 0, 0, 0] = 7.0
    assert P[1, 2, 0, 0] == 0.5


def test_step_in_low_precision_keeps_fp32_state():
    """Decoding in bf16: outputs come back in bf16, the state stays fp32 across steps."""
    inp = bl_inputs(T=4, dynamics="scalar", dtype=torch.float32)
    state = initial_bl_state(2, 2, 6, 4)
    for t in range(4):
        o, state = bl_step(*(inp[n][:, t].bfloat16() for n in ("q", "k", "v")), inp["r2"][:, t],
                           inp["ell2"][:, t], alpha=inp["alpha"][:, t], state=state)
        assert o.dtype == torch.bfloat16
        assert state[0].dtype == state[1].dtype == torch.float32
