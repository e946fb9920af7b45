"""cu_seqlens (packed variable-length sequences) and backend dispatch of bl_chunk."""

import pytest
import torch

from bayeslayer.ops import bl_chunk, bl_recurrent, initial_bl_state

F64 = dict(dtype=torch.float64)


def _inputs(T=50, H=2, D=8, m=4, G=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, D, generator=g, **F64)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, D, generator=g, **F64), dim=-1)
    v = torch.randn(1, T, H, m, generator=g, **F64)
    shape = (1, T, H, G) if G > 1 else (1, T, H)
    r2 = torch.rand(*shape, generator=g, **F64) + 0.1
    ell2 = torch.rand(1, T, H, generator=g, **F64) * 0.1 + 0.01
    alpha = torch.rand(1, T, H, generator=g, **F64) * 0.5 + 0.5
    return q, k, v, r2, ell2, alpha


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("with_state", [False, True])
def test_cu_seqlens_equals_separate_sequences(G, with_state):
    q, k, v, r2, ell2, alpha = _inputs(G=G)
    cu = torch.tensor([0, 13, 13, 40, 50])
    n = cu.numel() - 1
    init = None
    if with_state:
        M0, P0 = initial_bl_state(n, 2, 8, 4, p0=0.5, groups=G, dtype=torch.float64)
        M0 = M0 + 0.1 * torch.randn(M0.shape, **F64)
        init = (M0, P0)
    o, var, (M, P) = bl_chunk(q, k, v, r2, ell2, alpha, initial_state=init, cu_seqlens=cu,
                              output_final_state=True, return_variance=True, chunk_size=16)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        st = None if init is None else (init[0][i:i + 1], init[1][i:i + 1])
        o2, var2, (M2, P2) = bl_recurrent(q[:, a:b], k[:, a:b], v[:, a:b], r2[:, a:b], ell2[:, a:b],
                                          alpha[:, a:b], initial_state=st, output_final_state=True,
                                          return_variance=True)
        torch.testing.assert_close(o[:, a:b], o2, atol=1e-12, rtol=0)
        torch.testing.assert_close(var[:, a:b], var2, atol=1e-12, rtol=0)
        torch.testing.assert_close(M[i:i + 1], M2, atol=1e-12, rtol=0)
        torch.testing.assert_close(P[i:i + 1], P2, atol=1e-12, rtol=0)


def test_cu_seqlens_gradients_flow():
    q, k, v, r2, ell2, alpha = _inputs(T=20)
    q.requires_grad_(True)
    o, _ = bl_chunk(q, k, v, r2, ell2, alpha, cu_seqlens=torch.tensor([0, 7, 20]), chunk_size=16)
    o.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize(
    "cu, err, match",
    [
        ([0, 5, 49], ValueError, "end at T=50"),
        ([1, 5, 50], ValueError, "start at 0"),
        ([0, 30, 20, 50], ValueError, "non-decreasing"),
        ("0,50", TypeError, "cu_seqlens"),
    ],
)
def test_cu_seqlens_bad_input(cu, err, match):
    q, k, v, r2, ell2, alpha = _inputs()
    cu_t = torch.tensor(cu) if isinstance(cu, list) else cu
    with pytest.raises(err, match=match):
        bl_chunk(q, k, v, r2, ell2, alpha, cu_seqlens=cu_t)


def test_cu_seqlens_needs_batch_one_and_integer_dtype():
    q, k, v, r2, ell2, alpha = _inputs()
    with pytest.raises(TypeError, match="int32 or int64"):
        bl_chunk(q, k, v, r2, ell2, alpha, cu_seqlens=torch.tensor([0.0, 50.0]))
    q2, k2, v2 = torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v])
    with pytest.raises(ValueError, match="batch size must be 1"):
        bl_chunk(q2, k2, v2, torch.cat([r2, r2]), torch.cat([ell2, ell2]), torch.cat([alpha, alpha]),
                 cu_seqlens=torch.tensor([0, 50]))


