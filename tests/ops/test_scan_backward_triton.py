"""The Triton backward of the covariance segment scan (``ops/triton/scan_backward.py``) against its twin.

Under ``TRITON_INTERPRET=1`` on CPU tensors (tiny shapes), each kernel against the plain-PyTorch twin
:mod:`bayeslayer.ops.scan_backward` (itself tested against autograd, ``tests/ops/test_scan_backward.py``),
in the design note's stress / long-memory regimes (asserted: the segment transitions are far from 0).
"""

from __future__ import annotations

import os

import pytest
import torch

from bayeslayer.ops import scan
from bayeslayer.ops import scan_backward as sb

from .scan_inputs import regime_inputs

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"),
    reason="Triton kernels need a CUDA device or TRITON_INTERPRET=1",
)

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET", "0") != "1" else "cpu"
F64 = torch.float64


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _sym(X):
    return 0.5 * (X + X.transpose(-1, -2))


def _scan_state(regime, D, diagonal, cu, seed, *, C=16, n_s=2, H=2):
    """A real forward: layout, Phase A elements (twin, float64) and Phase B checkpoints of packed sequences."""
    T = cu[-1]
    q, k, v, r2, ell2, alpha = regime_inputs(regime, 1, T, H, D, 4, diagonal=diagonal, seed=seed, device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(len(cu) - 1, H, D, D, generator=g, dtype=F64)
    P0 = (X @ X.transpose(-1, -2) / D + 0.1 * torch.eye(D, dtype=F64)).to(DEVICE)
    call = scan.prepare_scan(q, k, v, r2, ell2, alpha, 1.0, None, None, torch.tensor(cu, device=DEVICE), C,
                             segment_chunks=n_s)
    lay = scan.scan_layout(call.cu, C, n_s, q.device)
    xa = {name: lay.grid(x, fill) for name, x, fill in
          (("k", call.k, 0.0), ("r2", call.r2, 1.0), ("ell2", call.ell2, 0.0), ("la", call.log_alpha, 0.0))}
    segs = lay.element_segments
    A, Cm, J, info = scan.phase_a(lay, xa, segs)
    assert not info.any()
    P_starts, failed = scan.phase_b(lay, P0, (A, Cm, J, segs))
    assert not failed.any()
    return call, lay, P0, P_starts, A, J


# ---------------------------------------------------------------------------------------------------
# B3
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("regime", "D", "diagonal"), [("stress", 8, False), ("stress", 32, True),
                                                       ("longmem", 40, False)])
def test_reverse_segments_triton_equals_twin(regime, D, diagonal):
    """B3 as one kernel == ``reverse_segments(element_transition(...))``, float64 ≤ 1e-12: packed sequences of
    1, 2 and 3 segments (2, 4, 5 chunks of 16, segments of 2 chunks); D = 8, 32, 40 (one, two and a padded
    four 16×16 blocks)."""
    from bayeslayer.ops.triton.scan_backward import reverse_segments_triton

    _, lay, _, P_starts, A, J = _scan_state(regime, D, diagonal, [0, 20, 70, 150], seed=D)
    assert lay.seq_n_seg.tolist() == [1, 2, 3]
    assert torch.linalg.matrix_norm(A, ord=2).min() > 0.1  # the carried adjoint matters
    g = torch.Generator().manual_seed(D + 1)
    G = _sym(torch.randn(P_starts.shape, generator=g, dtype=F64)).to(DEVICE)
    segs = lay.element_segments
    ref = sb.reverse_segments(lay, G, sb.element_transition(A, J, P_starts[segs]))
    out, failed = reverse_segments_triton(lay, G, P_starts, A, J)
    assert not failed.any()
    assert _rel(out, ref) <= 1e-12
    assert torch.equal(out, out.transpose(-1, -2))  # written exactly symmetric
    last = lay.last_segments
    assert torch.equal(out[last], G[last])  # the last segment of a sequence keeps its total adjoint
    assert _rel(out[segs], G[segs]) > 1e-3  # and the others really carry something
    # a wrong transition (Ā without the (I + PJ)⁻¹ factor) is visibly different: the comparison can fail
    wrong = sb.reverse_segments(lay, G, A)
    assert _rel(wrong, ref) > 1e-3


def test_reverse_segments_triton_flags_and_bad_input():
    from bayeslayer.ops.triton.scan_backward import reverse_segments_triton

    _, lay, _, P_starts, A, J = _scan_state("longmem", 8, False, [0, 20, 70], seed=2)
    G = torch.zeros_like(P_starts)
    bad = P_starts.clone()
    bad[lay.seq_first_seg[1], 1] = -torch.eye(8, dtype=F64)  # sequence 1, head 1: P_s not positive definite
    _, failed = reverse_segments_triton(lay, G, bad, A, J)
    assert failed.tolist() == [[False, False], [False, True]]
    with pytest.raises(ValueError, match="P_starts"):
        reverse_segments_triton(lay, G, P_starts[:1], A, J)
    with pytest.raises(ValueError, match="J"):
        reverse_segments_triton(lay, G, P_starts, A, J[:, :1])
    with pytest.raises(TypeError, match="lay"):
        reverse_segments_triton(None, G, P_starts, A, J)
