"""The blocked 16×16 LDLᵀ of the Triton kernels (``ops/utils/ldl_triton.py``) against its PyTorch twin.

The twin (:func:`bayeslayer.ops.bayesian_layer.scan.ldl_clamped`) is an unblocked clamped elimination; it is
checked against ``torch.linalg.cholesky`` first.  The kernel runs under ``TRITON_INTERPRET=1`` on
CPU: 1, 2 and 4 diagonal blocks (N = 16, 32, 64, and ragged N padded with identity), float64 and
float32, with the pivot clamp active and with a matrix that is not positive definite.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from bayeslayer.ops.bayesian_layer import scan  # noqa: E402

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"),
    reason="Triton kernels need a CUDA device or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET", "0") != "1" else "cpu"


def _spd(n, N, *, seed=0, cond=1e3):
    """``n`` random SPD matrices with eigenvalues spread over ``cond`` (float64), floors 0.5·min eig."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, N, N, generator=g, dtype=torch.float64))
    ev = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), N, dtype=torch.float64)
    ev = ev[torch.randperm(N, generator=g)]
    S = (Q * ev) @ Q.transpose(-1, -2)
    return 0.5 * (S + S.transpose(-1, -2)), torch.full((n, N), 0.5 / cond, dtype=torch.float64)


def _run_kernel(S, floor):
    from bayeslayer.ops.utils.ldl_triton import BLOCK, ldl_kernel

    n, N = S.shape[:2]
    NB = 1 << (-(-N // BLOCK) - 1).bit_length()  # a power of two (tl.arange)
    BN = NB * BLOCK
    X = torch.zeros(n, BN, BN, dtype=S.dtype, device=S.device)
    LI = torch.full((n, BN, BN), float("nan"), dtype=S.dtype, device=S.device)
    DV = torch.empty(n, BN, dtype=S.dtype, device=S.device)
    FAIL = torch.full((n,), -1, dtype=torch.int32, device=S.device)
    ldl_kernel[(n,)](S.contiguous(), floor.contiguous(), X, LI, DV, FAIL, N=N, NB=NB, BLK=BLOCK, PREC="ieee")
    L = torch.tril(X)
    for b in range(NB):  # upper-triangular halves of the diagonal blocks are written as zeros
        o = b * BLOCK
        assert (X[:, o:o + BLOCK, o:o + BLOCK].triu(1) == 0).all()
    return L[:, :N, :N], DV[:, :N], LI, FAIL


def test_twin_equals_cholesky():
    S, floor = _spd(3, 40)
    L, d, Linv, failed = scan.ldl_clamped(S, floor)
    Lc = torch.linalg.cholesky(S)
    dc = torch.diagonal(Lc, dim1=-2, dim2=-1)
    assert torch.allclose(L, Lc / dc[..., None, :], rtol=0, atol=1e-11)
    assert torch.allclose(d, dc * dc, rtol=1e-12, atol=0)
    assert torch.allclose(Linv @ L, torch.eye(40, dtype=S.dtype).expand_as(L), atol=1e-11)
    assert not failed.any()


def test_twin_clamps_and_flags():
    S, _ = _spd(2, 8)
    floor = torch.full((2, 8), 10.0, dtype=S.dtype)  # above every raw pivot: d = 10 everywhere
    _, d, _, failed = scan.ldl_clamped(S, floor)
    assert (d == 10.0).all() and not failed.any()
    bad = S.clone()
    bad[1, 3, 3] = -1.0
    assert scan.ldl_clamped(bad, torch.zeros(2, 8, dtype=S.dtype))[3].tolist() == [False, True]
    with pytest.raises(ValueError, match="floor"):
        scan.ldl_clamped(S, torch.zeros(2, 7, dtype=S.dtype))


@pytest.mark.parametrize("N", [pytest.param(16, marks=pytest.mark.slow), pytest.param(32, marks=pytest.mark.slow), 40,
                               pytest.param(64, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ldl_kernel_equals_twin(N, dtype):
    S, floor = _spd(2, N, seed=N)
    # raise some floors above their raw pivots, so that the clamp acts inside blocks > 0
    _, d0, _, _ = scan.ldl_clamped(S, floor)
    floor[:, N // 2] = 2.0 * d0[:, N // 2]
    L_ref, d_ref, Li_ref, f_ref = scan.ldl_clamped(S, floor)
    L, d, LI, fail = _run_kernel(S.to(DEVICE, dtype), floor.to(DEVICE, dtype))
    tol = 1e-12 if dtype == torch.float64 else 2e-4
    assert (fail == 0).all() and not f_ref.any()
    assert (d.double().cpu() - d_ref).abs().max() <= tol * d_ref.abs().max()
    assert (L.double().cpu() - L_ref).abs().max() <= tol * L_ref.abs().max()
    BN = LI.shape[-1]
    assert (LI[:, :N, N:] == 0).all() and (LI.triu(1) == 0).all()  # L⁻¹ is lower, also across padding
    assert (LI[:, :N, :N].double().cpu() - Li_ref).abs().max() <= tol * Li_ref.abs().max()
    assert torch.equal(LI[:, N:, N:].cpu(), torch.eye(BN - N, dtype=dtype).expand(2, -1, -1))


def test_ldl_kernel_flags_not_positive_definite():
    S, floor = _spd(3, 32, seed=1)
    S[1, 20, 20] = -5.0  # a negative raw pivot in the second block
    S[2, 3, 3] = float("nan")
    _, _, _, fail = _run_kernel(S.to(DEVICE), floor.to(DEVICE))
    assert fail[0] == 0 and fail[1] > 0 and fail[2] > 0
