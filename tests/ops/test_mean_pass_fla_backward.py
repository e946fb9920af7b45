"""The mean pass's backward on flash-linear-attention's backward kernels
(``bayeslayer.ops.bayesian_layer.mean_pass_fla``).

The explicit twin (:func:`mean_pass_fla.mean_pass_backward_reference`: the adapter's steps on the twins of
fla's kernels, :data:`mean_pass_fla.TWIN_KERNELS`) is checked in float64 against autograd through
:func:`bayeslayer.ops.bayesian_layer.scan.mean_pass_reference` (scalar and diagonal decay, G = 1, 2, ragged packed
sequences, M0 and dM), and the substitution's adjoint against autograd through ``substituted_inputs``.
Under the Triton 3.9 interpreter fla 0.6.0's chunk_bwd_dv_local, chunk_bwd_dqkwg, chunk_local_cumsum,
chunk_gla_fwd_intra_gk, chunk_kda_bwd_dAv, chunk_gla_bwd_dqk_intra and chunk_gla_bwd_dqkg run and are
checked against their twins in float32; chunk_gated_delta_rule_bwd_dhu does not (like fwd_h: its loop
index is a Python int there, ``i_t.to(tl.int64)`` fails), so its twin stands in on CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from bayeslayer.ops.bayesian_layer import mean_pass_fla, scan
from bayeslayer.ops.bayesian_layer.scan_triton import substituted_inputs

from .scan_inputs import regime_inputs

fla = pytest.importorskip("fla")
interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cuda" if not interpreted and torch.cuda.is_available() else "cpu"
runs_triton = pytest.mark.skipif(not (torch.cuda.is_available() or interpreted),
                                 reason="needs a CUDA device or TRITON_INTERPRET=1")
CU = [0, 17, 17, 40]  # packed ragged sequences, one of them empty
C = 16


def _scan_case(G, dtype=torch.float64, regime="longmem", T=40, H=2, D=8, m=4, device="cpu", seed=0, diagonal=False):
    """The scan's packed, folded outputs for a grouped (G) layer, a random M0 and random adjoints."""
    q, k, v, r2, ell2, alpha = regime_inputs(regime, 1, T, H, D, m, G=G, seed=seed, diagonal=diagonal)
    call = scan.prepare_scan(q, k, v, r2, ell2, alpha, 1.0, None, None, torch.tensor(CU), C, segment_chunks=2)
    sc = scan.covariance_scan(call.q, call.k, call.v, call.r2, call.ell2, call.log_alpha, call.P0, CU, C,
                              segment_chunks=2, want_var=False)
    gen = torch.Generator().manual_seed(seed + 7)

    def rnd(shape, s=1.0):
        return (s * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype=dtype, device=device)

    M0 = rnd(call.M0.shape, 0.3)
    do, dM = rnd(sc.vu.shape), rnd(M0.shape)

    def cast(x):
        return x.to(dtype=dtype, device=device)

    ins = dict(q=cast(call.q), w=cast(sc.w), kw=cast(sc.kw), vu=cast(sc.vu), g=cast(sc.g), M0=M0)
    return call, sc, ins, do, dM


def _strong_decay_case(dtype=torch.float64, H=2, D=8, m=4, seed=1, device="cpu", diagonal=False):
    """Random substituted tensors with strong decay (α ∈ [0.5, 1]): makes the gate adjoint count."""
    gen = torch.Generator().manual_seed(seed)
    T = CU[-1]

    def rnd(*shape, s=1.0):
        return s * torch.randn(*shape, generator=gen, dtype=torch.float64)

    la = torch.log(0.5 + 0.5 * torch.rand(T, H, D if diagonal else 1, generator=gen, dtype=torch.float64))
    lay = scan.scan_layout(CU, C, 1, "cpu")
    g = lay.scatter(torch.cumsum(lay.grid(la, 0.0), dim=-2), T)
    ins = dict(q=rnd(T, H, D), w=rnd(T, H, D, s=0.3), kw=rnd(T, H, D, s=0.3), vu=rnd(T, H, m), g=g,
               M0=rnd(3, H, D, m, s=0.3))
    ins = {n: x.to(dtype=dtype, device=device) for n, x in ins.items()}
    return ins, rnd(T, H, m).to(dtype=dtype, device=device), rnd(3, H, D, m).to(dtype=dtype, device=device)


_LAY = scan.scan_layout(CU, C, 1, "cpu")


