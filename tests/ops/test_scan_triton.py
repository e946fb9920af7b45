"""The segment-scan forward with Phase C on the Triton covariance kernel (``ops/triton/scan.py``).

Under ``TRITON_INTERPRET=1`` on CPU (tiny shapes: the interpreter runs the kernel's C-step
elimination in NumPy): float64 equality with ``bl_chunk`` for scalar and diagonal decay, several
segments, ragged tails and segment boundaries inside packed ``cu_seqlens``; fp32 against the
PyTorch twin.
"""

from __future__ import annotations

import os

import pytest
import torch

from bayeslayer.ops import bl_chunk, initial_bl_state, scan

from .scan_inputs import regime_inputs

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"),
    reason="Triton kernels need a CUDA device or TRITON_INTERPRET=1",
)


DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET", "0") != "1" else "cpu"


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize(("diagonal", "regime"), [(False, "longmem"), (True, "stress")])
def test_forward_scan_triton_equals_bl_chunk_fp64(diagonal, regime):
    from bayeslayer.ops.triton.scan import forward_scan_triton

    T, H, D, m, C = 75, 1, 8, 4, 16
    q, k, v, r2, ell2, alpha = regime_inputs(regime, 1, T, H, D, m, diagonal=diagonal, seed=3, device=DEVICE)
    cu = torch.tensor([0, 50, 75], device=DEVICE)  # 4 + 2 chunks, both ragged; segments of 2 chunks: 2 + 1
    M0, P0 = initial_bl_state(2, H, D, m, p0=0.7, dtype=torch.float64, device=DEVICE)
    M0 = M0 + 0.1
    ref = bl_chunk(q, k, v, r2, ell2, alpha, chunk_size=C, cu_seqlens=cu, initial_state=(M0, P0),
                   output_final_state=True, return_variance=True)
    t = {}
    o, var, M, P = forward_scan_triton(q, k, v, r2, ell2, alpha, 1.0, M0, P0, cu, C, True, segment_chunks=2,
                                       timings=t)
    assert max(_rel(o, ref[0]), _rel(var, ref[1]), _rel(M, ref[2][0]), _rel(P, ref[2][1])) <= 1e-12
    assert set(t) == {"prep", "phase_a", "phase_b", "phase_c", "substitute", "mean"}


@pytest.mark.parametrize(("diagonal", "G"), [(False, 2), (True, 1)])
def test_forward_scan_triton_fp32_equals_twin(diagonal, G):
    """fp32 inputs: Phase A in float64 buffers (per-channel decays cast for it), Phase C in fp32."""
    from bayeslayer.ops.triton.scan import forward_scan_triton

    T, H, D, m, C = 40, 1, 8, 4, 16
    q, k, v, r2, ell2, alpha = regime_inputs("longmem", 1, T, H, D, m, G=G, diagonal=diagonal, dtype=torch.float32,
                                             seed=4, device=DEVICE)
    args = (q, k, v, r2, ell2, alpha, 1.0, None, None, None, C, True)
    ref = scan.forward_scan(*args, segment_chunks=1, element_dtype=None)
    out = forward_scan_triton(*args, segment_chunks=1, mean=scan.mean_pass_reference)
    for a, b in zip(out, ref, strict=True):
        assert _rel(a, b) <= 1e-5


def test_forward_scan_triton_bad_input():
    from bayeslayer.ops.triton.scan import forward_scan_triton

    q, k, v, r2, ell2, alpha = regime_inputs("longmem", 1, 20, 1, 8, 4, device=DEVICE)
    with pytest.raises(ValueError, match="chunk_size"):
        forward_scan_triton(q, k, v, r2, ell2, alpha, 1.0, None, None, None, 8, False)


@pytest.mark.parametrize("diagonal", [False, True])
def test_phase_a_triton_equals_twin(diagonal):
    """Phase A on the kernels (covariance kernel from P = 0, β from kᵀw, tracking kernel) == the PyTorch twin."""
    from bayeslayer.ops.triton.scan import phase_a_triton

    T, H, D, m, C = 75, 2, 8, 4, 16
    q, k, v, r2, ell2, alpha = regime_inputs("stress", 1, T, H, D, m, diagonal=diagonal, seed=5, device=DEVICE)
    call = scan.prepare_scan(q, k, v, r2, ell2, alpha, 1.0, None, None, torch.tensor([0, 50, 75], device=DEVICE), C,
                             segment_chunks=1)
    lay = scan.scan_layout(call.cu, C, 1, q.device)
    segs = torch.tensor([0, 1, 2, 4], device=DEVICE)  # every segment but the last of each sequence (segments 3 and 5)
    xa = {name: lay.grid(x, fill) for name, x, fill in
          (("k", call.k, 0.0), ("r2", call.r2, 1.0), ("ell2", call.ell2, 0.0), ("la", call.log_alpha, 0.0))}
    ref = scan.phase_a(lay, xa, segs)
    out = phase_a_triton(lay, call.q, call.k, call.r2, call.ell2, call.log_alpha, segs)
    for a, b in zip(out[:3], ref[:3], strict=True):
        assert _rel(a, b) <= 1e-12
    assert not out[3].any()
    assert torch.linalg.matrix_norm(out[0], ord=2).min() > 0.1  # A_s far from 0 in this regime


