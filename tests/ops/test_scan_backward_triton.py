"""The Triton backward of the covariance segment scan (``ops/bayesian_layer/scan_backward_triton.py``) against its twin.

Under ``TRITON_INTERPRET=1`` on CPU tensors (tiny shapes), each kernel against the plain-PyTorch twin
:mod:`bayeslayer.ops.bayesian_layer.scan_backward` (itself tested against autograd,
``tests/ops/test_scan_backward.py``), in docs/theory.md §6.6's stress / long-memory regimes (asserted: the segment
transitions are far from 0).
"""

from __future__ import annotations

import os

import pytest
import torch

from bayeslayer.ops.bayesian_layer import scan
from bayeslayer.ops.bayesian_layer import scan_backward as sb

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

@pytest.mark.parametrize(("regime", "D", "diagonal"), [("stress", 8, False),
                                                       pytest.param("stress", 32, True, marks=pytest.mark.slow),
                                                       pytest.param("longmem", 40, False, marks=pytest.mark.slow)])
def test_reverse_segments_triton_equals_twin(regime, D, diagonal):
    """B3 as one kernel == ``reverse_segments(element_transition(...))``, float64 ≤ 1e-12: packed sequences of
    1, 2 and 3 segments (2, 4, 5 chunks of 16, segments of 2 chunks); D = 8, 32, 40 (one, two and a padded
    four 16×16 blocks)."""
    from bayeslayer.ops.bayesian_layer.scan_backward_triton import reverse_segments_triton

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
    from bayeslayer.ops.bayesian_layer.scan_backward_triton import reverse_segments_triton

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


# ---------------------------------------------------------------------------------------------------
# B2 / B4
# ---------------------------------------------------------------------------------------------------

GRID_FILL = (("q", "q", 0.0), ("k", "k", 0.0), ("v", "v", 0.0), ("r2", "r2", 1.0), ("ell2", "ell2", 0.0),
             ("la", "log_alpha", 0.0))


def _adjoint_case(regime, D, cu, n_s, seed, dtype=F64, H=1, diagonal=False):
    """A forward of the PyTorch scan (float64), random adjoints on every output (packed), in ``dtype``."""
    call, lay, _, _, _, _ = _scan_state(regime, D, diagonal, cu, seed, n_s=n_s, H=H)
    out = scan.covariance_scan(call.q, call.k, call.v, call.r2, call.ell2, call.log_alpha, call.P0, call.cu, call.C,
                               segment_chunks=n_s, want_var=True)
    g = torch.Generator().manual_seed(seed + 11)
    adj = {name: torch.randn(getattr(out, attr).shape, generator=g, dtype=F64).to(DEVICE)
           for name, attr in (("w", "w"), ("beta", "beta"), ("linv", "linv"), ("variance", "variance"),
                              ("kw", "kw"), ("vu", "vu"), ("g", "g"))}
    end_bar = _sym(torch.randn(out.P_starts.shape, generator=g, dtype=F64)).to(DEVICE)
    cast = {name: getattr(call, name).to(dtype) for name in ("q", "k", "v", "r2", "ell2", "log_alpha")}
    return lay, cast, {n: x.to(dtype) for n, x in adj.items()}, out.P_starts.to(dtype), end_bar.to(dtype)


def _twin_segment_adjoint(lay, x, adj, P_starts, end_bar, inputs):
    xs = {name: lay.grid(x[src], fill) for name, src, fill in GRID_FILL}
    dxs = {name: lay.grid(a, 0.0) for name, a in adj.items()}
    dP, gr = sb.segment_adjoint(lay, xs, dxs, P_starts, end_bar, inputs=inputs)
    NT = x["k"].shape[0]
    return dP, ({name: lay.scatter(t, NT) for name, t in gr.items()} if inputs else None)


LONG, SHORT = ([0, 40, 150], 3), ([0, 30, 105], 2)  # (cu, chunks per segment): 1 + 3 segments either way