def _per_token(g):
    """The per-token log-decay whose chunk-local cumsum is ``g``."""
    gg = _LAY.grid(g, 0.0)
    return _LAY.scatter(torch.diff(gg, dim=-2, prepend=torch.zeros_like(gg[..., :1, :])), g.shape[0])


def _autograd(ins, do, dM):
    """Autograd through the mean pass; the decay's adjoint is taken w.r.t. the per-token log-decay."""
    xs = {n: (_per_token(x) if n == "g" else x).detach().clone().requires_grad_() for n, x in ins.items()}
    g = _LAY.scatter(torch.cumsum(_LAY.grid(xs["g"], 0.0), dim=-2), xs["g"].shape[0])
    o, M = scan.mean_pass_reference(xs["q"], xs["w"], xs["kw"], xs["vu"], g, xs["M0"], CU, C)
    loss = (o * do).sum() + (M * dM).sum() if dM is not None else (o * do).sum()
    return torch.autograd.grad(loss, list(xs.values()))


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


NAMES = ("dq", "dw", "dkw", "dvu", "dlog_alpha", "dM0")


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("regime", ["longmem", "stress"])
@pytest.mark.parametrize("diagonal", [False, True])
def test_backward_twin_equals_autograd_float64(G, regime, diagonal):
    """The explicit twin chain == autograd through the mean pass, on the scan's outputs (ragged cu, M0, dM)."""
    _, _, ins, do, dM = _scan_case(G, regime=regime, diagonal=diagonal)
    ref = _autograd(ins, do, dM)
    got = mean_pass_fla.mean_pass_backward_reference(*ins.values(), CU, C, do, dM)
    for n, a, b in zip(NAMES, got, ref, strict=True):
        assert a.dtype == torch.float64 and a.shape == b.shape, n
        assert _rel(a, b) <= 1e-10, (n, _rel(a, b))


@pytest.mark.parametrize("with_dM", [True, False])
@pytest.mark.parametrize("diagonal", [False, True])
def test_backward_twin_strong_decay_float64(with_dM, diagonal):
    """Strong decay (the gate adjoint is large), with and without an incoming final-state adjoint."""
    ins, do, dM = _strong_decay_case(diagonal=diagonal)
    dM = dM if with_dM else None
    ref = _autograd(ins, do, dM)
    got = mean_pass_fla.mean_pass_backward_reference(*ins.values(), CU, C, do, dM)
    for n, a, b in zip(NAMES, got, ref, strict=True):
        assert _rel(a, b) <= 1e-10, (n, _rel(a, b))
    assert ref[4].abs().max() > 1e-2  # the gate adjoint is not vanishing: the check has teeth


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("diagonal", [False, True])
def test_substitution_backward_equals_autograd(G, diagonal):
    """dV = L⁻ᵀdvu, dK̃ = L⁻ᵀdkw (then dK, dg through K̃ = e^g⊙K), dL⁻¹ = tril(dvu Vᵀ + dkw K̃ᵀ): float64."""
    q, k, v, r2, ell2, alpha = regime_inputs("stress", 1, CU[-1], 2, 8, 4, G=G, diagonal=diagonal)
    call = scan.prepare_scan(q, k, v, r2, ell2, alpha, 1.0, None, None, torch.tensor(CU), C, segment_chunks=2)
    sc = scan.covariance_scan(call.q, call.k, call.v, call.r2, call.ell2, call.log_alpha, call.P0, CU, C,
                              segment_chunks=2, want_var=False)
    lay = scan.scan_layout(CU, C, 2, "cpu")
    xs = [x.detach().clone().requires_grad_() for x in (sc.linv, call.k, call.v, call.log_alpha)]
    kw, vu, g = substituted_inputs(lay, *xs)
    assert _rel(kw, sc.kw) <= 1e-12 and _rel(vu, sc.vu) <= 1e-12  # the scan's own substituted tensors
    gen = torch.Generator().manual_seed(5)
    dkw, dvu, dla = (torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in (kw, vu, g))
    ref = torch.autograd.grad((kw * dkw).sum() + (vu * dvu).sum(), xs, retain_graph=True)
    got = mean_pass_fla.substitution_backward(sc.linv, call.k, call.v, call.log_alpha, CU, C, dkw, dvu, dla)
    pos = torch.cat([torch.arange(b - a) % C for a, b in zip(CU[:-1], CU[1:], strict=True)])
    low = (torch.arange(C)[None, :] <= pos[:, None])[:, None, :]  # where a row of L⁻¹ can be non-zero
    assert _rel(got[0], ref[0] * low) <= 1e-12
    assert (got[0] * ~low).abs().max() == 0
    for n, a, b in zip(("dk", "dv", "dlog_alpha"), got[1:], (ref[1], ref[2], ref[3] + dla), strict=True):
        assert _rel(a, b) <= 1e-12, (n, _rel(a, b))
    # without the mean pass's dlog_alpha the decay's adjoint is the K̃ term alone
    got0 = mean_pass_fla.substitution_backward(sc.linv, call.k, call.v, call.log_alpha, CU, C, dkw, dvu)
    assert _rel(got0[3], ref[3]) <= 1e-12


