"""Triton kernels vs the PyTorch chunk path, run on CPU in Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before Triton is first imported, so it is set
here at import time (it only affects this process' Triton; nothing else in the
suite launches Triton kernels).  Default run: a few small shapes (seconds);
``pytest -m slow tests/ops/test_triton.py`` runs the full grid.

Tolerances: fp64 inputs run the kernels in fp64 and must match to 1e-10
(observed ~1e-15); fp32 inputs to 2e-4 relative to the output scale; bf16/fp16
inputs are compared after both paths cast the same rounded inputs to fp32, to
the bf16/fp16 output rounding (1e-2).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from bayeslayer.ops import BackendError, bl_chunk, bl_step, initial_bl_state  # noqa: E402
from bayeslayer.ops.bayesian_layer.chunk_triton import bl_chunk_triton, triton_available
from bayeslayer.ops.bayesian_layer.step_triton import bl_step_triton  # noqa: E402

from ..triton_spy import triton_only  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton kernels need a CUDA device or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def make_inputs(B, T, H, D, m, *, decay="scalar", G=1, dtype=torch.float64, seed=0, strong=False):
    """Random inputs in the regime the layer runs in: unit-norm keys, r² ~ 0.1..1.1, α ~ 0.9..1."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def uni(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    q = rnd(B, T, H, D) / D**0.5
    k = torch.nn.functional.normalize(rnd(B, T, H, D), dim=-1)
    v = rnd(B, T, H, m)
    r2 = uni(B, T, H, G) + 0.1 if G > 1 else uni(B, T, H) + 0.1
    ell2 = uni(B, T, H) * 0.1 + 0.01
    lo = 0.3 if strong else 0.9
    alpha = {
        "none": None,
        "scalar": uni(B, T, H) * (1 - lo) + lo,
        "diagonal": uni(B, T, H, D) * (1 - lo) + lo,
    }[decay]
    out = [q, k, v, r2, ell2, alpha]
    return [x.to(dtype=dtype, device=DEVICE) if x is not None else None for x in out]


