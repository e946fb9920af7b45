"""The mean pass's backward on flash-linear-attention's GDN backward kernels (``bayeslayer.ops.fla_mean``).

The explicit twin (:func:`fla_mean.mean_pass_backward_reference`: the same four steps on the twins of
fla's ``fwd_h``, ``chunk_bwd_dv_local``, ``chunk_gated_delta_rule_bwd_dhu``, ``chunk_bwd_dqkwg``) is
checked in float64 against autograd through :func:`bayeslayer.ops.scan.mean_pass_reference`, and the
substitution's adjoint against autograd through ``substituted_inputs``.  Under the Triton 3.9
interpreter fla 0.6.0's ``chunk_bwd_dv_local`` and ``chunk_bwd_dqkwg`` run and are checked against their
twins in float32; ``chunk_gated_delta_rule_bwd_dhu`` does not (like ``fwd_h``: its loop index is a
Python int there, ``i_t.to(tl.int64)`` fails), so its twin stands in on CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from bayeslayer.ops import fla_mean, scan
from bayeslayer.ops.triton.scan import substituted_inputs

from .scan_inputs import regime_inputs

fla = pytest.importorskip("fla")
interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cuda" if not interpreted and torch.cuda.is_available() else "cpu"
runs_triton = pytest.mark.skipif(not (torch.cuda.is_available() or interpreted),
                                 reason="needs a CUDA device or TRITON_INTERPRET=1")
CU = [0, 17, 17, 40]  # packed ragged sequences, one of them empty
C = 16


def _scan_case(G, dtype=torch.float64, regime="longmem", T=40, H=2, D=8, m=4, device="cpu", seed=0):
    """The scan's packed, folded outputs for a grouped (G) scalar-decay layer, a random M0 and random adjoints."""
    q, k, v, r2, ell2, alpha = regime_inputs(regime, 1, T, H, D, m, G=G, seed=seed)
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


def _strong_decay_case(dtype=torch.float64, H=2, D=8, m=4, seed=1, device="cpu"):
    """Random substituted tensors with strong decay (α ∈ [0.5, 1]): makes the gate adjoint count."""
    gen = torch.Generator().manual_seed(seed)
    T = CU[-1]

    def rnd(*shape, s=1.0):
        return s * torch.randn(*shape, generator=gen, dtype=torch.float64)

    la = torch.log(0.5 + 0.5 * torch.rand(T, H, 1, generator=gen, dtype=torch.float64))
    lay = scan.scan_layout(CU, C, 1, "cpu")
    g = lay.scatter(torch.cumsum(lay.grid(la, 0.0), dim=-2), T)
    ins = dict(q=rnd(T, H, D), w=rnd(T, H, D, s=0.3), kw=rnd(T, H, D, s=0.3), vu=rnd(T, H, m), g=g,
               M0=rnd(3, H, D, m, s=0.3))
    ins = {n: x.to(dtype=dtype, device=device) for n, x in ins.items()}
    return ins, rnd(T, H, m).to(dtype=dtype, device=device), rnd(3, H, D, m).to(dtype=dtype, device=device)


def _autograd(ins, do, dM):
    xs = {n: x.detach().clone().requires_grad_() for n, x in ins.items()}
    o, M = scan.mean_pass_reference(xs["q"], xs["w"], xs["kw"], xs["vu"], xs["g"], xs["M0"], CU, C)
    loss = (o * do).sum() + (M * dM).sum() if dM is not None else (o * do).sum()
    return torch.autograd.grad(loss, list(xs.values()))


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


NAMES = ("dq", "dw", "dkw", "dvu", "dg", "dM0")


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("regime", ["longmem", "stress"])
def test_backward_twin_equals_autograd_float64(G, regime):
    """The explicit twin chain == autograd through the mean pass, on the scan's outputs (ragged cu, M0, dM)."""
    _, _, ins, do, dM = _scan_case(G, regime=regime)
    ref = _autograd(ins, do, dM)
    got = fla_mean.mean_pass_backward_reference(*ins.values(), CU, C, do, dM)
    for n, a, b in zip(NAMES, got, ref, strict=True):
        assert a.dtype == torch.float64 and a.shape == b.shape, n
        assert _rel(a, b) <= 1e-10, (n, _rel(a, b))


@pytest.mark.parametrize("with_dM", [True, False])
def test_backward_twin_strong_decay_float64(with_dM):
    """Strong decay (the gate adjoint is large), with and without an incoming final-state adjoint."""
    ins, do, dM = _strong_decay_case()
    dM = dM if with_dM else None
    ref = _autograd(ins, do, dM)
    got = fla_mean.mean_pass_backward_reference(*ins.values(), CU, C, do, dM)
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
    dkw, dvu, dg = (torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in (kw, vu, g))
    ref = torch.autograd.grad((kw * dkw).sum() + (vu * dvu).sum() + (g * dg).sum(), xs, retain_graph=True)
    got = fla_mean.substitution_backward(sc.linv, call.k, call.v, call.log_alpha, CU, C, dkw, dvu, dg)
    pos = torch.cat([torch.arange(b - a) % C for a, b in zip(CU[:-1], CU[1:], strict=True)])
    low = (torch.arange(C)[None, :] <= pos[:, None])[:, None, :]  # where a row of L⁻¹ can be non-zero
    assert _rel(got[0], ref[0] * low) <= 1e-12
    assert (got[0] * ~low).abs().max() == 0
    for n, a, b in zip(("dk", "dv", "dlog_alpha"), got[1:], ref[1:], strict=True):
        assert _rel(a, b) <= 1e-12, (n, _rel(a, b))
    # without dg the gate adjoint is the K̃ term alone
    got0 = fla_mean.substitution_backward(sc.linv, call.k, call.v, call.log_alpha, CU, C, dkw, dvu)
    ref0 = torch.autograd.grad((kw * dkw).sum() + (vu * dvu).sum(), xs[3])[0]
    assert _rel(got0[3], ref0) <= 1e-12