@pytest.mark.parametrize("diagonal", [False, True])
def test_mean_and_substitution_backward_compose(diagonal):
    """mean_pass_backward_reference then substitution_backward == autograd through substituted_inputs and the
    mean pass, w.r.t. the scan's own outputs (q, W, L⁻¹ rows, K, V, log α, M0): the per-token decay adjoint
    of the one feeds the other (float64, G = 2)."""
    call, sc, ins, do, dM = _scan_case(2, regime="stress", diagonal=diagonal)
    lay = scan.scan_layout(CU, C, 2, "cpu")
    xs = [x.detach().clone().requires_grad_() for x in (call.q, sc.w, sc.linv, call.k, call.v, call.log_alpha,
                                                         ins["M0"])]
    kw, vu, g = substituted_inputs(lay, *xs[2:6])
    o, M = scan.mean_pass_reference(xs[0], xs[1], kw, vu, g, xs[6], CU, C)
    ref = torch.autograd.grad((o * do).sum() + (M * dM).sum(), xs)
    dq, dw, dkw, dvu, dla, dM0 = mean_pass_fla.mean_pass_backward_reference(call.q, sc.w, sc.kw, sc.vu, sc.g, ins["M0"],
                                                                       CU, C, do, dM)
    dlinv, dk, dv, dla = mean_pass_fla.substitution_backward(sc.linv, call.k, call.v, call.log_alpha, CU, C, dkw, dvu,
                                                        dla)
    pos = torch.cat([torch.arange(b - a) % C for a, b in zip(CU[:-1], CU[1:], strict=True)])
    low = (torch.arange(C)[None, :] <= pos[:, None])[:, None, :]
    got = (dq, dw, dlinv, dk, dv, dla, dM0)
    for n, a, b in zip(("dq", "dw", "dlinv", "dk", "dv", "dlog_alpha", "dM0"), got, ref, strict=True):
        b = b * low if n == "dlinv" else b
        assert _rel(a, b) <= 1e-10, (n, _rel(a, b))


def _kernel_inputs(diagonal):
    """fla-layout inputs of the backward's kernels (fp32), with h, v_new, dh, dvu from the twins."""
    _, _, ins, do, dM = _scan_case(2, dtype=torch.float32, device=DEVICE, diagonal=diagonal)
    cu_t = torch.tensor(CU, device=DEVICE)
    q, w, kw, vu, g, M0 = (x.unsqueeze(0).contiguous() if x.dim() == 3 else x for x in ins.values())
    do = do.unsqueeze(0).contiguous()
    common = dict(cu_seqlens=cu_t, chunk_size=C)
    if not diagonal:
        g2 = (g[..., 0] * mean_pass_fla._RCP_LN2).contiguous()
        h, v_new, _ = mean_pass_fla.fwd_h_reference(w, kw, vu, g=g2, initial_state=M0, **common)
        dv = mean_pass_fla.bwd_dv_local_reference(q, w, do, g=g2, **common)
        dh, _, dvu = mean_pass_fla.bwd_dhu_reference(q, w, kw, do, dv, g=g2, h0=M0, dht=dM, **common)
        return dict(q=q, w=w, kw=kw, g2=g2, do=do, h=h, v_new=v_new, dh=dh, dvu=dvu, dv=dv, vu=vu, M0=M0, dM=dM), common
    gk = (g * mean_pass_fla._RCP_LN2).contiguous()
    last = mean_pass_fla.chunk_last_index(CU, C, q.device)
    w_end = (w[0] * torch.exp(g[0][last] - g[0]))[None].contiguous()
    h, v_new, _ = mean_pass_fla.fwd_h_reference(w_end, kw, vu, gk=gk, initial_state=M0, **common)
    A = mean_pass_fla.gla_fwd_intra_gk_reference(q, w, gk, 1.0, **common)
    dA, dv = mean_pass_fla.kda_bwd_dAv_reference(q, w, v_new, do, A=A, **common)
    qg = (q * torch.exp(g)).contiguous()
    dh, _, dvu = mean_pass_fla.bwd_dhu_reference(qg, w_end, kw, do, dv, gk=gk, h0=M0, dht=dM, **common)
    return dict(q=q, w=w, kw=kw, g2=gk, do=do, h=h, v_new=v_new, dh=dh, dvu=dvu, A=A, dA=dA, dv=dv, vu=vu, M0=M0,
                dM=dM, qg=qg, w_end=w_end), common


