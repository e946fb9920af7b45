"""The FLOP count of the chunked filter (:func:`bayeslayer.ops.flops.chunk_flops`) against PyTorch's
``FlopCounterMode`` on the PyTorch path, forward and backward, for every write model and dynamics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bayeslayer.design import BAYESIAN, DIAGONAL_COVARIANCE, DesignModel, lowrank_diagonal
from bayeslayer.ops.flops import (
    FlopCount,
    Tally,
    cholesky_flops,
    chunk_flops,
    matmul_flops,
    triangular_solve_flops,
)
from bayeslayer.training.flop_counter import flop_counter_formulas, measure_training_flops

pytestmark = pytest.mark.usefixtures("no_opt_einsum")

DESIGNS = {"bayes": BAYESIAN, "diagonal": DIAGONAL_COVARIANCE, "reset": DesignModel("reset_any", "reset"),
           "latent": DesignModel("latent_any", "latent")}


def measured(write, dynamics, *, B=2, T=40, H=2, D=8, m=8, C=16, G=1, rank=None, qk_grad=True):
    """FlopCounterMode's count of one training step through ``design.chunk`` with inputs that need gradients."""
    torch.manual_seed(0)
    qp = torch.randn(B, T, H, D, requires_grad=qk_grad)
    kp = torch.randn(B, T, H, D, requires_grad=qk_grad)
    v = torch.randn(B, T, H, m, requires_grad=True)
    a = torch.randn(B, T, H, *((D,) if dynamics == "diagonal" else ()), requires_grad=True)
    r = torch.randn(B, T, H, *((G,) if G > 1 else ()), requires_grad=True)
    e = torch.randn(B, T, H, requires_grad=True)
    design = DESIGNS.get(write) or lowrank_diagonal(rank)

    def step():
        q, k = F.normalize(qp, dim=-1), F.normalize(kp, dim=-1)
        kw = {} if dynamics == "identity" else {"alpha": 0.5 + 0.5 * torch.sigmoid(a)}
        if write in ("bayes", "diagonal", "lowrank"):
            kw.update(r2=F.softplus(r) + 0.1, ell2=0.1 * F.softplus(e) + 1e-3)
        else:
            kw["gain"] = torch.sigmoid(e)
        return design.chunk(q, k, v, chunk_size=C, backend="torch", **kw).o.square().sum()

    return measure_training_flops(step)


def close(count: FlopCount, meas, rel: float = 0.10) -> bool:
    return (abs(count.forward - meas.flops.forward) <= rel * meas.flops.forward
            and abs(count.backward - meas.flops.backward) <= rel * meas.flops.backward)


@pytest.mark.parametrize("dynamics", ["identity", "scalar", "diagonal"])
@pytest.mark.parametrize("write", ["bayes", "diagonal", "reset", "latent"])
def test_every_write_and_dynamics_within_10_percent(write, dynamics):
    """One case per write model and dynamics: 40 tokens in chunks of 16 (a padded last chunk), keys with
    gradients; the count follows the path operation by operation, so it is exact here."""
    meas = measured(write, dynamics)
    count = chunk_flops(write, dynamics, batch_size=2, seq_len=40, num_heads=2, key_dim=8, value_dim=8,
                        chunk_size=16)
    assert close(count, meas), (count, meas.flops, meas.by_op)
    assert count == meas.flops  # exact, not only within 10%: any drift is a change of the path


@pytest.mark.parametrize("case", [
    dict(write="bayes", dynamics="identity", qk_grad=False),  # the recall cores: the address is a fixed input
    dict(write="reset", dynamics="identity", qk_grad=False),
    dict(write="latent", dynamics="diagonal", qk_grad=False),
    dict(write="bayes", dynamics="scalar", T=64, C=64),  # one chunk: no gradient of P_0, M_0 or the final state
    dict(write="reset", dynamics="diagonal", T=20, C=64),  # a chunk no longer than the sequence
    dict(write="lowrank", dynamics="scalar", rank=2, T=10, C=16),  # the low-rank mean pass pads to a whole chunk
    dict(write="bayes", dynamics="diagonal", T=96, C=32),  # the blocked unit-triangular inverse (C = 2·16)
    dict(write="reset", dynamics="scalar", T=130, C=64),
    dict(write="bayes", dynamics="scalar", m=16, G=2),  # value groups: H·G filters
    dict(write="lowrank", dynamics="scalar", rank=0, T=20),
    dict(write="lowrank", dynamics="scalar", rank=3, T=20),
    dict(write="lowrank", dynamics="identity", rank=8, T=20, qk_grad=False),
])
def test_special_cases_within_10_percent(case):
    case = dict(case)
    write, dynamics = case.pop("write"), case.pop("dynamics")
    meas = measured(write, dynamics, **case)
    sizes = {"B": 2, "T": 40, "H": 2, "D": 8, "m": 8, "C": 16, "G": 1, **case}
    count = chunk_flops(write, dynamics, batch_size=sizes["B"], seq_len=sizes["T"], num_heads=sizes["H"],
                        key_dim=sizes["D"], value_dim=sizes["m"], chunk_size=sizes["C"], groups=sizes["G"],
                        rank=case.get("rank"), qk_grad=case.get("qk_grad", True))
    assert close(count, meas), (count, meas.flops, meas.by_op)