@pytest.mark.parametrize(("D", "inputs", "diagonal", "H", "case"), [
    pytest.param(16, True, False, 2, LONG, marks=pytest.mark.slow),
    pytest.param(24, True, False, 1, LONG, marks=pytest.mark.slow),
    (16, False, False, 1, SHORT),
    pytest.param(16, True, True, 1, LONG, marks=pytest.mark.slow),
    pytest.param(24, True, True, 2, LONG, marks=pytest.mark.slow)],
    ids=["16-True-False-2", "24-True-False-1", "16-False-False-1", "16-True-True-1", "24-True-True-2"])
def test_segment_adjoint_triton_equals_twin_fp64(D, inputs, diagonal, H, case):
    """B2 (start adjoints only) and B4 (and every input gradient), scalar and diagonal decay, float64 ≤ 1e-12:
    packed sequences of 40 and 110 tokens (3 and 7 chunks of 16, ragged tails) in segments of 3 chunks, or (B2,
    the default case) of 30 and 75 tokens (2 and 5 chunks) in segments of 2: 1 + 3 segments; D = 24 pads the key
    dim to 32; H' = 1 and 2."""
    from bayeslayer.ops.bayesian_layer.scan_backward_triton import segment_adjoint_triton

    lay, x, adj, P_starts, end_bar = _adjoint_case("stress", D, *case, seed=D, diagonal=diagonal, H=H)
    assert lay.seq_n_seg.tolist() == [1, 3]
    ref_dP, ref = _twin_segment_adjoint(lay, x, adj, P_starts, end_bar, inputs)
    dP, gr, failed = segment_adjoint_triton(lay, x["q"], x["k"], x["v"], x["r2"], x["ell2"], x["log_alpha"], adj,
                                            P_starts, end_bar, inputs=inputs)
    assert not failed.any()
    assert _rel(dP, ref_dP) <= 1e-12, _rel(dP, ref_dP)
    if inputs:
        for name in ("q", "k", "v", "r2", "ell2", "la"):
            assert ref[name].abs().max() > 0
            assert _rel(gr[name], ref[name]) <= 1e-12, (name, _rel(gr[name], ref[name]))
    else:
        assert gr is None


