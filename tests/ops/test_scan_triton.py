"""The segment-scan forward with Phase C on the Triton covariance kernel (``ops/bayesian_layer/scan_triton.py``).

Under ``TRITON_INTERPRET=1`` on CPU (tiny shapes: the interpreter runs the kernel's C-step
elimination in NumPy): float64 equality with ``bl_chunk`` for scalar and diagonal decay, several
segments, ragged tails and segment boundaries inside packed ``cu_seqlens``; fp32 against the
PyTorch twin.
"""

from __future__ import annotations

import os

import pytest
import torch

from bayeslayer.ops import bl_chunk, initial_bl_state
from bayeslayer.ops.bayesian_layer import scan

from .scan_inputs import regime_inputs

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"),
    reason="Triton kernels need a CUDA device or TRITON_INTERPRET=1",
)


DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET", "0") != "1" else "cpu"


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize(("diagonal", "regime"), [pytest.param(False, "longmem", marks=pytest.mark.slow),
                                                  (True, "stress")])
def test_forward_scan_triton_equals_bl_chunk_fp64(diagonal, regime):
    from bayeslayer.ops.bayesian_layer.scan_triton import forward_scan_triton

    T, H, D, m, C = 60, 1, 8, 4, 16
    q, k, v, r2, ell2, alpha = regime_inputs(regime, 1, T, H, D, m, diagonal=diagonal, seed=3, device=DEVICE)
    cu = torch.tensor([0, 40, 60], device=DEVICE)  # 3 + 2 chunks, both ragged; segments of 2 chunks: 2 + 1
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
    """fp32 inputs: Phase A's state in float64, its per-token hand-off (W, L⁻¹ rows, L⁻¹(γ⊙K)) and the prep it
    reads in fp32; Phase C in fp32."""
    from bayeslayer.ops.bayesian_layer.scan_triton import forward_scan_triton

    T, H, D, m, C = 40, 1, 8, 4, 16
    q, k, v, r2, ell2, alpha = regime_inputs("longmem", 1, T, H, D, m, G=G, diagonal=diagonal, dtype=torch.float32,
                                             seed=4, device=DEVICE)
    args = (q, k, v, r2, ell2, alpha, 1.0, None, None, None, C, True)
    ref = scan.forward_scan(*args, segment_chunks=1, element_dtype=None)
    out = forward_scan_triton(*args, segment_chunks=1, mean=scan.mean_pass_reference)
    for a, b in zip(out, ref, strict=True):
        assert _rel(a, b) <= 1e-5


def test_forward_scan_triton_bad_input():
    from bayeslayer.ops.bayesian_layer.scan_triton import forward_scan_triton

    q, k, v, r2, ell2, alpha = regime_inputs("longmem", 1, 20, 1, 8, 4, device=DEVICE)
    with pytest.raises(ValueError, match="chunk_size"):
        forward_scan_triton(q, k, v, r2, ell2, alpha, 1.0, None, None, None, 8, False)


