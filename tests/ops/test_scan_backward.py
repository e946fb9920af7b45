"""The explicit backward of the covariance segment scan (``bayeslayer.ops.bayesian_layer.scan_backward``) against
autograd, float64.

Reference 1: autograd through the scan twin's covariance pass
(:func:`bayeslayer.ops.bayesian_layer.scan.covariance_scan`) with random adjoints on every output (w, β, L⁻¹ rows,
variance, L⁻¹K̃, L⁻¹V, g, final P). Reference 2: autograd through the chunk-serial PyTorch path
(:func:`bayeslayer.ops.bayesian_layer.chunk.covariance_pass`, outputs w, variance, final P).  1, 2 and 3 segments,
ragged tails, packed ``cu_seqlens`` with segment boundaries inside sequences, groups, scalar and diagonal decay,
docs/theory.md §6.6's long-memory and stress regimes (asserted: the segment transitions are far from 0, else the
carried adjoint would test nothing).
"""

from __future__ import annotations

import pytest
import torch

from bayeslayer.ops import initial_bl_state
from bayeslayer.ops.bayesian_layer import scan
from bayeslayer.ops.bayesian_layer import scan_backward as sb
from bayeslayer.ops.bayesian_layer.chunk import ChunkDynamics, covariance_pass, from_chunks, pad_time, to_chunks
from bayeslayer.ops.bayesian_layer.covariance import covariance_step, covariance_step_adjoint
from bayeslayer.ops.bayesian_layer.prepare import prepare

from .scan_inputs import regime_inputs

SLOW = pytest.mark.slow  # the full grid; the default run keeps the cases without it

TOL = 1e-10
OUTPUTS = ("w", "beta", "linv", "variance", "kw", "vu", "g", "P")
INPUTS = ("q", "k", "v", "r2", "ell2", "log_alpha", "P0")


def _sym(X):
    return 0.5 * (X + X.mT)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


def _call(regime, diagonal, n_segments=None, *, B=2, T=150, H=2, D=8, m=4, C=16, G=1, cu=None, state=False,
          segment_chunks=None, seed=0):
    q, k, v, r2, ell2, alpha = regime_inputs(regime, B, T, H, D, m, diagonal=diagonal, G=G, seed=seed)
    M0 = P0 = None
    if state:
        n = len(cu) - 1 if cu is not None else B
        M0, P0 = initial_bl_state(n, H, D, m, p0=0.5, groups=G, dtype=torch.float64)
        g = torch.Generator().manual_seed(seed + 7)
        X = torch.randn(P0.shape, generator=g, dtype=torch.float64) / D
        P0 = P0 + X @ X.mT  # a full (non-diagonal) start covariance
    cu_t = torch.tensor(cu) if cu is not None else None
    return scan.prepare_scan(q, k, v, r2, ell2, alpha, 1.0, M0, P0, cu_t, C, n_segments=n_segments,
                             segment_chunks=segment_chunks)


def _autograd_scan(call, seed=1):
    """Autograd through ``covariance_scan`` with random adjoints on all its outputs."""
    leaves = {name: getattr(call, name).detach().clone().requires_grad_(True) for name in INPUTS}
    out = scan.covariance_scan(*(leaves[n] for n in INPUTS), call.cu, call.C, segment_chunks=call.segment_chunks,
                               want_var=True)
    g = torch.Generator().manual_seed(seed)
    cot = {n: torch.randn(getattr(out, n).shape, generator=g, dtype=torch.float64) for n in OUTPUTS}
    loss = sum((getattr(out, n) * cot[n]).sum() for n in OUTPUTS)
    auto = dict(zip(INPUTS, torch.autograd.grad(loss, list(leaves.values())), strict=True))
    auto["P0"] = _sym(auto["P0"])  # only the symmetric part is defined for a covariance
    return out, cot, auto


def _explicit(call, out, cot):
    return sb.covariance_scan_backward(
        *(getattr(call, n) for n in INPUTS), call.cu, call.C, segment_chunks=call.segment_chunks,
        P_starts=out.P_starts.detach(), dw=cot["w"], dbeta=cot["beta"], dlinv=cot["linv"],
        dvariance=cot["variance"], dkw=cot["kw"], dvu=cot["vu"], dg=cot["g"], dP=cot["P"])


def _assert_equal(auto: dict, mine, names=INPUTS):
    for name in names:
        a, b = auto[name], getattr(mine, name)
        assert a.abs().max() > 0, f"d{name} is identically zero; the comparison would be vacuous"
        err = _rel(a, b)
        assert err <= TOL, f"d{name}: |explicit - autograd| / max|autograd| = {err:.2e}"