def test_cu_seqlens_initial_state_needs_one_state_per_sequence():
    q, k, v, r2, ell2, alpha = _inputs()
    init = initial_bl_state(1, 2, 8, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="one state per sequence"):
        bl_chunk(q, k, v, r2, ell2, alpha, initial_state=init, cu_seqlens=torch.tensor([0, 10, 50]))


def test_backend_dispatch():
    q, k, v, r2, ell2, alpha = _inputs(T=10)
    o_default, _ = bl_chunk(q, k, v, r2, ell2, alpha)  # CPU tensors: the PyTorch path
    o_torch, _ = bl_chunk(q, k, v, r2, ell2, alpha, backend="torch")
    torch.testing.assert_close(o_default, o_torch, atol=0, rtol=0)
    with pytest.raises(ValueError, match="backend"):
        bl_chunk(q, k, v, r2, ell2, alpha, backend="cuda")


@pytest.mark.parametrize("cu", [[0, 0, 50], [0, 0, 0, 20, 50], [0, 20, 50, 50], [0, 50, 50]])
@pytest.mark.parametrize("return_variance", [False, True])
def test_empty_sequences_anywhere_in_cu_seqlens(cu, return_variance):
    """An empty sequence is valid input (a packing of zero tokens) wherever it stands: its final state is its
    initial one, and the other sequences' outputs are theirs alone, with or without the variance."""
    q, k, v, r2, ell2, alpha = _inputs()
    q.requires_grad_(True)
    cu_t = torch.tensor(cu)
    n = cu_t.numel() - 1
    M0, P0 = initial_bl_state(n, 2, 8, 4, p0=0.5, dtype=torch.float64)
    M0 = M0 + 0.1 * torch.randn(M0.shape, **F64)
    out = bl_chunk(q, k, v, r2, ell2, alpha, initial_state=(M0, P0), cu_seqlens=cu_t, output_final_state=True,
                   return_variance=return_variance, chunk_size=16)
    o, (M, P) = out[0], out[-1]
    assert (out[1].shape == (1, 50, 2, 1)) if return_variance else len(out) == 2
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        if a == b:
            torch.testing.assert_close(M[i], M0[i], atol=0, rtol=0)
            torch.testing.assert_close(P[i], P0[i], atol=0, rtol=0)
            continue
        o2, (M2, _) = bl_recurrent(q[:, a:b], k[:, a:b], v[:, a:b], r2[:, a:b], ell2[:, a:b], alpha[:, a:b],
                                   initial_state=(M0[i:i + 1], P0[i:i + 1]), output_final_state=True)
        torch.testing.assert_close(o[:, a:b], o2, atol=1e-12, rtol=0)
        torch.testing.assert_close(M[i:i + 1], M2, atol=1e-12, rtol=0)
    o.sum().backward()  # and the gradients flow through the packing
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("cu", [None, [0, 7, 50]])
def test_a_chunk_size_past_the_sequence_is_one_chunk_not_padding(cu, monkeypatch):
    """``chunk_size`` is bounded by the sequence length: 10**9 gives the one-chunk result, and no tensor is
    padded past T (the call used to allocate for 10**9 tokens)."""
    import bayeslayer.ops.bayesian_layer.chunk as chunk_module

    q, k, v, r2, ell2, alpha = _inputs()
    cu_t = None if cu is None else torch.tensor(cu)
    want, _ = bl_chunk(q, k, v, r2, ell2, alpha, cu_seqlens=cu_t, chunk_size=50)
    padded = []
    pad_time = chunk_module.pad_time
    monkeypatch.setattr(chunk_module, "pad_time",
                        lambda x, pad, value=0.0: padded.append(pad) or pad_time(x, pad, value))
    got, _ = bl_chunk(q, k, v, r2, ell2, alpha, cu_seqlens=cu_t, chunk_size=10**9)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    assert padded and max(padded) == 0, padded
