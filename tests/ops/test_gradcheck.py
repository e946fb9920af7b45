"""Finite-difference gradient checks of both paths on tiny problems.

``test_chunk_vs_recurrent`` shows the two paths' gradients agree; this shows they are the
gradients of the functions computed (``torch.autograd.gradcheck``: analytic vs central
differences in float64, in fast mode, i.e. along random directions), so a custom backward
added to either path later is checked too.
"""

from __future__ import annotations

import pytest
import torch

from bayeslayer.ops import bl_chunk, bl_recurrent

from .inputs import bl_inputs


@pytest.mark.parametrize("fn", [bl_recurrent, bl_chunk], ids=lambda f: f.__name__)
@pytest.mark.parametrize("dynamics", ["diagonal", "rotation_pairs"])
def test_gradcheck(fn, dynamics):
    inp = bl_inputs(B=1, T=6, H=1, D=4, m=2, G=2, dynamics=dynamics, initial_state=True)
    M0, P0 = inp.pop("initial_state")
    names = ["q", "k", "v", "r2", "ell2", "alpha", "theta"]
    tensors = [inp[n] for n in names if inp[n] is not None] + [M0, P0]
    present = [n for n in names if inp[n] is not None]
    kw = dict(chunk_size=4) if fn is bl_chunk else {}

    def f(*xs):
        args = dict(zip(present, xs[: len(present)], strict=True))
        M, P = xs[len(present):]
        P = 0.5 * (P + P.transpose(-1, -2))  # perturb within the symmetric matrices
        o, var, (M1, P1) = fn(args["q"], args["k"], args["v"], args["r2"], args["ell2"], alpha=args.get("alpha"),
                              theta=args.get("theta"), initial_state=(M, P), output_final_state=True,
                              return_variance=True, **kw)
        return o, var, M1, P1

    leaves = [x.detach().clone().requires_grad_() for x in tensors]
    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True)
