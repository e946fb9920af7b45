"""The covariance chain kernels against the float64 oracle (``bl_recurrent``), forward and backward.

Under ``TRITON_INTERPRET=1`` on CPU tensors (or compiled, on a GPU): the chain forward
(``ops/bayesian_layer/chain_triton.py::chain_forward_kernel``), the mean pass on its outputs and the reverse chain
(``chain_backward_kernel``) through :func:`bayeslayer.ops.bayesian_layer.chunk_triton.chain_chunk`, in float64,
must equal the token-by-token Kalman filter to 1e-12 relative: the outputs, the variance, the final state and the
gradient of every input (the initial state's included).  The default run has one small case per kernel; the grid
(odd lengths, packed sequences with ragged and empty ones, scalar and diagonal decay, G = 1 and 2, D = 16..128,
chunk sizes 16, 32, 64) is slow.
"""

from __future__ import annotations

import os

import pytest
import torch

from bayeslayer.ops.bayesian_layer.recurrent import bl_recurrent

from .inputs import bl_inputs, fixed_weights, random_psd

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"),
    reason="Triton kernels need a CUDA device or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET", "0") != "1" else "cpu"
TOL = 1e-12


def _inputs(B, T, H, D, m, G, dynamics, init, cu, seed=0):
    torch.manual_seed(seed)
    if cu is not None:
        B, T = 1, cu[-1]
    x = bl_inputs(B=B, T=T, H=H, D=D, m=m, G=G, dynamics=dynamics, initial_state=False)
    N = B if cu is None else len(cu) - 1
    if init:
        P0 = random_psd(N, H, D=D) if G == 1 else random_psd(N, H, G, D=D)
        x["initial_state"] = (torch.randn(N, H, D, m, dtype=torch.float64), P0)
    return x, N


def _reference(x, cu, init):
    """``(o, variance, M, P)`` of ``bl_recurrent``, one call per packed sequence."""
    names = ("q", "k", "v", "r2", "ell2", "alpha")
    if cu is None:
        o, var, (M, P) = bl_recurrent(*(x[n] for n in names), None, 1.0, x["initial_state"],
                                      output_final_state=True, return_variance=True)
        return o, var, M, P
    outs = []
    for n in range(len(cu) - 1):
        sl = slice(cu[n], cu[n + 1])
        st = (x["initial_state"][0][n:n + 1], x["initial_state"][1][n:n + 1]) if init else None
        outs.append(bl_recurrent(*(x[k][:, sl] if x[k] is not None else None for k in names), None, 1.0, st,
                                 output_final_state=True, return_variance=True))
    o = torch.cat([r[0] for r in outs], 1)
    var = torch.cat([r[1] for r in outs], 1)
    return o, var, torch.cat([r[2][0] for r in outs]), torch.cat([r[2][1] for r in outs])


def _check(B=2, T=40, H=2, D=16, m=8, G=1, dynamics="scalar", init=True, cu=None, C=32, grads=True):
    from bayeslayer.ops.bayesian_layer.chunk_triton import chain_chunk

    x, N = _inputs(B, T, H, D, m, G, dynamics, init, cu)
    names = [n for n in ("q", "k", "v", "r2", "ell2", "alpha") if x[n] is not None]
    leaves = {n: x[n].clone().requires_grad_(grads) for n in names}
    if init:
        leaves["M0"] = x["initial_state"][0].clone().requires_grad_(grads)
        leaves["P0"] = x["initial_state"][1].clone().requires_grad_(grads)
    ref_x = dict(leaves, alpha=leaves.get("alpha"), initial_state=(leaves["M0"], leaves["P0"]) if init else None)
    ref = _reference(ref_x, cu, init)
    dev = {n: t.to(DEVICE) for n, t in leaves.items()}
    cu_t = torch.tensor(cu, dtype=torch.int64, device=DEVICE) if cu is not None else None
    out = chain_chunk(dev["q"], dev["k"], dev["v"], dev["r2"], dev["ell2"], dev.get("alpha"), 1.0, dev.get("M0"),
                      dev.get("P0"), cu_t, C, True)
    for name, a, b in zip(("o", "variance", "M", "P"), out, ref, strict=True):
        err = ((a.cpu() - b).abs().max() / b.abs().max()).item()
        assert err <= TOL, f"{name}: {err:.2e}"
    if not grads:
        return
    w = fixed_weights(ref)
    g = torch.autograd.grad(sum((a.cpu() * wi).sum() for a, wi in zip(out, w, strict=True)), list(leaves.values()))
    g_ref = torch.autograd.grad(sum((a * wi).sum() for a, wi in zip(ref, w, strict=True)), list(leaves.values()))
    for name, a, b in zip(leaves, g, g_ref, strict=True):
        if name == "P0":  # a covariance's gradient is defined up to its antisymmetric part
            a, b = 0.5 * (a + a.transpose(-1, -2)), 0.5 * (b + b.transpose(-1, -2))
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err <= TOL, f"d{name}: {err:.2e}"