@pytest.mark.parametrize("diagonal", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_segment_adjoint_triton_fp32(diagonal):
    """float32 inputs and adjoints (B4 in float32, long-memory regime) against the float64 twin: every gradient
    within 5e-6 relative (max error over the largest entry; measured 1.6e-7 – 6.2e-7 scalar, 1.2e-7 – 4.9e-7
    diagonal).  Packed sequences of 30 and 75 tokens (2 and 5 chunks of 16, ragged tails), segments of 2 chunks
    → 1 + 3 segments."""
    from bayeslayer.ops.bayesian_layer.scan_backward_triton import segment_adjoint_triton

    lay, x64, adj64, P64, end64 = _adjoint_case("longmem", 16, *SHORT, seed=5, diagonal=diagonal)
    lay, x, adj, P_starts, end_bar = _adjoint_case("longmem", 16, *SHORT, seed=5, dtype=torch.float32,
                                                   diagonal=diagonal)
    assert lay.seq_n_seg.tolist() == [1, 3]
    ref_dP, ref = _twin_segment_adjoint(lay, x64, adj64, P64, end64, True)
    dP, gr, failed = segment_adjoint_triton(lay, x["q"], x["k"], x["v"], x["r2"], x["ell2"], x["log_alpha"], adj,
                                            P_starts, end_bar, inputs=True)
    assert not failed.any()
    assert gr["k"].dtype == torch.float32
    errs = {"P": _rel(dP.double(), ref_dP)} | {n: _rel(gr[n].double(), ref[n]) for n in ref}
    assert max(errs.values()) <= 5e-6, errs  # measured 6.2e-7 (k)


def _full_case(T, cu, n_s, seed, D=16, diagonal=False):
    call, lay, _, _, _, _ = _scan_state("stress", D, diagonal, cu if cu is not None else [0, T], seed, n_s=n_s, H=1)
    out = scan.covariance_scan(call.q, call.k, call.v, call.r2, call.ell2, call.log_alpha, call.P0, call.cu, call.C,
                               segment_chunks=n_s, want_var=True)
    g = torch.Generator().manual_seed(seed + 3)
    cot = {n: torch.randn(getattr(out, n).shape, generator=g, dtype=F64).to(DEVICE)
           for n in ("w", "beta", "linv", "variance", "kw", "vu", "g", "P")}
    args = (call.q, call.k, call.v, call.r2, call.ell2, call.log_alpha, call.P0, call.cu, call.C)
    kw = dict(segment_chunks=n_s, P_starts=out.P_starts, dw=cot["w"], dbeta=cot["beta"], dlinv=cot["linv"],
              dvariance=cot["variance"], dkw=cot["kw"], dvu=cot["vu"], dg=cot["g"], dP=cot["P"])
    return lay, args, kw


@pytest.mark.parametrize("diagonal", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_covariance_scan_backward_triton_equals_autograd(diagonal):
    """B2 + Phase A (kernels) + B3 + B4 == autograd through ``scan.covariance_scan`` and == the twin
    ``covariance_scan_backward``, float64, stress regime, scalar and diagonal decay, sequences of 1 and 3
    segments with ragged tails and an empty one, an adjoint on every output.  Tolerance 1e-10, the twin's
    own against autograd (``tests/ops/test_scan_backward.py``): in this regime the segment map is
    ill-conditioned (cond(I + PJ) ≈ 6e3, ‖Ā‖₂ ≈ 11 on a longer case) and rounding differences of ~1e-14 in
    Ā or a carried adjoint reach the start adjoint ``dP0`` amplified (measured, scalar: twin vs autograd
    3.0e-12, kernels vs autograd 3.3e-12; every other gradient ≤ 6.9e-13); each kernel alone matches its twin
    to ≤ 1e-12 (the tests above).  Sequences of 30, 0 and 75 tokens in segments of 2 chunks: 1, 1 (empty) and
    3 segments."""
    from bayeslayer.ops.bayesian_layer.scan_backward_triton import covariance_scan_backward_triton

    lay, args, kw = _full_case(None, [0, 30, 30, 105], 2, seed=9, diagonal=diagonal)  # an empty sequence too
    assert lay.seq_n_seg.tolist() == [1, 1, 3]
    names = ("q", "k", "v", "r2", "ell2", "log_alpha", "P0")
    leaves = [a.clone().requires_grad_(True) for a in args[:7]]
    fwd = scan.covariance_scan(*leaves, args[7], args[8], segment_chunks=2, want_var=True)
    cot = dict(w="dw", beta="dbeta", linv="dlinv", variance="dvariance", kw="dkw", vu="dvu", g="dg", P="dP")
    auto = dict(zip(names, torch.autograd.grad(sum((getattr(fwd, n) * kw[c]).sum() for n, c in cot.items()), leaves),
                    strict=True))
    auto["P0"] = _sym(auto["P0"])
    with torch.no_grad():
        ref = sb.covariance_scan_backward(*args, **kw)
        out, failed = covariance_scan_backward_triton(*args, **kw)
    assert not failed.any()
    for name in names:
        a = getattr(out, name)
        assert auto[name].abs().max() > 0
        assert _rel(a, auto[name]) <= 1e-10, (name, _rel(a, auto[name]))
        assert _rel(a, getattr(ref, name)) <= 1e-10, (name, _rel(a, getattr(ref, name)))
    xs = {name: lay.grid(args[i], fill) for name, i, fill in (("k", 1, 0.0), ("r2", 3, 1.0), ("ell2", 4, 0.0),
                                                                ("la", 5, 0.0))}
    A = scan.phase_a(lay, xs, lay.element_segments)[0]
    assert torch.linalg.matrix_norm(A, ord=2).min() > 0.1  # the carried adjoint matters
    with pytest.raises(ValueError, match="log_alpha"):
        bad = list(args)
        bad[5] = args[5][..., :1].expand(*args[5].shape[:2], 3)
        covariance_scan_backward_triton(*bad, **kw)


@pytest.mark.slow  # a launch count, not a value: the backward's results are checked by the default cases above
def test_backward_launches_do_not_grow_with_chunks(monkeypatch):
    """The Triton backward launches the same kernels, once each, for 4 and for 16 chunks (2 and 4 segments)."""
    import triton.runtime.interpreter as ti
    import triton.runtime.jit as tj

    from bayeslayer.ops.bayesian_layer.scan_backward_triton import covariance_scan_backward_triton

    launches = []
    for cls in (ti.InterpretedFunction, tj.JITFunction):
        orig = cls.run

        def counted(self, *a, _orig=orig, **kw):
            launches.append(self.__name__ if isinstance(self, ti.InterpretedFunction) else self.fn.__name__)
            return _orig(self, *a, **kw)

        monkeypatch.setattr(cls, "run", counted)

    def run(T, n_s):
        launches.clear()
        lay, args, kw = _full_case(T, None, n_s, seed=T)
        covariance_scan_backward_triton(*args, **kw)
        return list(launches), lay

    few, lay4 = run(64, 2)  # 4 chunks of 16, 2 segments
    many, lay16 = run(256, 4)  # 16 chunks, 4 segments
    assert (lay4.n_segments, lay16.n_segments) == (2, 4)
    assert few == many
    assert sorted(set(few)) == sorted(["scan_segment_adjoint_kernel", "bl_chunk_cov_kernel", "scan_track_kernel",
                                       "scan_reverse_kernel"])
    assert few.count("scan_segment_adjoint_kernel") == 2 and len(few) == 5


def test_segment_adjoint_tiles():
    """The launch constants: D and MV padded to powers of two ≥ 16, 16-wide blocks, 8 warps from C = 32; bad
    arguments refused by name."""
    from bayeslayer.ops.bayesian_layer.scan_backward_triton import segment_adjoint_tiles

    assert segment_adjoint_tiles(24, 8, 16) == dict(BD=32, BM=16, BK=16, BV=16, num_warps=4)
    assert segment_adjoint_tiles(64, 128, 64) == dict(BD=64, BM=128, BK=16, BV=16, num_warps=8)
    assert segment_adjoint_tiles(64, 64, 32)["num_warps"] == 8
    for bad in (dict(D=0, MV=8, C=16), dict(D=16, MV=True, C=16), dict(D=16, MV=8, C=16.0)):
        name = next(n for n, x in bad.items() if not (isinstance(x, int) and not isinstance(x, bool) and x > 0))
        with pytest.raises(ValueError, match=f"{name} must be a positive int"):
            segment_adjoint_tiles(**bad)


def test_segment_adjoint_triton_bad_input():
    """Refused before any launch, with the argument named."""
    from bayeslayer.ops.bayesian_layer.scan_backward_triton import segment_adjoint_triton

    lay, x, adj, P_starts, end_bar = _adjoint_case("longmem", 16, [0, 40], 3, seed=1)
    args = [x[n] for n in ("q", "k", "v", "r2", "ell2", "log_alpha")]
    with pytest.raises(ValueError, match="adjoints\\['w'\\]"):
        segment_adjoint_triton(lay, *args, {**adj, "w": adj["w"].float()}, P_starts, end_bar, inputs=True)
    with pytest.raises(ValueError, match="adjoints must be"):
        segment_adjoint_triton(lay, *args, {"dw": adj["w"]}, P_starts, end_bar, inputs=True)
    with pytest.raises(ValueError, match="P_end_bar"):
        segment_adjoint_triton(lay, *args, adj, P_starts, end_bar[..., :8], inputs=True)
    with pytest.raises(ValueError, match="ell2"):
        bad = list(args)
        bad[4] = bad[4].float()
        segment_adjoint_triton(lay, *bad, adj, P_starts, end_bar, inputs=True)
    with pytest.raises(ValueError, match="log_alpha"):
        bad = list(args)
        bad[5] = bad[5].expand(*bad[5].shape[:2], 3)
        segment_adjoint_triton(lay, *bad, adj, P_starts, end_bar, inputs=True)
    with pytest.raises(TypeError, match="lay"):
        segment_adjoint_triton(None, *args, adj, P_starts, end_bar, inputs=True)
    with pytest.raises(ValueError, match="chunk_states"):
        segment_adjoint_triton(lay, *args, adj, P_starts, end_bar, inputs=True, replay=False)