@pytest.mark.parametrize("diagonal", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_phase_a_triton_equals_twin(diagonal):
    """Phase A on the kernels (covariance kernel from P = 0, β from kᵀw, tracking kernel) == the PyTorch twin."""
    from bayeslayer.ops.bayesian_layer.scan_triton import phase_a_triton

    T, H, D, m, C = 60, 2, 8, 4, 16
    q, k, v, r2, ell2, alpha = regime_inputs("stress", 1, T, H, D, m, diagonal=diagonal, seed=5, device=DEVICE)
    call = scan.prepare_scan(q, k, v, r2, ell2, alpha, 1.0, None, None, torch.tensor([0, 40, 60], device=DEVICE), C,
                             segment_chunks=1)
    lay = scan.scan_layout(call.cu, C, 1, q.device)
    segs = torch.tensor([0, 1, 3], device=DEVICE)  # every segment but the last of each sequence (segments 2 and 4)
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


@pytest.mark.parametrize(("regime", "D", "diagonal"), [("stress", 8, False),
                                                       pytest.param("longmem", 40, True, marks=pytest.mark.slow),
                                                       pytest.param("stress", 32, True, marks=pytest.mark.slow)])
def test_phase_b_triton_equals_twin(regime, D, diagonal):
    """Phase B as one kernel (blocked LDLᵀ of P_s and of I + GᵀJG, 16×16 tl.dot tiles) == the PyTorch
    Cholesky form, float64 ≤ 1e-12; sequences with 3, 1 and 4 segments (ragged tails)."""
    from bayeslayer.ops.bayesian_layer.scan_triton import phase_b_triton

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
    from bayeslayer.ops.bayesian_layer.scan_triton import phase_b_triton

    lay, P0, el = _elements("longmem", 8, False, [0, 40, 60], seed=1)  # 2 segments, then 1
    P0[1, 0] = -torch.eye(8, dtype=P0.dtype)  # sequence 1 has one segment: never factored
    P0[0, 1] = -torch.eye(8, dtype=P0.dtype)
    _, failed = phase_b_triton(lay, P0, el)
    assert failed.tolist() == [[False, True], [False, False]]


# Sequences of 2, 4, 5 chunks in segments of 2.  The default case (stress, scalar decay, 1, 2, 3 chunks in segments
# of 1: the same inputs) is checked against this PyTorch scan by test_forward_scan_with_prep_equals_bl_chunk_fp64
# (tests/ops/test_scan_prep.py), which runs that forward anyway; the diagonal decay's Phase B runs by default in
# test_forward_scan_triton_equals_bl_chunk_fp64.
@pytest.mark.slow
@pytest.mark.parametrize(("regime", "diagonal", "cu", "segment_chunks"), [
    ("longmem", False, [0, 20, 70, 150], 2), ("stress", True, [0, 20, 70, 150], 2)],
    ids=["longmem-scalar-long", "stress-diagonal-long"])
def test_forward_scan_triton_phase_b_kernel_equals_torch_scan(regime, diagonal, cu, segment_chunks):
    """Phases A, B (one kernel), C on Triton == the PyTorch scan (ops/bayesian_layer/scan.py), float64 ≤ 1e-12: packed
    sequences of 1, 2 and 3 segments, ragged tails, an initial state."""
    from bayeslayer.ops.bayesian_layer.scan_triton import forward_scan_triton

    H, D, m, C = 1, 8, 4, 16
    T = cu[-1]
    cu = torch.tensor(cu, device=DEVICE)
    q, k, v, r2, ell2, alpha = regime_inputs(regime, 1, T, H, D, m, diagonal=diagonal, seed=7, device=DEVICE)
    M0, P0 = initial_bl_state(3, H, D, m, p0=0.5, dtype=torch.float64, device=DEVICE)
    args = (q, k, v, r2, ell2, alpha, 1.0, M0 + 0.1, P0, cu, C, True)
    ref = scan.forward_scan(*args, segment_chunks=segment_chunks)
    out = forward_scan_triton(*args, segment_chunks=segment_chunks, phase_b="triton")
    for a, b in zip(out, ref, strict=True):
        assert _rel(a, b) <= 1e-12
    with pytest.raises(ValueError, match="phase_b"):
        forward_scan_triton(*args, segment_chunks=segment_chunks, phase_b="cuda")


@pytest.mark.parametrize(("dtype", "diagonal"), [(torch.float32, False),
                                                 pytest.param(torch.bfloat16, True, marks=pytest.mark.slow)],
                         ids=["fp32-scalar", "bf16-diagonal"])
def test_forward_allocates_no_token_sized_float64(dtype, diagonal):
    """The fp32/bf16 forward (prep, Phase A, B, C, mean pass; 4 segments per sequence, so Phase A and B run)
    allocates no float64 tensor of NT·H'·D elements or more: float64 is only the D×D state, the segment
    elements and per-segment scratch.  Every tensor an ATen op returns is recorded (``TorchDispatchMode``),
    allocations included; before the hand-offs became the compute dtype, Phase A's W and ``L⁻¹(γ⊙K)`` were
    float64 ``[NT, H', D]`` (and its prep, the per-channel decays, β's ``k`` a float64 copy each)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from bayeslayer.ops.bayesian_layer.scan_triton import forward_scan_triton

    # T = 12·D: the per-segment float64 scratch (4 segments: 2112 elements, the largest) stays below NT·H'·D = 3072
    B, T, H, D, m, C = 1, 192, 1, 16, 8, 16
    q, k, v, r2, ell2, alpha = regime_inputs("longmem", B, T, H, D, m, diagonal=diagonal, seed=5, dtype=dtype,
                                             device=DEVICE)
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for x in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(x, torch.Tensor):
                    seen.append((str(func), x.dtype, x.numel()))
            return out

    timings = {}
    with Record():
        o, _, M, P = forward_scan_triton(q, k, v, r2, ell2, alpha, 1.0, None, None, None, C, True, n_segments=4,
                                         timings=timings)
    assert torch.isfinite(o.float()).all() and torch.isfinite(P).all()
    assert o.dtype == dtype
    f64 = [(f, n) for f, dt, n in seen if dt == torch.float64]
    assert any(n == 4 * H * D * D for _, n in f64)  # the segment starts of Phase B: the check sees float64
    big = [(f, n) for f, n in f64 if n >= B * T * H * D]
    assert not big, f"float64 tensors of >= NT·H'·D = {B * T * H * D} elements: {big}"


def test_cov_precision_reaches_phase_c():
    """``cov_precision="tf32x3"`` compiles Phase C's covariance kernel with split-precision products (the compile
    key says so; Phase A's float64 kernel stays IEEE); the interpreter ignores ``input_precision``, so the outputs
    equal the IEEE run's here (the error of tf32x3 is measured by emulation: ``benchmarks/scan_precision.py``).
    A bad value is refused by name."""
    from bayeslayer.ops.bayesian_layer.scan_triton import forward_scan_triton

    from ..triton_spy import compile_keys

    q, k, v, r2, ell2, alpha = regime_inputs("longmem", 1, 32, 1, 8, 4, dtype=torch.float32, seed=6, device=DEVICE)
    args = (q, k, v, r2, ell2, alpha, 1.0, None, None, None, 16, True)
    with compile_keys() as keys:
        split = forward_scan_triton(*args, n_segments=2, cov_precision="tf32x3")
    cov = keys["bl_chunk_cov_kernel"]
    assert len(cov) == 2  # Phase A (float64 state, IEEE) and Phase C (tf32x3)
    assert sum("'tf32x3'" in key for key in cov) == 1 and sum("'ieee'" in key for key in cov) == 1
    ieee = forward_scan_triton(*args, n_segments=2)
    for a, b in zip(split, ieee, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="cov_precision"):
        forward_scan_triton(*args, cov_precision="tf32")