def test_chain_forward_and_backward_equal_the_oracle_fp64():
    """One small case per kernel: scalar decay, two sequences of 40 tokens (a ragged second chunk), an initial
    state, the variance, every gradient."""
    _check()


def test_chain_diagonal_packed_fp64():
    """Per-channel decay over packed sequences (an empty one among them), G = 2, forward and backward."""
    _check(dynamics="diagonal", cu=[0, 9, 9, 23], H=1, G=2, m=4, C=16)


GRID = [
    dict(dynamics="scalar", T=63, D=16, C=16),
    dict(dynamics="diagonal", T=63, D=16, C=32),
    dict(dynamics="identity", T=70, D=24, G=2, m=6, C=64),
    dict(dynamics="diagonal", T=33, D=20, G=2, m=4, C=16, init=False),
    dict(dynamics="scalar", cu=[0, 5, 5, 40, 47], D=16, C=16),
    dict(dynamics="diagonal", cu=[0, 17, 17, 50], D=16, G=2, m=4, C=32),
    dict(dynamics="scalar", T=65, D=64, m=16, H=1, C=32),
    dict(dynamics="diagonal", T=37, D=32, m=8, H=1, C=32, cu=[0, 0, 37]),
    dict(dynamics="scalar", T=40, D=128, m=8, H=1, B=1, C=32),
    dict(dynamics="scalar", T=100, D=16, G=2, m=4, C=32, init=False),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", GRID, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_chain_grid_fp64(case):
    _check(**case)


def test_fp32_inputs_run_float64_arithmetic_below_the_scans_error():
    """fp32 inputs: the chain computes in float64 (chosen by dtype and D, statically), so on the stress regime of
    docs/theory.md §6.6 its error against float64 is far below the fp32 segment scan's and below the chain's own
    error with fp32 arithmetic (IEEE products), in the outputs, the state and the gradients (margins of 10× and
    more: ``benchmarks/chain_precision.py`` measures 3-300×); bf16 inputs keep tensor-core products."""
    from bayeslayer.ops import value_checks
    from bayeslayer.ops.bayesian_layer import chain_triton, mean_pass_fla
    from bayeslayer.ops.bayesian_layer.chunk_triton import bl_chunk_triton

    from .scan_inputs import regime_inputs

    assert chain_triton.default_precision(torch.float32, 64) == "float64"
    assert chain_triton.default_precision(torch.float32, 128) == "tf32x3"  # the float64 backward's shared memory
    for dt in (torch.bfloat16, torch.float16):
        assert chain_triton.default_precision(dt, 16) == chain_triton.default_precision(dt, 128) == "tf32x3"
    assert chain_triton.kernel_arithmetic(torch.float32, None, torch.float32, 16) == (torch.float64, "ieee")
    assert chain_triton.kernel_arithmetic(torch.float32, None, torch.bfloat16, 16) == (torch.float32, "tf32x3")
    xs = regime_inputs("stress", 1, 48, 1, 16, 8, seed=3)  # measured margins 21-83x (T = 64: 18-110x)
    p0 = torch.eye(16, dtype=torch.float64)[None, None] * 0.5
    m0 = torch.zeros(1, 1, 16, 8, dtype=torch.float64)

    ref_leaves = [x.clone().requires_grad_(True) for x in (*xs, m0, p0)]  # the float64 oracle, once for the 3 runs
    ro, (rM, rP) = bl_recurrent(*ref_leaves[:6], initial_state=tuple(ref_leaves[6:]), output_final_state=True)
    rg = torch.autograd.grad(ro.square().sum() + rM.sum() + rP.sum(), ref_leaves[1])

    def errors(path, prec=None):
        saved = chain_triton.FP32_PRECISION
        leaves = [x.float().to(DEVICE).requires_grad_(True) for x in (*xs, m0, p0)]
        try:
            chain_triton.FP32_PRECISION = prec or saved
            with value_checks(False), mean_pass_fla.one_autotune_config():
                o, (M, P) = bl_chunk_triton(*leaves[:6], initial_state=tuple(leaves[6:]), output_final_state=True,
                                            path=path)
                g = torch.autograd.grad(o.double().square().sum() + M.double().sum() + P.double().sum(), leaves[1])
        finally:
            chain_triton.FP32_PRECISION = saved
        return [((a.detach().cpu().double() - b.detach()).abs().max() / b.abs().max()).item()
                for a, b in zip((o, M, P, g[0]), (ro, rM, rP, rg[0]), strict=True)]

    chain, scan, fp32 = errors("chain"), errors("scan"), errors("chain", "ieee")
    for name, c, s_, f in zip(("o", "M", "P", "dk"), chain, scan, fp32, strict=True):
        assert c <= 0.1 * s_ and c <= 0.1 * f, f"{name}: chain {c:.1e}, scan {s_:.1e}, chain fp32 {f:.1e}"


def test_chain_refuses_an_unknown_precision_and_checkpoints_of_another_arithmetic():
    from bayeslayer.ops.bayesian_layer import chain_triton

    with pytest.raises(ValueError, match="prec must be one of"):
        chain_triton.kernel_arithmetic(torch.float32, "fp8", torch.float32, 16)
    layout = chain_triton.chain_layout(None, 1, 4, 16, "cpu")
    x = torch.zeros(4, 1, 16)
    s = torch.zeros(4, 1)
    ck = torch.zeros(layout.n_checkpoints, 1, 16, 16)  # fp32: what tf32x3, not the fp32 default "float64", saves
    with pytest.raises(ValueError, match="checkpoints must be torch.float64"):
        chain_triton.chain_backward(x, x, x, s, s, s[..., None], layout, ck, dw=x, dkw=x, dvu=x)
    # the factors the forward kept beside the checkpoints: required, in the checkpoints' dtype and layout
    ck = ck.double()
    for factors in (None, torch.zeros(layout.n_checkpoints, 1, 16, 17),
                    torch.zeros(layout.n_checkpoints, 1, 16, 16, dtype=torch.float64)):
        with pytest.raises(ValueError, match="factors must be a torch.float64"):
            chain_triton.chain_backward(x, x, x, s, s, s[..., None], layout, ck, factors, dw=x, dkw=x, dvu=x)
    # the forward's w and kw, when handed on, have its [NT, H', D]
    factors = torch.zeros(layout.n_checkpoints, 1, 16, 17, dtype=torch.float64)
    with pytest.raises(ValueError, match="kw must be the forward's"):
        chain_triton.chain_backward(x, x, x, s, s, s[..., None], layout, ck, factors, dw=x, dkw=x, dvu=x, w=x,
                                    kw=x[:, :, :8])


def test_default_path_never_syncs_with_the_host(monkeypatch):
    """Forward and backward of the default path (``bl_chunk(backend="triton")``: the covariance chain, fla's mean
    pass and their backwards), fp32, value checks off: no ``Tensor.item``, ``bool(tensor)``, ``Tensor.tolist``,
    ``int(tensor)`` or ``float(tensor)`` anywhere — on a GPU each would stall the launch queue and break graph
    capture."""
    from bayeslayer.ops import bl_chunk, value_checks
    from bayeslayer.ops.bayesian_layer import mean_pass_fla

    x, _ = _inputs(2, 20, 1, 16, 8, 1, "scalar", True, None)
    leaves = [t.float().to(DEVICE).requires_grad_(True)
              for t in (x["q"], x["k"], x["v"], x["r2"], x["ell2"], x["alpha"], *x["initial_state"])]
    q, k, v, r2, ell2, alpha, M0, P0 = leaves

    def forbidden(name):
        def raise_(*args, **kwargs):
            raise AssertionError(f"Tensor.{name} read a tensor on the host")
        return raise_

    with value_checks(False), mean_pass_fla.one_autotune_config():
        for name in ("item", "__bool__", "tolist", "__int__", "__float__"):
            monkeypatch.setattr(torch.Tensor, name, forbidden(name))
        o, var, (M, P) = bl_chunk(q, k, v, r2, ell2, alpha, initial_state=(M0, P0), output_final_state=True,
                                  return_variance=True, backend="triton")
        (o.square().sum() + var.sum() + M.sum() + P.sum()).backward()
        monkeypatch.undo()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)


