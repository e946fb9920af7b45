"""``bl_chunk`` equals the recurrent oracle ``bl_recurrent`` in float64.

Outputs, per-token variance, final state ``(M, P)`` and the gradients of every input
(q, k, v, r2, ell2, alpha, theta, and the initial state M, P — or p0 when there is none) over
sequence lengths that are not multiples of the chunk (1, 63, 100, 129), every dynamics kind,
G = 1 and G > 1 observation-noise groups, with and without an initial state, chunk sizes
16/32/64.  The default run takes a pairwise-covering subset of that grid; the rest of the full
cross product is marked ``slow``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from bayeslayer.ops import bl_chunk, bl_recurrent

from .inputs import DYNAMICS, bl_inputs, case_id, fixed_weights, pairwise

FACTORS = dict(
    T=(1, 63, 100, 129),  # 129 = 2·64 + 1: a one-token last chunk after 2, 4 or 8 whole ones
    dynamics=DYNAMICS,
    G=(1, 2),
    initial_state=(False, True),
    chunk_size=(16, 32, 64),
)
COVERING = pairwise(FACTORS)
_covered = {tuple(c.values()) for c in COVERING}
REST = [dict(zip(FACTORS, levels, strict=True)) for levels in itertools.product(*FACTORS.values())
        if levels not in _covered]

# float64 differences observed are ~1e-14 (outputs) and ~1e-13 (gradients); these bounds leave
# room for summation-order effects while still catching any algorithmic slip.
ATOL = RTOL = 1e-9


def _leaves(inp: dict, H: int) -> dict[str, torch.Tensor]:
    """The inputs to differentiate: every tensor argument, plus p0 as an [H] tensor without a state."""
    names = ("q", "k", "v", "r2", "ell2", "alpha", "theta")
    leaves = {name: inp[name] for name in names if inp[name] is not None}
    if inp["initial_state"] is not None:
        leaves["M0"], leaves["P0"] = inp["initial_state"]
    else:
        leaves["p0"] = 0.5 + torch.rand(H, dtype=torch.float64)
    return {name: x.detach().clone().requires_grad_() for name, x in leaves.items()}


def _call(fn, leaves: dict[str, torch.Tensor], **kw):
    state = (leaves["M0"], leaves["P0"]) if "M0" in leaves else None
    p0 = leaves.get("p0", 1.0)
    return fn(
        leaves["q"], leaves["k"], leaves["v"], leaves["r2"], leaves["ell2"],
        alpha=leaves.get("alpha"), theta=leaves.get("theta"), p0=p0, initial_state=state,
        output_final_state=True, return_variance=True, **kw,
    )


def check_chunk_against_recurrent(case: dict) -> None:
    B, H, D, m = 2, 2, 6, 4
    inp = bl_inputs(B=B, T=case["T"], H=H, D=D, m=m, G=case["G"], dynamics=case["dynamics"],
                    initial_state=case["initial_state"])
    leaves = _leaves(inp, H)
    results = {}
    paths = (("recurrent", bl_recurrent, {}), ("chunk", bl_chunk, dict(chunk_size=case["chunk_size"])))
    for name, fn, kw in paths:
        o, var, (M, P) = _call(fn, leaves, **kw)
        outs = (o, var, M, P)
        loss = sum((w * x).sum() for w, x in zip(fixed_weights(outs), outs, strict=True))
        grads = torch.autograd.grad(loss, list(leaves.values()))
        results[name] = (outs, dict(zip(leaves, grads, strict=True)))

    (o_r, var_r, M_r, P_r), g_r = results["recurrent"]
    (o_c, var_c, M_c, P_c), g_c = results["chunk"]
    G = case["G"]
    assert o_c.shape == (B, case["T"], H, m) and var_c.shape == (B, case["T"], H, G)
    assert P_c.shape == ((B, H, D, D) if G == 1 else (B, H, G, D, D))
    pairs = (("o", o_c, o_r), ("variance", var_c, var_r), ("final M", M_c, M_r), ("final P", P_c, P_r))
    for what, a, b in pairs:
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda s, w=what: f"{w}: {s}")
    for name in leaves:
        a, b = g_c[name], g_r[name]
        if name == "P0":
            # P0 lives on the symmetric matrices: the oracle applies it as P k, the chunk path as
            # kᵀ P, so the gradients agree on their symmetric part and may differ by an
            # antisymmetric matrix, which is orthogonal to every admissible perturbation.
            a, b = 0.5 * (a + a.transpose(-1, -2)), 0.5 * (b + b.transpose(-1, -2))
        assert bool(b.abs().max() > 0), f"gradient of {name} is identically zero: the test would be vacuous"
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda s, n=name: f"grad {n}: {s}")


@pytest.mark.parametrize("case", COVERING, ids=case_id)
def test_chunk_matches_recurrent(case):
    check_chunk_against_recurrent(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", REST, ids=case_id)
def test_chunk_matches_recurrent_full_grid(case):
    check_chunk_against_recurrent(case)


def test_covering_grid_covers_every_pair():
    seen = {(a, c[a], b, c[b]) for c in COVERING for a, b in itertools.combinations(FACTORS, 2)}
    for a, b in itertools.combinations(FACTORS, 2):
        for la, lb in itertools.product(FACTORS[a], FACTORS[b]):
            assert (a, la, b, lb) in seen
    assert len(COVERING) + len(REST) == len(list(itertools.product(*FACTORS.values())))


@pytest.mark.parametrize("chunk_size", [1, 7, 50, 51, 200])
@pytest.mark.parametrize("dynamics", ["diagonal", "rotation_pairs"])
def test_chunk_size_edges(chunk_size, dynamics):
    """Chunks of one token, a chunk that divides T exactly, T itself, and a chunk longer than T."""
    inp = bl_inputs(T=50, dynamics=dynamics, G=2, initial_state=True)
    o_r, var_r, (M_r, P_r) = bl_recurrent(**inp, output_final_state=True, return_variance=True)
    o_c, var_c, (M_c, P_c) = bl_chunk(**inp, output_final_state=True, return_variance=True,
                                      chunk_size=chunk_size)
    for a, b in ((o_c, o_r), (var_c, var_r), (M_c, M_r), (P_c, P_r)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("fn", [bl_recurrent, bl_chunk], ids=["recurrent", "chunk"])
def test_state_round_trip(fn):
    """Splitting a sequence in two and passing the state on gives the single call's result."""
    inp = bl_inputs(T=90, dynamics="rotation_scalar", G=2)
    o, (M, P) = fn(**inp, output_final_state=True)
    first = {k: (x[:, :41] if isinstance(x, torch.Tensor) else x) for k, x in inp.items()}
    second = {k: (x[:, 41:] if isinstance(x, torch.Tensor) else x) for k, x in inp.items()}
    o1, state1 = fn(**first, output_final_state=True)
    second["initial_state"] = state1
    o2, (M2, P2) = fn(**second, output_final_state=True)
    torch.testing.assert_close(torch.cat((o1, o2), 1), o, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(M2, M, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(P2, P, atol=ATOL, rtol=RTOL)


def test_per_head_p0_and_no_state_output():
    """``p0`` as an [H] tensor sets a per-head prior; ``output_final_state=False`` returns no state."""
    inp = bl_inputs(T=20, H=3, dynamics="scalar")
    p0 = torch.tensor([0.5, 1.0, 4.0], dtype=torch.float64)
    o_r, state_r = bl_recurrent(**inp, p0=p0)
    o_c, state_c = bl_chunk(**inp, p0=p0, chunk_size=8)
    assert state_r is None and state_c is None
    torch.testing.assert_close(o_c, o_r, atol=ATOL, rtol=RTOL)
    # each head uses its own p0: head h equals a scalar-p0 call with p0[h]
    for h in range(3):
        o_h, _ = bl_recurrent(**inp, p0=float(p0[h]))
        torch.testing.assert_close(o_r[:, :, h], o_h[:, :, h], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("fn", [bl_recurrent, bl_chunk], ids=["recurrent", "chunk"])
def test_empty_sequence_passes_the_state_through(fn):
    """T = 0 (e.g. an empty prefill): empty outputs, and the final state is the initial state."""
    inp = bl_inputs(T=0, G=2, dynamics="diagonal", initial_state=True)
    o, var, (M, P) = fn(**inp, output_final_state=True, return_variance=True)
    assert o.shape == (2, 0, 2, 4) and var.shape == (2, 0, 2, 2)
    torch.testing.assert_close(M, inp["initial_state"][0], atol=0, rtol=0)
    torch.testing.assert_close(P, inp["initial_state"][1], atol=0, rtol=0)


@pytest.mark.parametrize("T", [0, 5])
@pytest.mark.parametrize("fn", [bl_recurrent, bl_chunk], ids=["recurrent", "chunk"])
def test_an_empty_batch_gives_empty_outputs(fn, T):
    """B = 0: both paths return empty outputs and an empty state (the chunked path raised in amax())."""
    inp = bl_inputs(B=0, T=T, G=2, dynamics="diagonal", initial_state=True)
    o, var, (M, P) = fn(**inp, output_final_state=True, return_variance=True)
    assert o.shape == (0, T, 2, 4) and var.shape == (0, T, 2, 2)
    assert M.shape == (0, 2, 6, 4) and P.shape[0] == 0