@runs_triton
@pytest.mark.parametrize("diagonal", [False, True])
def test_fla_backward_kernels_equal_twins(diagonal):
    """Every fla backward kernel that runs here (interpreted on CPU, or on a GPU) == its twin, fp32, same inputs:
    scalar decay chunk_bwd_dv_local, chunk_bwd_dqkwg, chunk_local_cumsum; diagonal chunk_gla_fwd_intra_gk,
    chunk_kda_bwd_dAv, chunk_gla_bwd_dqk_intra, chunk_gla_bwd_dqkg and the ungated chunk_bwd_dqkwg (dkw); on a GPU
    also fwd_h and bwd_dhu, whose failure under the interpreter is asserted on CPU."""
    x, common = _kernel_inputs(diagonal)
    fk = {n: getattr(__import__(m, fromlist=[n]), n) for n, m in mean_pass_fla.FLA_BACKWARD_KERNELS.items()}
    tw = mean_pass_fla.TWIN_KERNELS
    q, w, kw, g2, do, h, v_new, dh, dvu = (x[n] for n in ("q", "w", "kw", "g2", "do", "h", "v_new", "dh", "dvu"))
    if not diagonal:
        calls = {
            "chunk_bwd_dv_local": dict(q=q, k=w, do=do, g=g2, scale=1.0),
            "chunk_bwd_dqkwg": dict(q=q, k=w, v=v_new, do=do, h=h, dh=dh, w=kw, g=g2, dv=dvu, scale=1.0),
            "chunk_local_cumsum": dict(g=x["dvu"][..., 0].contiguous(), reverse=True),
        }
    else:
        dq0, dk0 = tw["chunk_gla_bwd_dqk_intra"](q=q, k=w, g=g2, dA=x["dA"], **common)
        calls = {
            "chunk_gla_fwd_intra_gk": dict(q=q, k=w, g=g2, scale=1.0),
            "chunk_kda_bwd_dAv": dict(q=q, k=w, v=v_new, do=do, A=x["A"], scale=1.0),
            "chunk_gla_bwd_dqk_intra": dict(q=q, k=w, g=g2, dA=x["dA"]),
            "chunk_gla_bwd_dqkg": dict(q=q, k=w, v=v_new, h=h, g=g2, do=do, dh=dh, dq=dq0, dk=dk0, scale=1.0),
            "chunk_bwd_dqkwg": dict(q=q, k=w, v=v_new, do=do, h=h, dh=dh, w=kw, dv=dvu, scale=1.0),
        }
    # the two the interpreter cannot run: compared on a GPU; under the interpreter their failure is asserted
    # (if a later fla runs them, this fails and the CPU tests should switch to fla's kernels)
    M0, dM = x["M0"], x["dM"]
    if diagonal:
        dhu_args = dict(q=x["qg"], k=x["w_end"], w=kw, do=do, dv=x["dv"], gk=g2, h0=M0, dht=dM, scale=1.0)
        fwd = dict(k=x["w_end"], w=kw, u=x["vu"], gk=g2, initial_state=M0, output_final_state=True)
    else:
        dhu_args = dict(q=q, k=w, w=kw, do=do, dv=x["dv"], g=g2, h0=M0, dht=dM, scale=1.0)
        fwd = dict(k=w, w=kw, u=x["vu"], g=g2, initial_state=M0, output_final_state=True)
    for name, kw_args in (("chunk_gated_delta_rule_bwd_dhu", dhu_args), ("chunk_gated_delta_rule_fwd_h", fwd)):
        if torch.cuda.is_available():
            calls[name] = kw_args
        else:
            with mean_pass_fla.one_autotune_config(), pytest.raises(Exception, match="has no attribute 'to'"):
                fk[name](**kw_args, **common)
    pos = torch.cat([torch.arange(b - a) % C for a, b in zip(CU[:-1], CU[1:], strict=True)]).to(DEVICE)
    low = (torch.arange(C, device=DEVICE)[None, :] <= pos[:, None])[None, :, None, :]  # A's defined entries
    for name, kw_args in calls.items():
        with mean_pass_fla.one_autotune_config():
            got = fk[name](**kw_args, **common)
        ref = tw[name](**kw_args, **common)
        got, ref = (r if isinstance(r, tuple) else (r,) for r in (got, ref))
        for i, (a, b) in enumerate(zip(got, ref, strict=True)):
            if a is None:
                assert b is None, (name, i)
                continue
            if name == "chunk_gla_fwd_intra_gk":
                a = a * low  # fla leaves A above the diagonal unset
            assert a.shape == b.shape and _rel(a.float(), b.float()) <= 1e-5, (name, i, _rel(a.float(), b.float()))