def test_covariance_path_rule(monkeypatch):
    """One function decides: the chain wherever the chains fill the SMs or the sequence is too short to split, the
    scan above the chain's key dims and for an explicit n_segments; for fewer, longer chains the cost model's
    crossover (``crossover.scan_predicted_faster``), whichever way its figures point."""
    from bayeslayer.ops.bayesian_layer import chunk_triton as ct
    from bayeslayer.ops.bayesian_layer import crossover as xo

    assert ct.covariance_path(132, 32768, 64) == "chain"  # one chain per SM
    assert ct.covariance_path(32, 4096, 64) == "chain"  # T too short for the scan to split
    assert ct.covariance_path(512, 2048, 256) == "scan"  # P of D = 256 does not stay on chip
    assert ct.covariance_path(512, 2048, 64, n_segments=2) == "scan"
    for N in (1, 4, 16, 32, 64, 131):  # the record's figures decide
        want = "scan" if xo.scan_predicted_faster(N, 32768, 64) else "chain"
        assert ct.covariance_path(N, 32768, 64) == want
    steps = {"a": (100, 1), "track": (50, 2), "b": (400, 2), "c": (100, 1)}
    monkeypatch.setattr(xo, "STEP_CYCLES", {128: dict(steps, chain=(100_000, 1))})  # a slow chain step: the scan
    assert ct.covariance_path(8, 32768, 64) == "scan" and ct.covariance_path(132, 32768, 64) == "chain"
    monkeypatch.setattr(xo, "STEP_CYCLES", {128: dict(steps, chain=(10, 1))})  # a fast one: never the scan
    assert ct.covariance_path(8, 32768, 64) == "chain"
    with pytest.raises(ValueError, match="n_chains"):
        ct.covariance_path(-1, 10, 64)


def test_first_cuda_call_of_a_never_run_path_warns_once(monkeypatch):
    from bayeslayer.ops.bayesian_layer import chunk_triton as ct

    monkeypatch.setattr(ct, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="'chain' kernels have never run on a GPU"):
        ct._warn_never_run("chain", torch.device("cuda"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ct._warn_never_run("chain", torch.device("cuda"))  # once per process
        ct._warn_never_run("scan", torch.device("cpu"))  # the interpreter: no warning
        monkeypatch.setitem(ct.RUN_ON_DEVICE, "scan", ("NVIDIA H200",))
        ct._warn_never_run("scan", torch.device("cuda"))  # a path that has run: no warning