@runs_triton
def test_fla_dv_local_and_dqkwg_equal_twins_interpreted():
    """fla's chunk_bwd_dv_local and chunk_bwd_dqkwg (interpreted on CPU, or on a GPU) == their twins, fp32."""
    _, _, ins, do, dM = _scan_case(2, dtype=torch.float32, device=DEVICE)
    cu_t = torch.tensor(CU, device=DEVICE)
    q, w, kw, vu, g, M0 = (x.unsqueeze(0).contiguous() if x.dim() == 3 else x for x in ins.values())
    g2 = (g[..., 0] * fla_mean._RCP_LN2).contiguous()
    do = do.unsqueeze(0).contiguous()
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv_local

    kw_args = dict(g=g2, scale=1.0, cu_seqlens=cu_t, chunk_size=C)
    h, v_new, _ = fla_mean.fwd_h_reference(w, kw, vu, g=g2, initial_state=M0, chunk_size=C, cu_seqlens=cu_t)
    dh, _, dvu = fla_mean.bwd_dhu_reference(q, w, kw, do, fla_mean.bwd_dv_local_reference(q, w, do, **kw_args),
                                            g=g2, h0=M0, dht=dM, scale=1.0, cu_seqlens=cu_t, chunk_size=C)
    with fla_mean.one_autotune_config():
        dv = chunk_bwd_dv_local(q=q, k=w, do=do, **kw_args)
        got = chunk_bwd_dqkwg(q=q, k=w, v=v_new, do=do, h=h, dh=dh, w=kw, dv=dvu, **kw_args)
    ref_dv = fla_mean.bwd_dv_local_reference(q, w, do, **kw_args)
    ref = fla_mean.bwd_dqkwg_reference(q, w, v_new, do, h, dh, w=kw, dv=dvu, **kw_args)
    assert _rel(dv, ref_dv) <= 1e-5
    for n, a, b in zip(("dq", "dk", "dw", "dg"), got, ref, strict=True):
        assert a.shape == b.shape and _rel(a, b) <= 1e-5, (n, _rel(a, b))


@runs_triton
def test_mean_pass_fla_backward_equals_autograd_fp32():
    """The adapter with fla's kernels (fwd_h and bwd_dhu by their twins where the interpreter cannot run them),
    float32, against autograd through the mean pass in float64."""
    _, _, ins64, do64, dM64 = _scan_case(2)
    ref = _autograd(ins64, do64, dM64)
    ins = {n: x.to(dtype=torch.float32, device=DEVICE) for n, x in ins64.items()}
    twins = {} if torch.cuda.is_available() else dict(fwd_h=fla_mean.fwd_h_reference, dhu=fla_mean.bwd_dhu_reference)
    with fla_mean.one_autotune_config():
        got = fla_mean.mean_pass_fla_backward(*ins.values(), CU, C, do64.float().to(DEVICE),
                                              dM64.float().to(DEVICE), **twins)
    for n, a, b, x in zip(NAMES, got, ref, ins.values(), strict=True):
        assert a.dtype == x.dtype and a.shape == b.shape, n
        assert _rel(a.double().cpu(), b) <= 2e-5, (n, _rel(a.double().cpu(), b))


def test_backward_refuses_bad_inputs():
    _, _, ins, do, dM = _scan_case(1)
    a = list(ins.values())
    with pytest.raises(TypeError, match="float64"):
        fla_mean.mean_pass_fla_backward(*a, CU, C, do, dM)
    with pytest.raises(ValueError, match="kw must be"):
        fla_mean.mean_pass_backward_reference(a[0], a[1], a[2][None], *a[3:], CU, C, do, dM)
    with pytest.raises(ValueError, match="do must have vu's shape"):
        fla_mean.mean_pass_backward_reference(*a, CU, C, do[:-1], dM)
    with pytest.raises(ValueError, match="dM must have M0's shape"):
        fla_mean.mean_pass_backward_reference(*a, CU, C, do, dM[:1])
    with pytest.raises(ValueError, match="scalar decay"):
        fla_mean.mean_pass_backward_reference(*a[:4], a[4].expand(-1, -1, 8), a[5], CU, C, do, dM)
    with pytest.raises(ValueError, match="cu must be"):
        fla_mean.mean_pass_backward_reference(*a, [0, 40], C, do, dM)
    with pytest.raises(ValueError, match="C must be"):
        fla_mean.mean_pass_backward_reference(*a, CU, 0, do, dM)
    with pytest.raises(ValueError, match="dvu must have v's shape"):
        fla_mean.substitution_backward(ins["kw"].new_zeros(40, 2, C), ins["kw"], ins["vu"], ins["g"], CU, C,
                                       ins["kw"], ins["vu"][:, :, :1])
    with pytest.raises(ValueError, match="linv must hold"):
        fla_mean.substitution_backward(ins["kw"].new_zeros(40, 2, 8), ins["kw"], ins["vu"], ins["g"], CU, C,
                                       ins["kw"], ins["vu"])
