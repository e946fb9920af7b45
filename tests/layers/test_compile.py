"""Every mixer under ``torch.compile(fullgraph=True)`` and ``torch.func.vmap``.

The default run traces every registered mixer but the Bayesian Layer and Gated DeltaNet with
``torch._dynamo.explain`` (no graph break, one graph) and vmaps every configuration; those two are compiled,
forward and backward, the Bayesian Layer with its variances, by tests/models/test_compile.py's default test
(a two-layer model of them under ``fullgraph=True`` and the ``aot_eager`` backend: Dynamo's full graph plus
AOTAutograd's backward graph, no code generation; any graph break fails it).  The ``slow`` run compiles
every configuration with the default backend (Inductor), forward and backward, against eager mode.  Compile
times are recorded by ``benchmarks/compile.py``, not here.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from bayeslayer.errors import NonFiniteError
from bayeslayer.ops import value_checks

from ..models.test_compile import SMALL as COMPILED_BY_THE_MODEL_TEST
from .test_mixers import CONFIGS, HIDDEN, make

REGISTERED = sorted(case for case, (name, _) in CONFIGS.items() if case == name)
VARIANTS = sorted(set(CONFIGS) - set(REGISTERED))


def build(case: str, dtype=torch.float32):
    return make(case, dtype=dtype, **({} if CONFIGS[case][0] == "attention" else {"chunk_size": 4}))


def forward(mixer, case: str):
    """The training forward: outputs (and, for the Bayesian Layer, the variances) as one tensor."""
    variance = case.startswith("bayesian")

    def run(x):
        out = mixer(x, output_variance=variance)
        return (out.o, out.variance) if variance else (out.o,)

    return run


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def explain(fn, *args):
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args)


# slow for the two mixers tests/models/test_compile.py::test_compiled_model_equals_eager compiles by default (the
# same forwards, the Bayesian Layer's with its variances) with fullgraph=True, which fails at any graph break
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in COMPILED_BY_THE_MODEL_TEST else c
                                  for c in REGISTERED] + [pytest.param(c, marks=pytest.mark.slow) for c in VARIANTS])
def test_no_graph_break(case):
    mixer = build(case)
    report = explain(forward(mixer, case), torch.randn(2, 10, HIDDEN))
    assert report.graph_break_count == 0, [str(b.reason)[:300] for b in report.break_reasons]
    assert report.graph_count == 1


def compiled_equals_eager(mixer, case: str, backend: str, tol: float = 1e-5):
    """Forward and backward of ``torch.compile(fullgraph=True)`` against eager mode (float32, max relative)."""
    fn = forward(mixer, case)
    x = torch.randn(2, 10, HIDDEN, requires_grad=True)
    params = [p for p in mixer.parameters() if p.requires_grad]
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    for run in (fn, compiled):
        outs = run(x)
        loss = sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs)
        grads = torch.autograd.grad(loss, [x, *params])
        if run is fn:
            ref_outs, ref_grads = outs, grads
    for out, ref in zip(outs, ref_outs, strict=True):
        assert relative(out, ref) <= tol
    for g, g_ref in zip(grads, ref_grads, strict=True):
        assert relative(g, g_ref) <= tol


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_inductor_compiled_mixer_equals_eager(case):
    compiled_equals_eager(build(case), case, "inductor")


def test_value_checks_stay_out_of_the_compiled_graph():
    """Eager mode checks values by default (a NaN is named); the compiled graph holds no check (the NaN flows
    through), so it never breaks or waits for the device on one.  Whether a check is traced is Dynamo's
    decision, so Dynamo's own ``eager`` backend shows it (``fullgraph=True`` fails at a check's graph break, and
    a check left in the graph would raise when the graph runs); AOTAutograd's backward graph of this layer is
    compiled by tests/models/test_compile.py."""
    mixer = build("gated_deltanet")
    x = torch.randn(1, 6, HIDDEN)
    x[0, 2, 3] = float("nan")
    with value_checks("auto"):
        with pytest.raises(NonFiniteError, match="hidden_states contains NaN"):
            mixer(x)
        torch._dynamo.reset()
        out = torch.compile(lambda x: mixer(x).o, fullgraph=True, backend="eager")(x)
    assert bool(torch.isnan(out).any())


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_vmap_over_the_batch(case):
    """``torch.func.vmap`` of a one-sequence call over a batch equals the batched call, and per-example
    gradients (``vmap(grad(...))``) equal the gradients of each sequence alone."""
    mixer = build(case, torch.float64)
    x = torch.randn(3, 9, HIDDEN, dtype=torch.float64)

    def one(xi):
        return mixer(xi[None]).o[0]

    assert relative(torch.func.vmap(one)(x), mixer(x).o) <= 1e-12
    per_example = torch.func.vmap(torch.func.grad(lambda xi: one(xi).square().sum()))(x)
    for b in range(x.shape[0]):
        xb = x[b:b + 1].clone().requires_grad_()
        (g,) = torch.autograd.grad(mixer(xb).o.square().sum(), xb)
        assert relative(per_example[b], g[0]) <= 1e-12