def _elements(regime, D, diagonal, cu, seed):
    """Segment elements of a real Phase A (PyTorch twin, float64): segments of 2 chunks of 16."""
    C, n_s = 16, 2
    T = cu[-1]
    q, k, v, r2, ell2, alpha = regime_inputs(regime, 1, T, 2, D, 4, diagonal=diagonal, seed=seed, device=DEVICE)
    call = scan.prepare_scan(q, k, v, r2, ell2, alpha, 1.0, None, None, torch.tensor(cu, device=DEVICE), C,
                             segment_chunks=n_s)
    lay = scan.scan_layout(call.cu, C, n_s, q.device)
    xa = {name: lay.grid(x, fill) for name, x, fill in
          (("k", call.k, 0.0), ("r2", call.r2, 1.0), ("ell2", call.ell2, 0.0), ("la", call.log_alpha, 0.0))}
    segs = lay.element_segments
    A, Cm, J, info = scan.phase_a(lay, xa, segs)
    assert not info.any()
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(len(cu) - 1, 2, D, D, generator=g, dtype=torch.float64)
    P0 = (X @ X.transpose(-1, -2) / D + 0.1 * torch.eye(D, dtype=torch.float64)).to(DEVICE)
    return lay, P0, (A, Cm, J, segs)


@pytest.mark.parametrize(("regime", "D", "diagonal"), [("stress", 8, False), ("longmem", 40, True),
                                                       ("stress", 32, True)])
def test_phase_b_triton_equals_twin(regime, D, diagonal):
    """Phase B as one kernel (blocked LDLᵀ of P_s and of I + GᵀJG, 16×16 tl.dot tiles) == the PyTorch
    Cholesky form, float64 ≤ 1e-12; sequences with 3, 1 and 4 segments (ragged tails)."""
    from bayeslayer.ops.triton.scan import phase_b_triton

    lay, P0, el = _elements(regime, D, diagonal, [0, 70, 90, 210], seed=D)
    assert lay.seq_n_seg.tolist() == [3, 1, 4]
    ref, f_ref = scan.phase_b(lay, P0, el)
    out, failed = phase_b_triton(lay, P0, el)
    assert not f_ref.any() and not failed.any()
    assert _rel(out, ref) <= 1e-12
    later = [s for s in range(lay.n_segments) if s not in lay.seq_first_seg.tolist()]
    assert torch.equal(out[later], out[later].transpose(-1, -2))  # what the kernel writes is exactly symmetric
    assert torch.linalg.matrix_norm(el[0], ord=2).min() > 0.1  # the carried state matters


def test_phase_b_triton_flags_not_positive_definite():
    from bayeslayer.ops.triton.scan import phase_b_triton

    lay, P0, el = _elements("longmem", 8, False, [0, 70, 90], seed=1)
    P0[1, 0] = -torch.eye(8, dtype=P0.dtype)  # sequence 1 has one segment: never factored
    P0[0, 1] = -torch.eye(8, dtype=P0.dtype)
    _, failed = phase_b_triton(lay, P0, el)
    assert failed.tolist() == [[False, True], [False, False]]


@pytest.mark.parametrize(("regime", "diagonal"), [("longmem", False), ("stress", True)])
def test_forward_scan_triton_phase_b_kernel_equals_torch_scan(regime, diagonal):
    """Phases A, B (one kernel), C on Triton == the PyTorch scan (ops/scan.py), float64 ≤ 1e-12: packed
    sequences of 1, 2 and 3 segments (segments of 2 chunks of 16), ragged tails, an initial state."""
    from bayeslayer.ops.triton.scan import forward_scan_triton

    H, D, m, C = 1, 8, 4, 16
    cu = torch.tensor([0, 20, 70, 150], device=DEVICE)  # 2, 4, 5 chunks -> 1, 2, 3 segments
    q, k, v, r2, ell2, alpha = regime_inputs(regime, 1, 150, H, D, m, diagonal=diagonal, seed=7, device=DEVICE)
    M0, P0 = initial_bl_state(3, H, D, m, p0=0.5, dtype=torch.float64, device=DEVICE)
    args = (q, k, v, r2, ell2, alpha, 1.0, M0 + 0.1, P0, cu, C, True)
    ref = scan.forward_scan(*args, segment_chunks=2)
    out = forward_scan_triton(*args, segment_chunks=2, phase_b="triton")
    for a, b in zip(out, ref, strict=True):
        assert _rel(a, b) <= 1e-12
    with pytest.raises(ValueError, match="phase_b"):
        forward_scan_triton(*args, segment_chunks=2, phase_b="cuda")
