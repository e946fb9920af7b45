"""BayesianLayer(backend=...): a forced Triton layer runs the kernels for sequences and one-token
decoding (never PyTorch) and equals the PyTorch layer; configurations without a kernel are refused
at construction, by name.  Kernels run in Triton's interpreter (tests/conftest.py); tiny shapes."""

from __future__ import annotations

import os

import pytest
import torch

from bayeslayer.layers import BayesianLayer, GatedDeltaNet
from bayeslayer.ops import BackendError
from bayeslayer.ops.bayesian_layer import triton_support as support

from ..triton_spy import triton_only

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not support.triton_installed(),
    reason="the kernels run here only in Triton's interpreter (TRITON_INTERPRET=1, Triton installed)",
)
D_MODEL = 16


def pair(**kwargs) -> tuple[BayesianLayer, BayesianLayer]:
    """The same perturbed weights in a forced-Triton and a forced-PyTorch layer (fp64)."""
    torch.manual_seed(0)
    kw = {**dict(num_heads=2, head_dim=8, chunk_size=16), **kwargs}
    tri = BayesianLayer(D_MODEL, backend="triton", **kw)
    with torch.no_grad():
        for p in tri.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ref = BayesianLayer(D_MODEL, backend="torch", **kw)
    ref.load_state_dict(tri.state_dict())
    return tri.double(), ref.double()


def assert_states_close(a: dict, b: dict):
    for x, y in zip(a["recurrent"], b["recurrent"], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)
    for name in a["conv"]:
        torch.testing.assert_close(a["conv"][name], b["conv"][name], rtol=0, atol=0)


@interpreter
@pytest.mark.parametrize("dynamics, groups", [("scalar", 1), pytest.param("diagonal", 2, marks=pytest.mark.slow),
                                              ("identity", 1)])
def test_forced_triton_layer_runs_the_kernels_and_equals_torch(dynamics, groups):
    tri, ref = pair(dynamics=dynamics, groups=groups)
    x = torch.randn(2, 19, D_MODEL, dtype=torch.float64)
    mask = torch.ones(2, 19, dtype=torch.long)
    mask[1, :4] = 0  # left padding: padded tokens are no-op writes on both paths
    with torch.no_grad(), triton_only() as calls:
        out = tri(x, attention_mask=mask, use_cache=True, output_variance=True)
    assert calls == {"chunk": 1}
    with torch.no_grad():
        exp = ref(x, attention_mask=mask, use_cache=True, output_variance=True)
    torch.testing.assert_close(out.o, exp.o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.variance, exp.variance, rtol=1e-10, atol=1e-10)
    assert_states_close(out.state, exp.state)
    # decoding: one token at a time from the returned state runs the fused step kernel
    state_t, state_r = out.state, exp.state
    for _ in range(2):
        x1 = torch.randn(2, 1, D_MODEL, dtype=torch.float64)
        with torch.no_grad(), triton_only() as calls:
            step = tri(x1, state=state_t, use_cache=True, output_variance=True)
        assert calls == {"step": 1}
        with torch.no_grad():
            step_ref = ref(x1, state=state_r, use_cache=True, output_variance=True)
        torch.testing.assert_close(step.o, step_ref.o, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(step.variance, step_ref.variance, rtol=1e-10, atol=1e-10)
        assert_states_close(step.state, step_ref.state)
        state_t, state_r = step.state, step_ref.state


@interpreter
def test_forced_triton_layer_trains_through_the_kernels():
    """A training forward (gradients on) runs the Triton forward; the gradients equal PyTorch's."""
    tri, ref = pair()
    x = torch.randn(1, 12, D_MODEL, dtype=torch.float64)
    w = torch.randn(1, 12, D_MODEL, dtype=torch.float64)
    with triton_only() as calls:
        loss_t = (tri(x).o * w).sum()
    assert calls == {"chunk": 1}
    loss_r = (ref(x).o * w).sum()
    loss_t.backward()
    loss_r.backward()
    grads = dict(ref.named_parameters())
    for name, p in tri.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dynamics="rotation"), r"rotation dynamics \(theta\) have no Triton kernel"),
        (dict(covariance="diagonal"), "write model 'diagonal' has no Triton kernel"),
        (dict(chunk_size=8), r"chunk_size=8 is not one of the kernels' \(16, 32, 64\)"),
        (dict(head_dim=260), "key head dim D=260 is outside the kernels' 1..256"),
    ],
)
def test_forced_triton_layer_without_a_kernel_is_refused_at_construction(kwargs, match):
    with pytest.raises(BackendError, match=r"BayesianLayer\(backend='triton'\) cannot run this layer: " + match):
        BayesianLayer(D_MODEL, **{**dict(num_heads=1, head_dim=8), **kwargs}, backend="triton")
    BayesianLayer(D_MODEL, **{**dict(num_heads=1, head_dim=8), **kwargs}, backend="auto")  # auto: PyTorch


def test_layer_backend_argument():
    assert BayesianLayer(D_MODEL, num_heads=1, head_dim=8).backend == "auto"
    assert "backend=torch" in repr(BayesianLayer(D_MODEL, num_heads=1, head_dim=8, backend="torch"))
    with pytest.raises(ValueError, match="backend must be one of"):
        BayesianLayer(D_MODEL, num_heads=1, head_dim=8, backend="gpu")
    # mixers without a kernel take no backend argument (and run PyTorch)
    with pytest.raises(TypeError):
        GatedDeltaNet(D_MODEL, num_heads=1, head_dim=8, backend="triton")
    assert GatedDeltaNet(D_MODEL, num_heads=1, head_dim=8).backend == "auto"