@runs_triton
@pytest.mark.parametrize(("diagonal", "dtype", "tol"), [(False, torch.float32, 2e-5),
                                                       pytest.param(True, torch.float32, 2e-5, marks=pytest.mark.slow),
                                                       pytest.param(False, torch.float16, 5e-3, marks=pytest.mark.slow),
                                                       (True, torch.float16, 5e-3)])
def test_mean_pass_fla_backward_equals_autograd(diagonal, dtype, tol):
    """The adapter with fla's kernels (fwd_h and bwd_dhu by their twins where the interpreter cannot run them),
    fp32 and fp16 inputs (fla accumulates in fp32), against autograd through the mean pass in float64.
    Measured on CPU: fp32 ≤ 3.7e-7, fp16 ≤ 1.2e-3.  Not bf16: under the Triton 3.9 interpreter fla's
    kernels return garbage for bf16 operands (chunk_bwd_dv_local 1.3e10 where its twin gives 7.8) because the
    interpreter's ``tl.dot`` multiplies bf16's raw uint16 bit patterns (:func:`test_interpreter_bf16_dot`)."""
    _, _, ins64, do64, dM64 = _scan_case(2, diagonal=diagonal)
    ref = _autograd(ins64, do64, dM64)
    ins = {n: x.to(dtype=dtype, device=DEVICE) for n, x in ins64.items()}
    twins = {} if torch.cuda.is_available() else dict(fwd_h=mean_pass_fla.fwd_h_reference,
                                                      dhu=mean_pass_fla.bwd_dhu_reference)
    with mean_pass_fla.one_autotune_config():
        got = mean_pass_fla.mean_pass_fla_backward(*ins.values(), CU, C, do64.to(dtype=dtype, device=DEVICE),
                                                   dM64.to(dtype=dtype, device=DEVICE), **twins)
    for n, a, b, x in zip(NAMES, got, ref, ins.values(), strict=True):
        assert a.dtype == x.dtype and a.shape == b.shape, n
        assert _rel(a.double().cpu(), b) <= tol, (n, _rel(a.double().cpu(), b))


@runs_triton
def test_interpreter_bf16_dot():
    """Why bf16 is not tested on fla's kernels on CPU: the Triton 3.9 interpreter stores bf16 as uint16 and its
    ``create_dot`` runs ``np.matmul`` on those bit patterns (only fp8 is converted), so a bf16 ``tl.dot`` — no fla
    code involved — is wrong by orders of magnitude, while fp16 is right.  Asserted as it is under the interpreter
    (a fixed Triton makes this fail: then add bf16 to ``test_mean_pass_fla_backward_equals_autograd``); on a GPU
    bf16 must be right."""
    import triton
    import triton.language as tl

    @triton.jit
    def dot16(a, b, c, N: tl.constexpr):
        i = tl.arange(0, N)
        x = tl.load(a + i[:, None] * N + i[None, :])
        y = tl.load(b + i[:, None] * N + i[None, :])
        tl.store(c + i[:, None] * N + i[None, :], tl.dot(x, y))

    g = torch.Generator().manual_seed(0)
    err = {}
    for dt in (torch.float16, torch.bfloat16):
        a, b = (torch.randn(16, 16, generator=g).to(dtype=dt, device=DEVICE) for _ in range(2))
        c = torch.empty(16, 16, dtype=torch.float32, device=DEVICE)
        dot16[(1,)](a, b, c, N=16)
        err[dt] = ((c - a.float() @ b.float()).abs().max() / (a.float() @ b.float()).abs().max()).item()
    assert err[torch.float16] <= 1e-5
    if DEVICE == "cpu":
        assert err[torch.bfloat16] > 1e3  # measured 2.4e10 / max|a b| (Triton 3.9)
    else:
        assert err[torch.bfloat16] <= 1e-5