def initial_state(B, H, D, m, G=1, seed=1, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    M = torch.randn(B, H, D, m, generator=gen, dtype=torch.float64)
    A = torch.randn(B, H, G, D, D, generator=gen, dtype=torch.float64) / D**0.5
    P = A @ A.transpose(-1, -2) + 0.5 * torch.eye(D, dtype=torch.float64)
    P = P[:, :, 0] if G == 1 else P
    return M.to(dtype=dtype, device=DEVICE), P.to(dtype=dtype, device=DEVICE)


def assert_close(a, b, tol, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if b.numel() == 0:
        return
    scale = max(1.0, b.abs().max().item())
    err = (a.double() - b.double()).abs().max().item()
    assert err <= tol * scale, f"{what}: max |triton - torch| = {err:.3g} > {tol:.1g} * {scale:.3g}"


def compare(B, T, H, D, m, *, decay="scalar", G=1, chunk_size=16, with_state=False, dtype=torch.float64,
            tol=1e-10, strong=False):
    """The whole Triton path (``bl_chunk(backend="triton")`` through the dispatch, which must call
    the Triton forward exactly once and never the PyTorch path) against ``backend="torch"``."""
    q, k, v, r2, ell2, alpha = make_inputs(B, T, H, D, m, decay=decay, G=G, dtype=dtype, strong=strong)
    st = initial_state(B, H, D, m, G) if with_state else None
    kw = dict(initial_state=st, output_final_state=True, return_variance=True, chunk_size=chunk_size)
    with triton_only() as calls:
        o1, var1, (M1, P1) = bl_chunk(q, k, v, r2, ell2, alpha, backend="triton", **kw)
    assert calls == {"chunk": 1}, f"Triton entry points called {dict(calls)}"
    # key dims up to 128 run the covariance chain, larger ones the segment scan (covariance_path)
    expected = {"chain": 1} if D <= 128 else {"scan": 1, "phase_a": 1, "phase_b": 1, "mean": 1}
    assert calls.kernels == expected, dict(calls.kernels)
    o2, var2, (M2, P2) = bl_chunk(q, k, v, r2, ell2, alpha, backend="torch", **kw)
    assert o1.dtype == o2.dtype == dtype and o1.shape == o2.shape
    assert var1.shape == var2.shape and M1.shape == M2.shape and P1.shape == P2.shape
    assert_close(o1, o2, tol, "output")
    assert_close(var1, var2, tol, "variance")
    assert_close(M1, M2, tol, "final M")
    assert_close(P1, P2, tol, "final P")


# --------------------------------------------------------------------------- fast default subset

@pytest.mark.parametrize(
    "B,T,H,D,m,decay,G,C,with_state",
    [
        (2, 37, 2, 16, 24, "scalar", 1, 16, False),  # odd T, m not a power of two
        (1, 33, 1, 20, 16, "none", 1, 16, True),  # D padded 20 -> 32, identity dynamics, initial state
        (1, 19, 1, 16, 8, "diagonal", 2, 16, True),  # diagonal decay, G = 2 groups, initial state
        (1, 21, 1, 100, 80, "scalar", 1, 16, False),  # D 100 -> 128: two BK tiles; m = 80: two BV blocks
    ],
)
def test_forward_matches_torch_fp64(B, T, H, D, m, decay, G, C, with_state):
    compare(B, T, H, D, m, decay=decay, G=G, chunk_size=C, with_state=with_state)


def test_forward_fp32_and_strong_decay():
    compare(1, 40, 2, 32, 16, decay="scalar", dtype=torch.float32, tol=2e-4, strong=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_compute_in_fp32(dtype):
    q, k, v, r2, ell2, alpha = make_inputs(1, 20, 2, 16, 16, dtype=dtype)
    o1, (M1, P1) = bl_chunk_triton(q, k, v, r2, ell2, alpha, output_final_state=True, chunk_size=16)
    o2, (M2, P2) = bl_chunk(q, k, v, r2, ell2, alpha, output_final_state=True, chunk_size=16)
    assert o1.dtype == dtype and M1.dtype == torch.float32 and P1.dtype == torch.float32
    assert_close(o1, o2, 1e-2, "output")
    assert_close(M1, M2, 1e-5, "final M")
    assert_close(P1, P2, 1e-5, "final P")


@pytest.mark.parametrize("return_variance", [False, True])
def test_empty_sequences_in_cu_seqlens(return_variance):
    """Empty sequences, first, last and several in a row, beside a full chunk and a ragged one, with and without the
    variance: the PyTorch path's results."""
    lens = [0, 16, 0, 0, 9, 0]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE)
    q, k, v, r2, ell2, alpha = make_inputs(1, sum(lens), 2, 16, 16, decay="scalar")
    st = initial_state(len(lens), 2, 16, 16)
    kw = dict(initial_state=st, output_final_state=True, return_variance=return_variance, chunk_size=16,
              cu_seqlens=cu)
    got, want = bl_chunk_triton(q, k, v, r2, ell2, alpha, **kw), bl_chunk(q, k, v, r2, ell2, alpha, **kw)
    assert len(got) == len(want) == 2 + return_variance
    names = ("output", "variance", "state") if return_variance else ("output", "state")
    for name, a, b in zip(names, got, want, strict=True):
        if name == "state":
            assert_close(a[0], b[0], 1e-10, "final M")
            assert_close(a[1], b[1], 1e-10, "final P")
        else:
            assert_close(a, b, 1e-10, name)


def test_cu_seqlens_equals_separate_sequences():
    lens = [5, 0, 23, 17]
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE)
    q, k, v, r2, ell2, alpha = make_inputs(1, T, 2, 16, 16, decay="scalar")
    N = len(lens)
    st = initial_state(N, 2, 16, 16)
    o, var, (M, P) = bl_chunk_triton(q, k, v, r2, ell2, alpha, initial_state=st, output_final_state=True,
                                     return_variance=True, chunk_size=16, cu_seqlens=cu)
    assert M.shape == (N, 2, 16, 16) and P.shape == (N, 2, 16, 16)
    for n in range(N):
        bos, eos = int(cu[n]), int(cu[n + 1])
        sl = slice(bos, eos)
        o_n, var_n, (M_n, P_n) = bl_chunk(
            q[:, sl], k[:, sl], v[:, sl], r2[:, sl], ell2[:, sl], alpha[:, sl],
            initial_state=(st[0][n:n + 1], st[1][n:n + 1]), output_final_state=True, return_variance=True,
        )
        assert_close(o[:, sl], o_n, 1e-10, f"output of sequence {n}")
        assert_close(var[:, sl], var_n, 1e-10, f"variance of sequence {n}")
        assert_close(M[n:n + 1], M_n, 1e-10, f"final M of sequence {n}")
        assert_close(P[n:n + 1], P_n, 1e-10, f"final P of sequence {n}")


def _grad_check(decay, G, with_state, cu_lens=None, T=21):
    B = 1 if cu_lens else 2
    T = sum(cu_lens) if cu_lens else T
    q, k, v, r2, ell2, alpha = make_inputs(B, T, 2, 16, 8, decay=decay, G=G)
    N = len(cu_lens) if cu_lens else B
    st = initial_state(N, 2, 16, 8, G) if with_state else None
    leaves = [x for x in (q, k, v, r2, ell2, alpha, *(st or ())) if x is not None]
    for x in leaves:
        x.requires_grad_(True)
    gen = torch.Generator().manual_seed(5)
    cu = None
    if cu_lens:
        cu = torch.tensor([0, *torch.tensor(cu_lens).cumsum(0).tolist()], device=DEVICE)

    def loss(fn, **extra):
        o, var, (M, P) = fn(q, k, v, r2, ell2, alpha, initial_state=st, output_final_state=True,
                            return_variance=True, chunk_size=16, **extra)
        outs = (o, var, M, P)
        w = [torch.randn(x.shape, generator=gen.manual_seed(i), dtype=x.dtype) for i, x in enumerate(outs)]
        return sum((x * wi.to(x.device)).sum() for x, wi in zip(outs, w, strict=True))

    g1 = torch.autograd.grad(loss(bl_chunk_triton, cu_seqlens=cu), leaves)
    if cu is None:
        g2 = torch.autograd.grad(loss(bl_chunk), leaves)
    else:  # the reference: each packed sequence through the PyTorch path on its own
        from bayeslayer.ops.bayesian_layer.chunk_triton import _torch_reference

        def ref(q, k, v, r2, ell2, alpha, initial_state, **kw):
            M0, P0 = initial_state if initial_state is not None else (None, None)
            o, var, M, P = _torch_reference(q, k, v, r2, ell2, alpha, None, 1.0, M0, P0, cu, 16, True)
            return o, var, (M, P)
        g2 = torch.autograd.grad(loss(ref), leaves)
    for i, (a, b) in enumerate(zip(g1, g2, strict=True)):
        if st is not None and leaves[i] is st[1]:  # a covariance's gradient: its symmetric part is the defined one
            a, b = 0.5 * (a + a.transpose(-1, -2)), 0.5 * (b + b.transpose(-1, -2))
        assert_close(a, b, 1e-10, f"gradient of input {i}")
        assert b.abs().max() > 0, f"gradient of input {i} is identically zero; the check would be vacuous"


def test_gradients_match_torch():
    _grad_check("scalar", 1, with_state=True)


def test_gradient_of_p0_and_variance_only():
    q, k, v, r2, ell2, alpha = make_inputs(1, 20, 2, 16, 8)
    p0 = torch.tensor([0.5, 2.0], dtype=torch.float64, device=DEVICE, requires_grad=True)
    grads = []
    for fn in (bl_chunk_triton, bl_chunk):
        _, var, _ = fn(q, k, v, r2, ell2, alpha, p0=p0, return_variance=True, chunk_size=16)
        grads.append(torch.autograd.grad(var.sum(), p0)[0])
    assert_close(grads[0], grads[1], 1e-10, "gradient of p0")
    assert grads[1].abs().min() > 0


@pytest.mark.parametrize("G", [pytest.param(1, marks=pytest.mark.slow), 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_low_precision_gradients(dtype, G):
    """16-bit inputs: the chain reads q, k, v in their dtype and computes in fp32; gradients come back in the input
    dtype and equal the PyTorch path's, which computes in fp32 and rounds once, to the 16-bit rounding."""
    q, k, v, r2, ell2, alpha = make_inputs(1, 40, 2, 16, 8, G=G, dtype=dtype)
    leaves = [x.requires_grad_(True) for x in (q, k, v, r2, ell2, alpha)]
    gen = torch.Generator().manual_seed(3)

    def loss(fn):
        o, (M, P) = fn(q, k, v, r2, ell2, alpha, output_final_state=True, chunk_size=16)
        w = [torch.randn(x.shape, generator=gen.manual_seed(i)).to(x.device) for i, x in enumerate((o, M, P))]
        return (o.float() * w[0]).sum() + (M * w[1]).sum() + (P * w[2]).sum()

    g1 = torch.autograd.grad(loss(bl_chunk_triton), leaves)
    g2 = torch.autograd.grad(loss(bl_chunk), leaves)
    for name, a, b in zip("q k v r2 ell2 alpha".split(), g1, g2, strict=True):
        assert a.dtype == b.dtype == dtype, f"d{name}: dtype {a.dtype}, torch path {b.dtype}"
        assert_close(a.float(), b.float(), 1e-2, f"d{name}")
        assert b.abs().max() > 0


def test_gradients_with_cu_seqlens():
    _grad_check("scalar", 1, with_state=True, cu_lens=[7, 12])


def test_rotations_have_no_kernel_and_are_refused_not_run_on_torch():
    """Rotations: the Triton entry points and a forced backend refuse them by name (no silent
    PyTorch run under a Triton name); the default dispatch runs them on PyTorch."""
    q, k, v, r2, ell2, _ = make_inputs(1, 10, 1, 16, 8)
    theta = torch.rand(1, 10, 1, 8, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="rotation dynamics"):
        bl_chunk_triton(q, k, v, r2, ell2, theta=theta, chunk_size=16)
    with pytest.raises(BackendError, match="rotation dynamics"):
        bl_chunk(q, k, v, r2, ell2, theta=theta, chunk_size=16, backend="triton")
    st = initial_state(1, 1, 16, 8)
    with pytest.raises(ValueError, match="rotation dynamics"):
        bl_step_triton(q[:, 0], k[:, 0], v[:, 0], r2[:, 0], ell2[:, 0], theta=theta[:, 0], state=st)
    with pytest.raises(BackendError, match="rotation dynamics"):
        bl_step(q[:, 0], k[:, 0], v[:, 0], r2[:, 0], ell2[:, 0], theta=theta[:, 0], state=st, backend="triton")
    o1, _ = bl_chunk(q, k, v, r2, ell2, theta=theta, chunk_size=16)  # auto: CPU or rotation -> PyTorch
    o2, _ = bl_chunk(q, k, v, r2, ell2, theta=theta, chunk_size=16, backend="torch")
    assert_close(o1, o2, 0.0, "rotation output")


def test_step_matches_bl_step():
    """``bl_step(backend="triton")`` runs the fused step kernel (once per step, never PyTorch) and
    equals ``backend="torch"``."""
    B, H, D, m, G = 2, 2, 20, 12, 2
    q, k, v, r2, ell2, alpha = make_inputs(B, 3, H, D, m, decay="diagonal", G=G)
    s1 = s2 = initial_state(B, H, D, m, G)
    for t in range(3):  # each step from the state the previous one returned
        with triton_only() as calls:
            o1, var1, s1 = bl_step(q[:, t], k[:, t], v[:, t], r2[:, t], ell2[:, t], alpha[:, t], state=s1,
                                   return_variance=True, backend="triton")
        assert calls == {"step": 1}, f"Triton entry points called {dict(calls)}"
        o2, var2, s2 = bl_step(q[:, t], k[:, t], v[:, t], r2[:, t], ell2[:, t], alpha[:, t], state=s2,
                               return_variance=True, backend="torch")
        assert_close(o1, o2, 1e-12, f"step {t} output")
        assert_close(var1, var2, 1e-12, f"step {t} variance")
        assert_close(s1[0], s2[0], 1e-12, f"step {t} M")
        assert_close(s1[1], s2[1], 1e-12, f"step {t} P")


@pytest.mark.parametrize("decay", ["none", "scalar"])
def test_step_scalar_decay_from_prior(decay):
    B, H, D, m = 1, 3, 16, 16
    q, k, v, r2, ell2, alpha = make_inputs(B, 3, H, D, m, decay=decay, dtype=torch.float32)
    s1 = s2 = initial_bl_state(B, H, D, m, p0=2.0, device=DEVICE)
    for t in range(3):
        a_t = alpha[:, t] if alpha is not None else None
        o1, s1 = bl_step_triton(q[:, t], k[:, t], v[:, t], r2[:, t], ell2[:, t], a_t, state=s1)
        o2, s2 = bl_step(q[:, t], k[:, t], v[:, t], r2[:, t], ell2[:, t], a_t, state=s2)
        assert_close(o1, o2, 1e-5, f"step {t} output")
        assert_close(s1[1], s2[1], 1e-5, f"step {t} P")


def test_triton_available_under_interpreter():
    assert triton_available()


# --------------------------------------------------------------------------- bad input

def test_bad_inputs_raise():
    q, k, v, r2, ell2, alpha = make_inputs(1, 8, 1, 16, 8)
    with pytest.raises(ValueError, match="chunk_size"):
        bl_chunk_triton(q, k, v, r2, ell2, alpha, chunk_size=48)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        bl_chunk_triton(q.tolist(), k, v, r2, ell2)
    with pytest.raises(ValueError, match=r"q must be \[B, T, H, D\]"):
        bl_chunk_triton(q[0], k, v, r2, ell2)
    with pytest.raises(TypeError, match="floating-point"):
        bl_chunk_triton(q, k.long(), v, r2, ell2)
    with pytest.raises(ValueError, match="key head dim"):
        big = torch.zeros(1, 8, 1, 300, dtype=torch.float64)
        bl_chunk_triton(big, big, v, r2, ell2)
    with pytest.raises(ValueError, match="alpha"):
        bl_chunk_triton(q, k, v, r2, ell2, alpha * 2)
    with pytest.raises(ValueError, match="r2"):
        bl_chunk_triton(q, k, v, -r2, ell2)
    with pytest.raises(ValueError, match="k must have the shape"):
        bl_chunk_triton(q, k[:, :4], v, r2, ell2)
    with pytest.raises(TypeError, match="cu_seqlens must have dtype"):
        bl_chunk_triton(q, k, v, r2, ell2, cu_seqlens=torch.tensor([0.0, 8.0], device=DEVICE))
    with pytest.raises(ValueError, match="end at T=8"):
        bl_chunk_triton(q, k, v, r2, ell2, cu_seqlens=torch.tensor([0, 5], device=DEVICE))
    with pytest.raises(ValueError, match="non-decreasing"):
        bl_chunk_triton(q, k, v, r2, ell2, cu_seqlens=torch.tensor([0, 6, 3, 8], device=DEVICE))
    q2, k2, v2, r22, ell22, _ = make_inputs(2, 8, 1, 16, 8)
    with pytest.raises(ValueError, match="batch size must be 1"):
        bl_chunk_triton(q2, k2, v2, r22, ell22, cu_seqlens=torch.tensor([0, 8], device=DEVICE))
    with pytest.raises(ValueError, match="initial_state"):
        st = initial_state(1, 1, 16, 8)
        bl_chunk_triton(q, k, v, r2, ell2, initial_state=st, cu_seqlens=torch.tensor([0, 3, 8], device=DEVICE))
    M, P = initial_state(1, 1, 16, 8)
    with pytest.raises(ValueError, match="state is required"):
        bl_step_triton(q[:, 0], k[:, 0], v[:, 0], r2[:, 0], ell2[:, 0])
    with pytest.raises(ValueError, match="P"):
        bl_step_triton(q[:, 0], k[:, 0], v[:, 0], r2[:, 0], ell2[:, 0], state=(M, P[..., :4]))


# --------------------------------------------------------------------------- full grid (on demand)

@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 63, 100])
@pytest.mark.parametrize("D", [16, 64, 128, 256])
@pytest.mark.parametrize("decay", ["none", "scalar", "diagonal"])
@pytest.mark.parametrize("G", [1, 2])
def test_forward_grid(T, D, decay, G):
    compare(1, T, 1, D, 2 * 16, decay=decay, G=G, chunk_size=64 if D <= 64 else 32, with_state=T != 63)


@pytest.mark.slow
@pytest.mark.parametrize("C", [16, 32, 64])
def test_forward_chunk_sizes_fp32(C):
    compare(2, 150, 2, 64, 64, decay="scalar", chunk_size=C, dtype=torch.float32, tol=2e-4, with_state=True)


@pytest.mark.slow
@pytest.mark.parametrize("decay", ["none", "diagonal"])
@pytest.mark.parametrize("G", [1, 2])
def test_gradients_grid(decay, G):
    _grad_check(decay, G, with_state=True)
    _grad_check(decay, G, with_state=False, cu_lens=[3, 0, 18])


@pytest.mark.slow
def test_long_sequence_fp32_stays_finite_and_psd():
    """T = 2000 in fp32 with decay within 1e-3 of 1 and tiny process noise: no NaN, P stays PSD."""
    gen = torch.Generator().manual_seed(3)
    B, T, H, D = 1, 2000, 1, 16
    q = torch.randn(B, T, H, D, generator=gen) / D**0.5
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    v = torch.randn(B, T, H, D, generator=gen)
    r2 = torch.rand(B, T, H, generator=gen) * 0.1 + 0.01
    ell2 = torch.rand(B, T, H, generator=gen) * 1e-4 + 1e-6
    alpha = 1 - torch.rand(B, T, H, generator=gen) * 1e-3
    args = [x.to(DEVICE) for x in (q, k, v, r2, ell2, alpha)]
    o1, (M1, P1) = bl_chunk_triton(*args, output_final_state=True)
    o2, (M2, P2) = bl_chunk(*args, output_final_state=True)
    assert bool(torch.isfinite(o1).all()) and bool(torch.isfinite(P1).all())
    assert torch.linalg.eigvalsh(P1.double()).min() > 0
    assert_close(o1, o2, 1e-4, "output")
    assert_close(P1, P2, 1e-6, "final P")


# ---- the covariance chain is what bl_chunk(backend="triton"), the layer and the model run; n_segments forces
# the segment scan ----


@pytest.mark.parametrize(("regime", "diagonal", "n_segments"),
                         [("longmem", False, 2), pytest.param("stress", True, 3, marks=pytest.mark.slow)])
def test_bl_chunk_triton_runs_the_segment_scan(regime, diagonal, n_segments):
    """Forced Triton with ``n_segments``: the segment scan's Phase A, B (kernels) and C, the mean kernel; packed
    ragged sequences (segments never cross them), an initial state; fp64 equal to PyTorch ≤ 1e-12."""
    from .scan_inputs import regime_inputs

    q, k, v, r2, ell2, alpha = regime_inputs(regime, 1, 120, 1, 8, 4, diagonal=diagonal, seed=11, device=DEVICE)
    cu = torch.tensor([0, 30, 120], device=DEVICE)  # 2 and 6 chunks of 16
    M0, P0 = initial_state(2, 1, 8, 4)
    kw = dict(initial_state=(M0, P0), output_final_state=True, return_variance=True, chunk_size=16, cu_seqlens=cu)
    with triton_only() as calls:
        o1, var1, (M1, P1) = bl_chunk(q, k, v, r2, ell2, alpha, backend="triton", n_segments=n_segments, **kw)
    assert calls == {"chunk": 1} and calls.kernels == {"scan": 1, "phase_a": 1, "phase_b": 1, "mean": 1}
    o2, var2, (M2, P2) = bl_chunk(q, k, v, r2, ell2, alpha, backend="torch", n_segments=n_segments, **kw)
    for a, b, what in ((o1, o2, "output"), (var1, var2, "variance"), (M1, M2, "final M"), (P1, P2, "final P")):
        assert_close(a, b, 1e-12, what)
    with pytest.raises(ValueError, match="n_segments"):
        bl_chunk(q, k, v, r2, ell2, alpha, backend="triton", n_segments=0, **kw)


def test_not_positive_definite_is_flagged_on_the_device_not_raised():
    """A negative definite P0 (value checks off) makes a chunk's S indefinite.  The chain path reads nothing on the
    host: the (sequence, head) that failed gets NaN outputs and its device-side flag (``chain_failures``); the
    segment scan, which reads its flags once after the pass, raises."""
    from bayeslayer.ops import chain_failures, value_checks

    q, k, v, r2, ell2, alpha = make_inputs(1, 20, 2, 8, 4)
    M0, P0 = initial_state(1, 2, 8, 4)
    P0 = torch.stack([P0[:, 0], -P0[:, 1]], 1)  # head 1 negative definite: a raw pivot of its S goes negative
    with value_checks(False):
        o, (M, P) = bl_chunk_triton(q, k, v, r2, ell2, alpha, initial_state=(M0, P0), output_final_state=True,
                                    chunk_size=16)
        assert chain_failures().tolist() == [[False, True]]
        assert torch.isfinite(o[:, :, 0]).all() and torch.isnan(o[:, :, 1]).all()
        assert torch.isfinite(P[:, 0]).all() and torch.isnan(P[:, 1]).all()
        with pytest.raises(torch.linalg.LinAlgError, match="not positive"):
            bl_chunk_triton(q, k, v, r2, ell2, alpha, initial_state=(M0, P0), chunk_size=16, n_segments=1)


def test_layer_and_model_reach_the_chain():
    """BayesianLayer(backend="triton") and BayesLayerForCausalLM prefill run the chain forward, never PyTorch."""
    from bayeslayer.layers import BayesianLayer
    from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM

    torch.manual_seed(0)
    layer = BayesianLayer(16, num_heads=2, head_dim=8, chunk_size=16, backend="triton").double()
    ref = BayesianLayer(16, num_heads=2, head_dim=8, chunk_size=16, backend="torch").double()
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(2, 21, 16, dtype=torch.float64)
    with torch.no_grad(), triton_only() as calls:
        out = layer(x, output_variance=True)
    assert calls == {"chunk": 1} and calls.kernels == {"chain": 1}
    with torch.no_grad():
        exp = ref(x, output_variance=True)
    assert_close(out.o, exp.o, 1e-10, "layer output")
    assert_close(out.variance, exp.variance, 1e-10, "layer variance")

    cfg = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_heads=2, head_dim=8,
               mixers=["bayesian", "bayesian"], mixer_kwargs={"bayesian": {"chunk_size": 16}}, bos_token_id=None,
               eos_token_id=None)
    model = BayesLayerForCausalLM(BayesLayerConfig(backend="triton", **cfg)).double().eval()
    ids = torch.randint(0, 32, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), triton_only() as calls:
        model(ids, use_cache=True)
    assert calls == {"chunk": 2} and calls.kernels == {"chain": 2}


def test_strided_inputs_as_a_layer_passes_them():
    """q, k, v as column slices of one projection (strided views, as BayesianLayer passes them)."""
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(1, 12, 2, 40, generator=gen, dtype=torch.float64).to(DEVICE)
    q, k, v = qkv[..., :8], torch.nn.functional.normalize(qkv[..., 8:16], dim=-1), qkv[..., 16:]
    _, _, _, r2, ell2, alpha = make_inputs(1, 12, 2, 8, 24)
    assert not q.is_contiguous()
    kw = dict(output_final_state=True, return_variance=True, chunk_size=16)
    o1, var1, (M1, P1) = bl_chunk(q, k, v, r2, ell2, alpha, backend="triton", **kw)
    o2, var2, (M2, P2) = bl_chunk(q, k, v, r2, ell2, alpha, backend="torch", **kw)
    for a, b, what in ((o1, o2, "output"), (var1, var2, "variance"), (M1, M2, "final M"), (P1, P2, "final P")):
        assert_close(a, b, 1e-10, what)