def test_the_passes_per_chunk_are_the_formulas():
    """Per chunk and head (scalar decay, many chunks): the mean pass with an erase costs 6CDm + 2C²(3D + 2m) + C³
    forward (C = 16: one triangular solve inverts I + T), the covariance pass adds 4CD² + 5C²D + C³/3 + 2C²."""
    D, m, C, N = 16, 32, 16, 10
    sizes = dict(batch_size=1, seq_len=N * C, num_heads=1, key_dim=D, value_dim=m, chunk_size=C)
    reset = chunk_flops("reset", "scalar", **sizes)
    bayes = chunk_flops("bayes", "scalar", **sizes)
    assert reset.forward == N * (6 * C * D * m + 2 * C * C * (3 * D + 2 * m) + C**3)
    assert bayes.forward - reset.forward == N * (4 * C * D * D + 5 * C * C * D + C**3 // 3 + 2 * C * C)


def test_registered_formulas_price_the_factorizations():
    """The counter knows only products; the formulas registered for it count the factorizations, and a
    depthwise convolution's backward as two forward-sized convolutions (not as a dense one)."""
    A = torch.randn(3, 5, 5)
    S = A @ A.transpose(-1, -2) + 5 * torch.eye(5)
    meas = measure_training_flops(lambda: torch.linalg.cholesky_ex(S.requires_grad_())[0].sum())
    assert meas.flops.forward == 3 * cholesky_flops(5)
    assert meas.flops.backward == 3 * (matmul_flops(5, 5, 5) + 2 * triangular_solve_flops(5, 5))
    conv = torch.nn.Conv1d(6, 6, 4, groups=6, bias=False)
    x = torch.randn(2, 6, 13, requires_grad=True)
    meas = measure_training_flops(lambda: conv(x).sum())
    t = Tally()
    t.conv(2, 6, 10, 4)
    assert meas.flops == t.count()
    assert torch.ops.aten.linalg_solve_triangular in flop_counter_formulas()


def test_elementwise_work_is_measured_beside_the_count():
    meas = measured("bayes", "diagonal")
    assert meas.elementwise.forward > 0 and meas.elementwise.backward > 0
    assert set(meas.by_op) == {"forward", "backward"}


def test_flop_count_arithmetic():
    a, b = FlopCount(3, 5), FlopCount(1, 2)
    assert a + b == FlopCount(4, 7) and (a + b).total == 11
    assert 2 * a == a * 2 == FlopCount(6, 10)
    assert a.to_dict() == {"forward": 3, "backward": 5, "total": 8}


@pytest.mark.parametrize("kwargs, error, needle", [
    (dict(write="bayes", dynamics="rotation"), ValueError, "rotation"),
    (dict(write="kalman", dynamics="scalar"), ValueError, "write must be one of"),
    (dict(write="bayes", dynamics="scalar", seq_len=0), ValueError, "seq_len"),
    (dict(write="bayes", dynamics="scalar", key_dim=8.0), TypeError, "key_dim"),
    (dict(write="bayes", dynamics="scalar", rank=2), ValueError, "rank applies only"),
    (dict(write="lowrank", dynamics="scalar"), ValueError, "needs rank"),
    (dict(write="reset", dynamics="scalar", groups=2, value_dim=8), ValueError, "groups"),
    (dict(write="bayes", dynamics="scalar", groups=3), ValueError, "groups=3 must divide"),
])
def test_bad_arguments_are_named(kwargs, error, needle):
    full = dict(batch_size=1, seq_len=8, num_heads=1, key_dim=8, value_dim=8, chunk_size=8)
    full.update(kwargs)
    with pytest.raises(error, match=needle):
        chunk_flops(full.pop("write"), full.pop("dynamics"), **full)
