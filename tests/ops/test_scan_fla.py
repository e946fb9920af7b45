"""The mean pass on flash-linear-attention's kernels (``bayeslayer.ops.bayesian_layer.mean_pass_fla``).

fla's ``chunk_fwd_o``, ``chunk_gla_fwd_intra_gk`` and ``chunk_gla_fwd_o_gk`` run here under the
Triton interpreter; fla 0.6.0's ``chunk_gated_delta_rule_fwd_h`` does not (its loop index is a
Python int there, ``i_t.to(tl.int64)`` fails), so its plain-PyTorch twin stands in on CPU and
``benchmarks/gpu.py --check`` compares fla's own ``fwd_h`` with that twin on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from bayeslayer.ops import bl_chunk
from bayeslayer.ops.bayesian_layer import mean_pass_fla, scan
from bayeslayer.ops.bayesian_layer.chunk import ChunkDynamics, Chunked, covariance_pass, mean_pass
from bayeslayer.ops.bayesian_layer.prepare import prepare

from .scan_inputs import regime_inputs

fla = pytest.importorskip("fla")
interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cuda" if not interpreted and torch.cuda.is_available() else "cpu"
runs_triton = pytest.mark.skipif(not (torch.cuda.is_available() or interpreted),
                                 reason="needs a CUDA device or TRITON_INTERPRET=1")


def _scan_outputs(diagonal, dtype, cu, T=40, H=2, D=16, m=8, C=16, seed=0, device="cpu"):
    q, k, v, r2, ell2, alpha = regime_inputs("longmem", 1, T, H, D, m, diagonal=diagonal, dtype=dtype, seed=seed,
                                             device=device)
    pr = prepare(q, k, v, write="bayes", r2=r2, ell2=ell2, alpha=alpha)

    def pk(x):
        return x.reshape(T, *x.shape[2:])

    P0 = pr.P0[:1].expand(len(cu) - 1, -1, -1, -1)
    sc = scan.covariance_scan(pk(pr.q), pk(pr.k), pk(pr.v), pk(pr.r2), pk(pr.ell2), pk(pr.dyn.log_alpha), P0, cu,
                              C, segment_chunks=2, want_var=False)
    g = torch.Generator().manual_seed(seed + 1)
    M0 = 0.3 * torch.randn(len(cu) - 1, H, D, m, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    return pk(pr.q), sc, M0


def test_mean_pass_reference_equals_bl_mean_pass():
    """The twin on the scan's outputs == the project's mean pass on the chunk path's write keys (float64)."""
    T, C = 64, 16
    q, k, v, r2, ell2, alpha = regime_inputs("stress", 1, T, 2, 8, 4)
    pr = prepare(q, k, v, write="bayes", r2=r2, ell2=ell2, alpha=alpha)
    ch = Chunked(pr, C, need_noise=True)
    dyn = ChunkDynamics(ch.log_alpha, None)
    W, _, _ = covariance_pass(dyn, None, ch.k, ch.r2, ch.ell2, pr.P0)
    o_ref, M_ref = mean_pass(dyn, ch.q, ch.k, ch.v, W, pr.M0, erase=True)
    qf, k2, v2, r22, l22, a2 = (x.reshape(T, *x.shape[2:]) for x in (pr.q, pr.k, pr.v, pr.r2, pr.ell2,
                                                                       pr.dyn.log_alpha))
    sc = scan.covariance_scan(qf, k2, v2, r22, l22, a2, pr.P0, [0, T], C, segment_chunks=2, want_var=False)
    o, M = scan.mean_pass_reference(qf, sc.w, sc.kw, sc.vu, sc.g, pr.M0, [0, T], C)
    o_ref = o_ref.movedim(0, 1).movedim(3, 2).reshape(1, T, 2, 4)[0]
    assert (o - o_ref).abs().max() <= 1e-12 * o_ref.abs().max()
    assert (M - M_ref).abs().max() <= 1e-12 * M_ref.abs().max()