def test_one_autotune_config_pins_and_restores():
    """Every autotuner of the loaded fla modules runs its first config inside, its own configs again after (each
    once, however many names reach it); ``modules`` must be module names."""
    import fla.ops.common.chunk_o as m
    from triton.runtime.autotuner import Autotuner

    tuners = {}
    for obj in vars(m).values():
        while obj is not None and not isinstance(obj, Autotuner) and hasattr(obj, "fn"):
            obj = obj.fn  # fla wraps its autotuned kernels (heuristics, dispatch)
        if isinstance(obj, Autotuner) and len(obj.configs) > 1:
            tuners[id(obj)] = obj
    tuners = list(tuners.values())
    assert tuners, "fla.ops.common.chunk_o has no autotuned kernel with > 1 config: the test would be vacuous"
    before = [list(t.configs) for t in tuners]
    with mean_pass_fla.one_autotune_config():
        assert all(len(t.configs) == 1 for t in tuners)
    assert [list(t.configs) for t in tuners] == before
    with pytest.raises(TypeError, match="modules must be"):
        with mean_pass_fla.one_autotune_config("fla.ops.common.chunk_o"):
            pass


def test_backward_refuses_bad_inputs():
    _, _, ins, do, dM = _scan_case(1)
    a = list(ins.values())
    with pytest.raises(TypeError, match="float64"):
        mean_pass_fla.mean_pass_fla_backward(*a, CU, C, do, dM)
    with pytest.raises(ValueError, match="kw must be"):
        mean_pass_fla.mean_pass_backward_reference(a[0], a[1], a[2][None], *a[3:], CU, C, do, dM)
    with pytest.raises(ValueError, match="do must have vu's shape"):
        mean_pass_fla.mean_pass_backward_reference(*a, CU, C, do[:-1], dM)
    with pytest.raises(ValueError, match="dM must have M0's shape"):
        mean_pass_fla.mean_pass_backward_reference(*a, CU, C, do, dM[:1])
    with pytest.raises(ValueError, match="g must be"):
        mean_pass_fla.mean_pass_backward_reference(*a[:4], a[4].expand(-1, -1, 3), a[5], CU, C, do, dM)
    with pytest.raises(ValueError, match="kernels must be"):
        mean_pass_fla.mean_pass_fla_backward(*a, CU, C, do, dM, kernels={"no_such_kernel": None})
    with pytest.raises(ValueError, match="cu must be"):
        mean_pass_fla.mean_pass_backward_reference(*a, [0, 40], C, do, dM)
    with pytest.raises(ValueError, match="C must be"):
        mean_pass_fla.mean_pass_backward_reference(*a, CU, 0, do, dM)
    with pytest.raises(ValueError, match="dvu must have v's shape"):
        mean_pass_fla.substitution_backward(ins["kw"].new_zeros(40, 2, C), ins["kw"], ins["vu"], ins["g"], CU, C,
                                       ins["kw"], ins["vu"][:, :, :1])
    with pytest.raises(ValueError, match="linv must hold"):
        mean_pass_fla.substitution_backward(ins["kw"].new_zeros(40, 2, 8), ins["kw"], ins["vu"], ins["g"], CU, C,
                                       ins["kw"], ins["vu"])


def test_twins_refuse_bad_inputs():
    x = torch.zeros(1, 40, 2, 8)
    cu = torch.tensor(CU)
    with pytest.raises(ValueError, match="chunk_size must be"):
        mean_pass_fla.bwd_dv_local_reference(x, x, x, chunk_size=0)
    with pytest.raises(ValueError, match="do must share q's"):
        mean_pass_fla.bwd_dv_local_reference(x, x, x[:, :-1], cu_seqlens=cu, chunk_size=C)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to T=40"):
        mean_pass_fla.bwd_dhu_reference(x, x, x, x, x, cu_seqlens=torch.tensor([0, 30]), chunk_size=C)
    with pytest.raises(ValueError, match="h must be per-chunk states"):
        mean_pass_fla.bwd_dqkwg_reference(x, x, x, x, x, x, cu_seqlens=cu, chunk_size=C)
    with pytest.raises(ValueError, match="dA must be"):
        mean_pass_fla.gla_bwd_dqk_intra_reference(x, x, x, x[0, 0], cu_seqlens=cu, chunk_size=C)