def _transition_norms(call) -> torch.Tensor:
    """Spectral norms of the segment transitions A_s of every segment that is not last in its sequence."""
    lay = scan.scan_layout(call.cu, call.C, call.segment_chunks, call.k.device)
    xs = {name: lay.grid(x, fill) for name, x, fill in
          (("k", call.k, 0.0), ("r2", call.r2, 1.0), ("ell2", call.ell2, 0.0), ("la", call.log_alpha, 0.0))}
    A, _, _, info = scan.phase_a(lay, xs, lay.element_segments)
    assert not info.any()
    return torch.linalg.matrix_norm(A, ord=2)


@pytest.mark.parametrize("regime", ["longmem", pytest.param("stress", marks=SLOW)])
@pytest.mark.parametrize("diagonal", [False, True])
@pytest.mark.parametrize("n_segments", [pytest.param(1, marks=SLOW), pytest.param(2, marks=SLOW), 3])
def test_backward_equals_autograd_through_the_scan(regime, diagonal, n_segments):
    call = _call(regime, diagonal, n_segments)  # 10 chunks of 16, the last ragged (6 tokens)
    out, cot, auto = _autograd_scan(call)
    with torch.no_grad():
        mine = _explicit(call, out, cot)
    _assert_equal(auto, mine)
    lay = scan.scan_layout(call.cu, call.C, call.segment_chunks, call.k.device)
    assert lay.n_segments == 2 * n_segments
    if n_segments > 1:
        norms = _transition_norms(call)
        assert norms.numel() > 0 and norms.min() > 0.1  # the carried adjoint matters


@pytest.mark.parametrize("regime", ["longmem", pytest.param("stress", marks=SLOW)])
@pytest.mark.parametrize("diagonal", [False, True])
@pytest.mark.parametrize("G", [pytest.param(1, marks=SLOW), 2])
def test_backward_segments_inside_cu_seqlens(regime, diagonal, G):
    """Packed sequences of 37, 0, 100 and 13 tokens from their own full P0, segments of 2 chunks."""
    cu = [0, 37, 37, 137, 150]
    call = _call(regime, diagonal, B=1, G=G, cu=cu, state=True, segment_chunks=2, seed=1)
    lay = scan.scan_layout(call.cu, call.C, call.segment_chunks, call.k.device)
    assert lay.seq_n_seg.tolist() == [2, 1, 4, 1]
    out, cot, auto = _autograd_scan(call, seed=3)
    with torch.no_grad():
        mine = _explicit(call, out, cot)
    _assert_equal(auto, mine)
    assert _transition_norms(call).min() > 0.1
    if not diagonal and G == 1:  # Phase A's elements handed over (as a forward that kept them would) change nothing
        xs = {name: lay.grid(getattr(call, src), fill) for name, src, fill in
              (("k", "k", 0.0), ("r2", "r2", 1.0), ("ell2", "ell2", 0.0), ("la", "log_alpha", 0.0))}
        A, Cm, J, _ = scan.phase_a(lay, xs, lay.element_segments)
        with torch.no_grad():
            kept = sb.covariance_scan_backward(
                *(getattr(call, n) for n in INPUTS), call.cu, call.C, segment_chunks=call.segment_chunks,
                P_starts=out.P_starts.detach(), dw=cot["w"], dbeta=cot["beta"], dlinv=cot["linv"],
                dvariance=cot["variance"], dkw=cot["kw"], dvu=cot["vu"], dg=cot["g"], dP=cot["P"],
                elements=(A, Cm, J))
        assert all(torch.equal(a, b) for a, b in zip(kept, mine, strict=True))