@pytest.mark.parametrize("diagonal", [False, True])
def test_fwd_h_reference_equals_twin_state(diagonal):
    """fla's fwd_h contract (base-2 gates, W pre-scaled for a per-channel gate) gives the mean pass's state."""
    cu = [0, 17, 17, 40]
    q, sc, M0 = _scan_outputs(diagonal, torch.float64, cu)
    _, M_twin = scan.mean_pass_reference(q, sc.w, sc.kw, sc.vu, sc.g, M0, cu, 16)
    g2 = sc.g * mean_pass_fla._RCP_LN2
    cu_t = torch.tensor(cu)
    if diagonal:
        w_end = sc.w * torch.exp(sc.g[mean_pass_fla.chunk_last_index(cu, 16, q.device)] - sc.g)
        _, _, M = mean_pass_fla.fwd_h_reference(w_end[None], sc.kw[None], sc.vu[None], gk=g2[None], initial_state=M0,
                                           output_final_state=True, chunk_size=16, cu_seqlens=cu_t)
    else:
        _, _, M = mean_pass_fla.fwd_h_reference(sc.w[None], sc.kw[None], sc.vu[None], g=g2[None, ..., 0],
                                           initial_state=M0, output_final_state=True, chunk_size=16, cu_seqlens=cu_t)
    assert (M.double() - M_twin).abs().max() <= 1e-5 * M_twin.abs().max()  # fla's state is float32


@runs_triton
@pytest.mark.parametrize("diagonal", [False, True])
def test_mean_pass_fla_equals_twin(diagonal):
    """fla's output kernels (interpreted) on the substituted tensors == the twin, packed ragged sequences, fp32."""
    cu = [0, 17, 17, 40]
    q, sc, M0 = _scan_outputs(diagonal, torch.float32, cu, device=DEVICE)
    o_ref, M_ref = scan.mean_pass_reference(q, sc.w, sc.kw, sc.vu, sc.g, M0, cu, 16)
    fwd_h = None if torch.cuda.is_available() else mean_pass_fla.fwd_h_reference
    with mean_pass_fla.one_autotune_config():
        o, M = mean_pass_fla.mean_pass_fla(q, sc.w, sc.kw, sc.vu, sc.g, M0, cu, 16, fwd_h=fwd_h)
    assert (o - o_ref).abs().max() <= 1e-5 * o_ref.abs().max()
    assert (M - M_ref).abs().max() <= 1e-5 * M_ref.abs().max()


@runs_triton
def test_forward_scan_with_fla_mean_equals_bl_chunk():
    """The whole forward (scan + fla mean pass) against bl_chunk, fp32, grouped r² (G = 2)."""
    T, C = 40, 16
    q, k, v, r2, ell2, alpha = regime_inputs("longmem", 1, T, 2, 16, 8, G=2, dtype=torch.float32, device=DEVICE)
    cu = torch.tensor([0, 23, 40], device=DEVICE)
    ref = bl_chunk(q, k, v, r2, ell2, alpha, chunk_size=C, cu_seqlens=cu, output_final_state=True, backend="torch")
    fwd_h = None if torch.cuda.is_available() else mean_pass_fla.fwd_h_reference

    def mean(*a):
        return mean_pass_fla.mean_pass_fla(*a, fwd_h=fwd_h)

    with mean_pass_fla.one_autotune_config():
        o, _, M, P = scan.forward_scan(q, k, v, r2, ell2, alpha, 1.0, None, None, cu, C, False, segment_chunks=1,
                                       mean=mean)
    assert (o - ref[0]).abs().max() <= 2e-5 * ref[0].abs().max()
    assert (M - ref[1][0]).abs().max() <= 2e-5 * ref[1][0].abs().max()


def test_require_fla_checks_the_version(monkeypatch):
    monkeypatch.setattr(fla, "__version__", "0.5.2")
    with pytest.raises(RuntimeError, match="internal functions of flash-linear-attention >=0.6.0,<0.7.0"):
        mean_pass_fla.require_fla()
    monkeypatch.setattr(fla, "__version__", "0.6.3")
    assert mean_pass_fla.require_fla() is fla


def test_mean_pass_fla_refuses_float64_and_bad_shapes():
    cu = [0, 20]
    q, sc, M0 = _scan_outputs(False, torch.float64, cu, T=20)
    with pytest.raises(TypeError, match="float64"):
        mean_pass_fla.mean_pass_fla(q, sc.w, sc.kw, sc.vu, sc.g, M0, cu, 16)
    with pytest.raises(ValueError, match="kw must be"):
        mean_pass_fla.mean_pass_fla(q, sc.w, sc.kw[None], sc.vu, sc.g, M0, cu, 16)
