"""The prep kernel (docs/theory.md §6.7, F1) and the covariance kernel reading it.

``bl_chunk_prep_kernel`` (``ops/bayesian_layer/kernels_triton.py``, launched by
``ops/bayesian_layer/scan_triton.py::prep_triton``) computes every chunk's P-free terms — g, the in-chunk noise b, the
base of S, qᵀBq — parallel over chunks; its plain-PyTorch twin is ``ops/bayesian_layer/scan.py::prep_reference``
(``chunk_prep`` per chunk).  Under ``TRITON_INTERPRET=1`` on CPU, tiny shapes: the kernel equals the twin (float64 ≤
1e-12, float32 ≤ 2e-6 against the float64 twin) for scalar and diagonal decay, ragged last chunks, an empty sequence and
packed ``cu_seqlens``; the scan forward with the covariance kernel reading the prep buffers
(``prep=True``, the default) equals ``bl_chunk`` and the path without them in float64 ≤ 1e-12.
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


def _strong_inputs(NT, H, D, diagonal, seed):
    """Packed ``[NT, H, ·]`` float64 inputs with strong decays (α ∈ [0.6, 1]) and large noise, so that
    every ρ and b term differs clearly from 1 and 0 (typical decays would hide a wrong exponent)."""
    g = torch.Generator().manual_seed(seed)
    f = dict(dtype=torch.float64, generator=g)
    k = torch.nn.functional.normalize(torch.randn(NT, H, D, **f), dim=-1)
    q = torch.randn(NT, H, D, **f)
    r2 = 0.5 + torch.rand(NT, H, **f)
    ell2 = 0.1 + 0.4 * torch.rand(NT, H, **f)
    la = torch.log(0.6 + 0.4 * torch.rand(NT, H, D if diagonal else 1, **f))
    return tuple(x.to(DEVICE) for x in (q, k, r2, ell2, la))


@pytest.mark.parametrize(("diagonal", "D", "dtype"), [pytest.param(False, 8, torch.float64, marks=pytest.mark.slow),
                                                     (True, 20, torch.float64), (False, 20, torch.float32),
                                                     pytest.param(True, 8, torch.float32, marks=pytest.mark.slow)])
def test_prep_kernel_equals_twin(diagonal, D, dtype):
    """g, b, base, qᵀBq of every chunk == ``prep_reference``; D = 20 pads the second 16-channel block.
    Sequences of 37, 0 and 43 tokens, C = 16: ragged last chunks (5 and 11 tokens) and an empty one."""
    from bayeslayer.ops.bayesian_layer.scan_triton import prep_triton

    C, H = 16, 2
    cu = [0, 37, 37, 80]
    q, k, r2, ell2, la = _strong_inputs(cu[-1], H, D, diagonal, seed=D + diagonal)
    lay = scan.scan_layout(cu, C, 2, DEVICE)  # segments of 2 chunks: 2 + 1 (empty: 1) + 2
    bos, eos, first = scan.chunk_bounds(cu, C)
    assert (bos, eos, first) == ([0, 16, 32, 37, 53, 69], [16, 32, 37, 53, 69, 80], [0, 3, 3, 6])
    xs = [x.to(dtype) for x in (q, k, r2, ell2, la)]
    out = prep_triton(lay, *xs, dtype=dtype, want_var=True)
    ref = scan.prep_reference(k, r2, ell2, la, bos, eos, C, q=q)  # float64
    assert out.seg_first.tolist() == [0, 2, 3, 3, 5]  # the first chunk of every segment
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    for name, got in (("g", out.g), ("b", out.b), ("base", out.base), ("qBq", out.qBq)):
        want = ref[name]
        assert got.shape == want.shape, name
        assert _rel(got.double(), want) <= tol, name
    # the base is exactly symmetric, its padding rows are the no-op tokens' (r² = 1 on the diagonal, 0 elsewhere)
    assert torch.equal(out.base, out.base.transpose(-1, -2))
    pad = out.base[2, :, 5:, :]  # chunk 2 = tokens 32..36: rows 5.. are padding
    assert torch.equal(torch.diagonal(out.base[2], dim1=-2, dim2=-1)[:, 5:], torch.ones_like(pad[:, :, 0]))
    assert (pad.sum(-1) == 1.0).all()
    # row C − 1 of b is the chunk-end noise Σ_l ℓ_l² exp(2(g_end − g_l)) (the covariance kernel's b_end),
    # also in the ragged chunk 2 (tokens 32..36), where it is the last real row's
    gl = torch.cumsum(la[32:37], 0)
    b_end = (ell2[32:37, :, None] * torch.exp(2.0 * (gl[-1] - gl))).sum(0)
    assert _rel(out.b[2, :, -1, :].double(), b_end) <= tol
    assert _rel(out.b[2, :, 4, :].double(), b_end) <= tol


def test_prep_triton_bad_input():
    from bayeslayer.ops.bayesian_layer.scan_triton import prep_triton

    q, k, r2, ell2, la = _strong_inputs(20, 1, 8, False, seed=0)
    lay = scan.scan_layout([0, 20], 16, 1, DEVICE)
    with pytest.raises(TypeError, match="dtype"):
        prep_triton(lay, q, k, r2, ell2, la, dtype=torch.int32, want_var=False)
    with pytest.raises(ValueError, match="chunk_size"):
        scan.chunk_bounds([0, 20], 0)


@pytest.mark.parametrize("diagonal", [pytest.param(False, marks=pytest.mark.slow),
                                      pytest.param(True, marks=pytest.mark.slow)])
def test_phase_a_reads_the_prep_buffers(diagonal):
    """Phase A's covariance kernel with the prep buffers == the twin's elements (float64 ≤ 1e-12), and it
    really reads them: a perturbed base changes the elements."""
    from bayeslayer.ops.bayesian_layer.scan_triton import phase_a_triton, prep_triton

    T, H, D, m, C = 75, 2, 8, 4, 16
    q, k, v, r2, ell2, alpha = regime_inputs("stress", 1, T, H, D, m, diagonal=diagonal, seed=5, device=DEVICE)
    call = scan.prepare_scan(q, k, v, r2, ell2, alpha, 1.0, None, None, torch.tensor([0, 50, 75], device=DEVICE), C,
                             segment_chunks=1)
    lay = scan.scan_layout(call.cu, C, 1, q.device)
    segs = lay.element_segments
    xa = {name: lay.grid(x, fill) for name, x, fill in
          (("k", call.k, 0.0), ("r2", call.r2, 1.0), ("ell2", call.ell2, 0.0), ("la", call.log_alpha, 0.0))}
    ref = scan.phase_a(lay, xa, segs)
    args = (lay, call.q, call.k, call.r2, call.ell2, call.log_alpha, segs)
    pre = prep_triton(*args[:-1], dtype=torch.float64, want_var=False)
    out = phase_a_triton(*args, prep=pre)
    for a, b in zip(out[:3], ref[:3], strict=True):
        assert _rel(a, b) <= 1e-12
    assert not out[3].any()
    bad = pre._replace(base=pre.base * 1.5)
    assert _rel(phase_a_triton(*args, prep=bad)[1], ref[1]) > 1e-3
    with pytest.raises(TypeError, match="prep"):
        phase_a_triton(*args, prep=prep_triton(*args[:-1], dtype=torch.float32, want_var=False))


# Sequences of 1, 2 and 3 chunks in segments of 1 (the default case), or of 2, 4 and 5 chunks in segments of 2; the
# default case is also the default one of Phase B's kernel against the PyTorch scan (tests/ops/test_scan_triton.py).
@pytest.mark.parametrize(("diagonal", "regime", "cu", "segment_chunks", "seed"), [
    (False, "stress", [0, 10, 30, 70], 1, 7),
    pytest.param(True, "longmem", [0, 20, 70, 150], 2, 11, marks=pytest.mark.slow)],
    ids=["False-stress", "True-longmem"])  # the ids these cases had before they took cu and segment_chunks
def test_forward_scan_with_prep_equals_bl_chunk_fp64(diagonal, regime, cu, segment_chunks, seed):
    """The whole scan forward with the prep kernel (Phase A and C read its buffers; float64: one prep
    shared by both) and Phase B's kernel == ``bl_chunk``, == the PyTorch scan (ops/bayesian_layer/scan.py) and ==
    the scan without the prep kernel, float64 ≤ 1e-12; packed sequences of 1, 2 and 3 segments, ragged tails, the
    variance, an initial state.  A bad ``prep`` or ``phase_b`` is refused by name."""
    from bayeslayer.ops.bayesian_layer.scan_triton import forward_scan_triton

    H, D, m, C = 1, 8, 4, 16
    T = cu[-1]
    cu = torch.tensor(cu, device=DEVICE)
    q, k, v, r2, ell2, alpha = regime_inputs(regime, 1, T, H, D, m, diagonal=diagonal, seed=seed, device=DEVICE)
    M0, P0 = initial_bl_state(3, H, D, m, p0=0.5, dtype=torch.float64, device=DEVICE)
    M0 = M0 + 0.1
    ref = bl_chunk(q, k, v, r2, ell2, alpha, chunk_size=C, cu_seqlens=cu, initial_state=(M0, P0),
                   output_final_state=True, return_variance=True)
    args = (q, k, v, r2, ell2, alpha, 1.0, M0, P0, cu, C, True)
    t = {}
    out = forward_scan_triton(*args, segment_chunks=segment_chunks, timings=t)
    assert set(t) == {"prep", "phase_a", "phase_b", "phase_c", "substitute", "mean"}
    o, var, M, P = out
    assert max(_rel(o, ref[0]), _rel(var, ref[1]), _rel(M, ref[2][0]), _rel(P, ref[2][1])) <= 1e-12
    for a, b in zip(out, scan.forward_scan(*args, segment_chunks=segment_chunks), strict=True):
        assert _rel(a, b) <= 1e-12
    without = forward_scan_triton(*args, segment_chunks=segment_chunks, prep=False)
    for a, b in zip(out, without, strict=True):
        assert _rel(a, b) <= 1e-12
    with pytest.raises(TypeError, match="prep"):
        forward_scan_triton(*args, segment_chunks=segment_chunks, prep="yes")
    with pytest.raises(ValueError, match="phase_b"):
        forward_scan_triton(*args, segment_chunks=segment_chunks, phase_b="cuda")


@pytest.mark.parametrize("diagonal", [pytest.param(False, marks=pytest.mark.slow),
                                      pytest.param(True, marks=pytest.mark.slow)])
def test_forward_scan_with_prep_fp32(diagonal):
    """fp32 inputs: one fp32 prep (with qᵀBq) read by Phase A's float64 kernel (cast on load) and by Phase C;
    equals the scan without the prep kernel to fp32 rounding."""
    from bayeslayer.ops.bayesian_layer.scan_triton import forward_scan_triton

    H, D, m, C = 1, 8, 4, 16
    cu = torch.tensor([0, 45, 70], device=DEVICE)  # 3 + 2 chunks -> 2 + 1 segments of 2 chunks
    q, k, v, r2, ell2, alpha = regime_inputs("longmem", 1, 70, H, D, m, diagonal=diagonal, dtype=torch.float32,
                                             seed=12, device=DEVICE)
    args = (q, k, v, r2, ell2, alpha, 1.0, None, None, cu, C, True)
    out = forward_scan_triton(*args, segment_chunks=2)
    without = forward_scan_triton(*args, segment_chunks=2, prep=False)
    for a, b in zip(out, without, strict=True):
        assert _rel(a, b) <= 1e-5