@pytest.mark.parametrize("regime", ["longmem", pytest.param("stress", marks=SLOW)])
@pytest.mark.parametrize("diagonal", [False, True])
@pytest.mark.parametrize("n_segments", [pytest.param(1, marks=SLOW), pytest.param(2, marks=SLOW), 3])
def test_backward_equals_autograd_through_the_chunk_path(regime, diagonal, n_segments):
    """Autograd through the chunk-serial covariance pass (w, variance, final P), which knows no segments."""
    B, T, H, D, m, C = 2, 150, 2, 8, 4, 16
    q, k, v, r2, ell2, alpha = regime_inputs(regime, B, T, H, D, m, diagonal=diagonal, seed=4)
    pr = prepare(q, k, v, write="bayes", r2=r2, ell2=ell2, alpha=alpha)
    leaves = dict(q=pr.q, k=pr.k, r2=pr.r2, ell2=pr.ell2, log_alpha=pr.dyn.log_alpha)
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in leaves.items()}
    g = torch.Generator().manual_seed(5)
    X = torch.randn(B, H, D, D, generator=g, dtype=torch.float64) / D
    P0 = (0.5 * torch.eye(D, dtype=torch.float64) + X @ X.mT).requires_grad_(True)
    pad = (-T) % C

    def ch(x, fill=0.0):
        return to_chunks(pad_time(x, pad, fill), C)

    dyn = ChunkDynamics(ch(leaves["log_alpha"]), None)
    w, var, P = covariance_pass(dyn, ch(leaves["q"]), ch(leaves["k"]), ch(leaves["r2"], 1.0), ch(leaves["ell2"]), P0)
    w, var = from_chunks(w, T), from_chunks(var, T)
    cw, cv, cP = (torch.randn(x.shape, generator=g, dtype=torch.float64) for x in (w, var, P))
    auto = torch.autograd.grad((w * cw).sum() + (var * cv).sum() + (P * cP).sum(), [*leaves.values(), P0])
    auto = {n: a.reshape(B * T, *a.shape[2:]) for n, a in zip(leaves, auto[:-1], strict=True)} | {"P0": _sym(auto[-1])}

    def pk(x):
        return x.detach().reshape(B * T, *x.shape[2:])

    cu = [b * T for b in range(B + 1)]
    n_s = -(-10 // n_segments)
    fwd = scan.covariance_scan(pk(pr.q), pk(pr.k), pk(pr.v), pk(pr.r2), pk(pr.ell2), pk(pr.dyn.log_alpha),
                               P0.detach(), cu, C, segment_chunks=n_s, want_var=True)
    with torch.no_grad():
        mine = sb.covariance_scan_backward(pk(pr.q), pk(pr.k), pk(pr.v), pk(pr.r2), pk(pr.ell2),
                                           pk(pr.dyn.log_alpha), P0.detach(), cu, C, segment_chunks=n_s,
                                           P_starts=fwd.P_starts, dw=pk(cw), dvariance=pk(cv), dP=cP)
    _assert_equal(auto, mine, names=("q", "k", "r2", "ell2", "log_alpha", "P0"))
    assert mine.v.abs().max() == 0  # no adjoint reaches v without one on L⁻¹V


def _step(t: dict, P, q, v) -> dict:
    """The covariance step on the twin's per-chunk terms, every output asked for (as B2/B4 replay it)."""
    return covariance_step(t["dyn"], t["kt"], t["NBk"], t["base"], t["BC"], P, q=q, qt=t["qt"], qBq=t["qBq"], v=v,
                           factors=True, save=True)


@pytest.mark.parametrize("diagonal", [False, True])
def test_chunk_adjoint_equals_autograd(diagonal):
    """One chunk (terms + replay) against autograd, every output adjoint at once: the kernels' unit reference."""
    q, k, v, r2, ell2, alpha = regime_inputs("longmem", 3, 16, 2, 8, 4, diagonal=diagonal, seed=6)
    mv = lambda x: x.movedim(1, 2)  # noqa: E731  [B, T, H, ·] -> [B, H, C, ·]
    la = torch.log(alpha)[..., None] if not diagonal else torch.log(alpha)
    x = dict(q=mv(q), k=mv(k), v=mv(v), r2=mv(r2), ell2=mv(ell2), la=mv(la))
    g = torch.Generator().manual_seed(7)
    X = torch.randn(3, 2, 8, 8, generator=g, dtype=torch.float64) / 8
    x["P"] = 0.3 * torch.eye(8, dtype=torch.float64) + X @ X.mT
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    t = sb.chunk_terms(leaves["k"], leaves["r2"], leaves["ell2"], leaves["la"], q=leaves["q"])
    sv = _step(t, leaves["P"], leaves["q"], leaves["v"])
    outs = dict(P_next=sv["P"], W=sv["W"], beta=sv["beta"], Linv=sv["Linv"], var=sv["var"],
                kw=sv["kw"], vu=sv["vu"], g=torch.cumsum(leaves["la"], -2))
    cot = {n: torch.randn(o.shape, generator=g, dtype=torch.float64) for n, o in outs.items()}
    cot["Linv"] = cot["Linv"].tril()
    auto = torch.autograd.grad(sum((outs[n] * cot[n]).sum() for n in outs), list(leaves.values()))
    with torch.no_grad():
        t0 = sb.chunk_terms(x["k"], x["r2"], x["ell2"], x["la"], q=x["q"])
        s0 = _step(t0, x["P"], x["q"], x["v"])["saved"]
        dP, dt, dq, dv = covariance_step_adjoint(
            t0["dyn"], t0["kt"], t0["NBk"], s0, cot["P_next"], q=x["q"], qt=t0["qt"], v=x["v"], dW=cot["W"],
            dbeta=cot["beta"], dLinv=cot["Linv"], dvar=cot["var"], dkw=cot["kw"], dvu=cot["vu"])
        dk, dr2, dell2, dla, dq2 = sb.terms_adjoint(x["k"], x["r2"], x["ell2"], x["la"], t0, dt, q=x["q"], dg=cot["g"])
    mine = dict(q=dq + dq2, k=dk, v=dv, r2=dr2, ell2=dell2, la=dla, P=dP)
    for (name, a) in zip(leaves, auto, strict=True):
        b = mine[name]
        if name == "P":
            a, b = _sym(a), _sym(b)
        assert a.abs().max() > 0
        assert _rel(a, b) <= TOL, (name, _rel(a, b))


def test_element_transition_is_the_derivative_of_apply_element():
    """``Ā = A(I + PJ)⁻¹`` and ``vjp(apply_element, P)[P̄] = sym(Āᵀ sym(P̄) Ā)`` (transpose and form checked)."""
    g = torch.Generator().manual_seed(8)
    D = 6

    def spd(scale):
        X = torch.randn(3, D, D, generator=g, dtype=torch.float64)
        return scale * (X @ X.mT / D) + 0.1 * torch.eye(D, dtype=torch.float64)

    A = torch.randn(3, D, D, generator=g, dtype=torch.float64)
    P, J, Cm = spd(1.0), spd(3.0), spd(0.5)
    Ab = sb.element_transition(A, J, P)
    eye = torch.eye(D, dtype=torch.float64)
    assert _rel(A @ torch.linalg.inv(eye + P @ J), Ab) <= 1e-12
    Pl = P.clone().requires_grad_(True)
    out, _ = scan.apply_element(A, Cm, J, Pl)
    Pbar = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (auto,) = torch.autograd.grad((out * Pbar).sum(), Pl)
    assert _rel(_sym(auto), _sym(Ab.mT @ _sym(Pbar) @ Ab)) <= 1e-12
    assert _rel(_sym(auto), _sym(Ab @ _sym(Pbar) @ Ab.mT)) > 1e-3  # the other transpose is wrong


def test_b4_start_adjoints_equal_b3():
    """The replayed true adjoint at each segment start (B4) equals B3's linearised carry: the scan is consistent."""
    call = _call("stress", False, 3)
    out, cot, _ = _autograd_scan(call)
    lay = scan.scan_layout(call.cu, call.C, call.segment_chunks, call.k.device)
    xs = {name: lay.grid(getattr(call, src), fill) for name, src, fill in
          (("q", "q", 0.0), ("k", "k", 0.0), ("v", "v", 0.0), ("r2", "r2", 1.0), ("ell2", "ell2", 0.0),
           ("la", "log_alpha", 0.0))}
    dxs = {n: lay.grid(cot[n], 0.0) for n in sb.GRAD_NAMES}
    with torch.no_grad():
        end = torch.zeros_like(out.P_starts)
        end[lay.last_segments] = cot["P"]
        G, none = sb.segment_adjoint(lay, xs, dxs, out.P_starts, end, inputs=False)
        assert none is None
        segs = lay.element_segments
        A, _, J, _ = scan.phase_a(lay, {n: xs[n] for n in ("k", "r2", "ell2", "la")}, segs)
        Pbar = sb.reverse_segments(lay, G, sb.element_transition(A, J, out.P_starts[segs]))
        end[segs] = Pbar[segs + 1]
        dP_start, _ = sb.segment_adjoint(lay, xs, dxs, out.P_starts, end, inputs=True)
    assert _rel(Pbar, dP_start) <= TOL
    assert _rel(Pbar[segs], G[segs]) > 1e-3  # the carried part is not negligible


def test_per_chunk_calls_do_not_grow_with_segments(monkeypatch):
    """B2/B4 run all segments together: per-chunk calls grow with chunks per segment, not with segments."""
    counts = {"covariance_step": 0, "covariance_step_adjoint": 0, "terms_adjoint": 0}
    for name in counts:
        fn = getattr(sb, name)

        def counted(*a, _fn=fn, _name=name, **kw):
            counts[_name] += 1
            return _fn(*a, **kw)

        monkeypatch.setattr(sb, name, counted)

    def run(T, n_s):
        for name in counts:
            counts[name] = 0
        call = _call("longmem", False, B=1, T=T, C=8, segment_chunks=n_s)
        out = scan.covariance_scan(*(getattr(call, n) for n in INPUTS), call.cu, call.C, segment_chunks=n_s,
                                   want_var=False)
        g = torch.Generator().manual_seed(0)
        sb.covariance_scan_backward(*(getattr(call, n) for n in INPUTS), call.cu, call.C, segment_chunks=n_s,
                                    P_starts=out.P_starts, dw=torch.randn(out.w.shape, generator=g,
                                                                          dtype=torch.float64))
        return dict(counts), scan.scan_layout(call.cu, call.C, n_s, call.k.device).n_segments

    c2, s2 = run(32, 2)  # 4 chunks: 2 segments of 2
    c8, s8 = run(128, 2)  # 16 chunks: 8 segments of 2
    c4, _ = run(128, 4)  # 16 chunks: 4 segments of 4
    assert (s2, s8) == (2, 8)
    # B2 + B4 replays, B4 inputs
    assert c2 == c8 == {"covariance_step": 4, "covariance_step_adjoint": 4, "terms_adjoint": 2}
    assert c4 == {name: 2 * n for name, n in c2.items()}


def test_bad_input():
    call = _call("longmem", False, 2)
    out = scan.covariance_scan(*(getattr(call, n) for n in INPUTS), call.cu, call.C,
                               segment_chunks=call.segment_chunks, want_var=False)
    args = [getattr(call, n) for n in INPUTS]
    kw = dict(segment_chunks=call.segment_chunks, P_starts=out.P_starts)
    with pytest.raises(ValueError, match="P_starts"):
        sb.covariance_scan_backward(*args, call.cu, call.C, **{**kw, "P_starts": out.P_starts[:1]})
    with pytest.raises(ValueError, match="dw"):
        sb.covariance_scan_backward(*args, call.cu, call.C, dw=out.w[:-1], **kw)
    with pytest.raises(ValueError, match="dbeta"):
        sb.covariance_scan_backward(*args, call.cu, call.C, dbeta=out.beta.float(), **kw)
    with pytest.raises(ValueError, match="ell2"):
        bad = list(args)
        bad[4] = call.ell2.float()
        sb.covariance_scan_backward(*bad, call.cu, call.C, **kw)
    with pytest.raises(ValueError, match="log_alpha"):
        bad = list(args)
        bad[5] = call.log_alpha.expand(*call.log_alpha.shape[:2], 3)
        sb.covariance_scan_backward(*bad, call.cu, call.C, **kw)
    with pytest.raises(ValueError, match="cu"):
        sb.covariance_scan_backward(*args, [0, 5], call.C, **kw)
    with pytest.raises(ValueError, match="P0"):
        bad = list(args)
        bad[6] = call.P0[:1]
        sb.covariance_scan_backward(*bad, call.cu, call.C, **kw)
    with pytest.raises(ValueError, match="segment_chunks"):
        sb.covariance_scan_backward(*args, call.cu, call.C, **{**kw, "segment_chunks": 0})
    with pytest.raises(ValueError, match="elements"):
        sb.covariance_scan_backward(*args, call.cu, call.C, elements=(out.P,), **kw)
    with pytest.raises(ValueError, match="J"):
        sb.element_transition(out.P[:, 0], out.P[:1, 0], out.P[:, 0])
    t = sb.chunk_terms(torch.zeros(4, 3), torch.ones(4), torch.zeros(4), torch.zeros(4, 1))
    st = covariance_step(t["dyn"], t["kt"], t["NBk"], t["base"], t["BC"], torch.eye(3), factors=True, save=True)
    with pytest.raises(ValueError, match="dvar needs q"):
        covariance_step_adjoint(t["dyn"], t["kt"], t["NBk"], st["saved"], torch.zeros(3, 3), dvar=torch.zeros(4))
    with pytest.raises(ValueError, match="dvu needs v"):
        covariance_step_adjoint(t["dyn"], t["kt"], t["NBk"], st["saved"], torch.zeros(3, 3), dvu=torch.zeros(4, 2))
    with pytest.raises(ValueError, match="saved"):
        covariance_step_adjoint(t["dyn"], t["kt"], t["NBk"], st, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="dP_next"):
        covariance_step_adjoint(t["dyn"], t["kt"], t["NBk"], st["saved"], torch.zeros(3, 2))
    with pytest.raises(TypeError, match="lay"):
        sb.reverse_segments(None, out.P_starts, out.P_starts)
