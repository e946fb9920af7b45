"""Backend dispatch (bayeslayer.ops.backend): the registry of backend objects, the rules, the errors of a
forced backend, the design models' routing, and no import cycle between the PyTorch path and the Triton path.

Kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py on a machine
without a GPU); shapes are tiny because the interpreter is slow.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bayeslayer.design import BAYESIAN, DIAGONAL_COVARIANCE, GATED_DELTANET
from bayeslayer.ops import BackendError, backend_names, bl_chunk, bl_step, initial_bl_state
from bayeslayer.ops import backend as be
from bayeslayer.ops.bayesian_layer import triton_support as support

from ..import_graph import find_cycle, import_graph, module_name, module_paths
from ..triton_spy import TorchPathRan, triton_only

PACKAGE = Path(__file__).resolve().parents[2] / "bayeslayer"
interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not support.triton_installed(),
    reason="the kernels run here only in Triton's interpreter (TRITON_INTERPRET=1, Triton installed)",
)


def inputs(B=1, T=10, H=2, D=16, m=8, decay="scalar", dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=gen, dtype=dtype) / D**0.5
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, m, generator=gen, dtype=dtype)
    r2 = torch.rand(B, T, H, generator=gen, dtype=dtype) + 0.1
    ell2 = torch.rand(B, T, H, generator=gen, dtype=dtype) * 0.1 + 0.01
    alpha = {"none": None, "scalar": torch.rand(B, T, H, generator=gen, dtype=dtype) * 0.1 + 0.9,
             "diagonal": torch.rand(B, T, H, D, generator=gen, dtype=dtype) * 0.1 + 0.9}[decay]
    return q, k, v, r2, ell2, alpha


# -- the argument ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["cuda", "Triton", "", 1, True])
def test_backend_argument_is_validated_by_name(bad):
    q, k, v, r2, ell2, alpha = inputs()
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'triton'\)"):
        bl_chunk(q, k, v, r2, ell2, alpha, backend=bad)
    with pytest.raises(ValueError, match="backend must be one of"):
        BAYESIAN.chunk(q, k, v, r2=r2, ell2=ell2, alpha=alpha, backend=bad)
    st = initial_bl_state(1, 2, 16, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="backend must be one of"):
        bl_step(q[:, 0], k[:, 0], v[:, 0], r2[:, 0], ell2[:, 0], alpha[:, 0], state=st, backend=bad)


def test_backends_and_none_means_auto():
    assert backend_names() == ("auto", "torch", "triton")
    assert be.check_backend(None) == "auto"
    for name in backend_names():
        assert be.check_backend(name) == name


# -- the registry ---------------------------------------------------------------------------------------
@pytest.fixture
def registry():
    """The backend registry, put back after the test."""
    saved = dict(be.BACKEND_REGISTRY)
    yield be.BACKEND_REGISTRY
    be.BACKEND_REGISTRY.clear()
    be.BACKEND_REGISTRY.update(saved)


class Fake(be.Backend):
    """A backend that runs nothing: what the dispatch asks it is all these tests look at."""

    def __init__(self, name, priority, *, available=True, refuse=None, auto_devices=None):
        self.name, self.label, self.priority, self.auto_devices = name, f"{name} backend", priority, auto_devices
        self._available, self._refuse = available, refuse

    def available(self):
        return self._available

    def unsupported(self, call):
        return self._refuse(call) if self._refuse else None


def test_the_registered_backends_are_objects():
    assert list(be.BACKEND_REGISTRY) == ["torch", "triton"]
    torch_b, triton_b = be.get_backend("torch"), be.get_backend("triton")
    assert isinstance(torch_b, be.TorchBackend) and isinstance(triton_b, be.TritonBackend)
    assert torch_b.reference and not triton_b.reference and triton_b.priority < torch_b.priority
    assert torch_b.available() and triton_b.available() == support.triton_installed()
    call = be.BackendCall("chunk", write="reset", chunk_size=8)
    assert torch_b.unsupported(call) is None
    assert "write model 'reset' has no Triton kernel" in triton_b.unsupported(call)
    assert be.forced_backend(None) is None and be.forced_backend("auto") is None
    assert be.forced_backend("triton") is triton_b
    assert be.backend_unsupported("auto", "chunk", rotation=True) is None
    assert be.backend_unsupported("torch", "chunk", rotation=True) is None
    assert "rotation dynamics" in be.backend_unsupported("triton", "chunk", rotation=True)
    # a configuration question does not ask about the device (a layer is built before it sees a tensor)
    assert be.backend_unsupported("triton", "chunk", head_dim=64, chunk_size=64) is None


def test_auto_asks_the_backends_in_priority_order(registry):
    refuse_reset = lambda call: "no reset" if call.write == "reset" else None  # noqa: E731
    be.register_backend(Fake("late", 200))
    be.register_backend(Fake("early", 1, refuse=refuse_reset))
    be.register_backend(Fake("gone", 0, available=False))
    be.register_backend(Fake("gpu_only", -1, auto_devices=("cuda",)))
    assert be.backend_names() == ("auto", "torch", "triton", "late", "early", "gone", "gpu_only")
    sel = be.select_backend
    assert sel("auto", "chunk", device="cpu") == "early"  # gone: unavailable; gpu_only: not for CPU tensors
    assert sel("auto", "chunk", device="cuda") == "gpu_only"
    assert sel("auto", "step", device="cpu", write="reset") == "torch"  # early refuses, torch (100) before late
    assert sel("late", "chunk", device="cpu") == "late"
    with pytest.raises(BackendError, match="backend='early' cannot run this step: no reset"):
        sel("early", "step", device="cpu", write="reset")
    assert be.backend_unsupported("early", "chunk", write="reset") == "no reset"
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'triton', 'late', "):
        be.check_backend("later")


def test_a_call_no_backend_takes_says_so(registry):
    registry.clear()
    be.register_backend(Fake("only", 0, refuse=lambda call: "never"))
    with pytest.raises(BackendError, match="no registered backend can run this chunk"):
        be.select_backend("auto", "chunk", device="cpu")


def test_register_backend_checks_its_argument(registry):
    with pytest.raises(TypeError, match="backend must be a bayeslayer.ops.backend.Backend instance"):
        be.register_backend(be.TorchBackend)
    for bad in ("auto", "", "two words", 3):
        with pytest.raises(ValueError, match="backend.name must be a name"):
            be.register_backend(Fake(bad, 0))
    fake = Fake("z", 0)
    fake.label = " "
    with pytest.raises(ValueError, match="backend.label must be a non-empty string"):
        be.register_backend(fake)
    for bad in (1.5, True, None):
        fake = Fake("z", bad)
        with pytest.raises(TypeError, match="backend.priority must be an int"):
            be.register_backend(fake)
    with pytest.raises(ValueError, match="backend 'triton' is already registered"):
        be.register_backend(be.TritonBackend())
    assert list(registry) == ["torch", "triton"]  # nothing refused was registered
    with pytest.raises(ValueError, match="op must be one of"):
        be.BackendCall("prefill")
    with pytest.raises(ValueError, match="name must be a registered backend"):
        be.get_backend("auto")


def backend_name_tests(source: str) -> list[str]:
    """The comparisons in ``source`` that test a backend argument against a backend's name (``backend ==
    "triton"``, ``config.backend in ("torch", "triton")``): what the registry is there to answer."""
    names = set(be.backend_names())
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        constants = {c.value for o in operands for c in ast.walk(o) if isinstance(c, ast.Constant)}
        if constants & names and "backend" in ast.unparse(node).lower():
            found.append(ast.unparse(node))
    return found


def test_only_the_dispatch_tests_backend_names():
    """Layers, models and design models ask the registry (``backend_unsupported``, ``forced_backend``)."""
    assert backend_name_tests('if check_backend(backend) == "triton": pass') == ["check_backend(backend) == 'triton'"]
    assert backend_name_tests('ok = getattr(config, "backend", "auto") in ("torch",)')
    assert not backend_name_tests('if phase_a == "triton": pass')  # a piece's option, not a backend
    found = {module_name(p): backend_name_tests(p.read_text(encoding="utf-8")) for p in module_paths()
             if module_name(p) != "bayeslayer.ops.backend"}
    assert not {m: f for m, f in found.items() if f}


# -- the rules (no kernel runs) ------------------------------------------------------------------------
def test_auto_takes_triton_for_cuda_tensors_only_when_it_can(monkeypatch):
    sel = be.select_backend
    cuda_ok = sel("auto", "chunk", device="cuda", head_dim=64, chunk_size=64, dtype=torch.bfloat16)
    assert cuda_ok == ("triton" if support.triton_installed() else "torch")
    # CPU tensors: PyTorch, even under the interpreter (it is for tests, not speed)
    assert sel("auto", "chunk", device="cpu", head_dim=64, chunk_size=64) == "torch"
    # a configuration without a kernel: PyTorch
    assert sel("auto", "chunk", device="cuda", rotation=True) == "torch"
    assert sel("auto", "chunk", device="cuda", write="reset") == "torch"
    assert sel("auto", "chunk", device="cuda", head_dim=512) == "torch"
    assert sel("auto", "chunk", device="cuda", chunk_size=128) == "torch"
    assert sel("auto", "step", device="cuda", head_dim=64, chunk_size=128) == cuda_ok  # no chunks in a step
    assert sel("torch", "chunk", device="cuda") == "torch"
    monkeypatch.setattr(support, "triton_installed", lambda: False)
    assert sel("auto", "chunk", device="cuda", head_dim=64) == "torch"


# -- (c) a forced Triton backend that cannot run says why --------------------------------------------
def test_forced_triton_without_triton_says_triton_is_missing(monkeypatch):
    monkeypatch.setattr(support, "triton_installed", lambda: False)
    q, k, v, r2, ell2, alpha = inputs()
    with pytest.raises(BackendError, match=r"Triton is not installed \(pip install triton\)"):
        bl_chunk(q, k, v, r2, ell2, alpha, chunk_size=16, backend="triton")
    with pytest.raises(BackendError, match="Triton is not installed"):
        be.select_backend("triton", "chunk", device="cuda")


@pytest.mark.skipif(not support.triton_installed(), reason="Triton is not installed")
def test_forced_triton_on_cpu_without_interpreter_says_so(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    q, k, v, r2, ell2, alpha = inputs()
    msg = r"cannot run this chunk: there is no CUDA device and TRITON_INTERPRET is not 1"
    with pytest.raises(BackendError, match=msg):
        bl_chunk(q, k, v, r2, ell2, alpha, chunk_size=16, backend="triton")
    st = initial_bl_state(1, 2, 16, 8, dtype=torch.float64)
    with pytest.raises(BackendError, match="cannot run this step: there is no CUDA device and TRITON_INTERPRET"):
        BAYESIAN.step(q[:, 0], k[:, 0], v[:, 0], r2=r2[:, 0], ell2=ell2[:, 0], alpha=alpha[:, 0], state=st,
                      backend="triton")
    # the Triton entry points themselves say the same instead of failing inside Triton
    from bayeslayer.ops.bayesian_layer.chunk_triton import bl_chunk_triton

    with pytest.raises(BackendError, match="no CUDA device and TRITON_INTERPRET is not 1"):
        bl_chunk_triton(q, k, v, r2, ell2, alpha, chunk_size=16)
    # with a CUDA device present, CPU tensors are named as the problem
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(BackendError, match="the inputs are on the CPU and TRITON_INTERPRET is not 1"):
        bl_chunk(q, k, v, r2, ell2, alpha, chunk_size=16, backend="triton")


def test_forced_triton_names_each_unsupported_configuration():
    q, k, v, r2, ell2, alpha = inputs()
    theta = torch.rand(1, 10, 2, 8, dtype=torch.float64)
    cases = [
        (lambda: bl_chunk(q, k, v, r2, ell2, theta=theta, chunk_size=16, backend="triton"),
         r"rotation dynamics \(theta\) have no Triton kernel"),
        (lambda: GATED_DELTANET.chunk(q, k, v, gain=r2, alpha=alpha, chunk_size=16, backend="triton"),
         "write model 'reset' has no Triton kernel"),
        (lambda: DIAGONAL_COVARIANCE.chunk(q, k, v, r2=r2, ell2=ell2, chunk_size=16, backend="triton"),
         "write model 'diagonal' has no Triton kernel"),
        (lambda: bl_chunk(q, k, v, r2, ell2, alpha, chunk_size=8, backend="triton"),
         r"chunk_size=8 is not one of the kernels' \(16, 32, 64\)"),
        (lambda: bl_chunk(*inputs(T=2, D=300), chunk_size=16, backend="triton"),
         "key head dim D=300 is outside the kernels' 1..256"),
        (lambda: GATED_DELTANET.step(q[:, 0], k[:, 0], v[:, 0], gain=r2[:, 0], alpha=alpha[:, 0],
                                     state=(torch.zeros(1, 2, 16, 8, dtype=torch.float64), None),
                                     backend="triton"),
         "cannot run this step: write model 'reset' has no Triton kernel"),
    ]
    for call, match in cases:
        with pytest.raises(BackendError, match=match):
            call()
    with pytest.raises(BackendError, match="input dtype float8_e4m3fn is not one of the kernels' float32, "
                                           "bfloat16, float16, float64"):
        be.select_backend("triton", "chunk", device="cpu", dtype=torch.float8_e4m3fn)


# -- the kernels through the dispatch (interpreter) ----------------------------------------------------
@interpreter
@pytest.mark.parametrize("decay", ["none", "diagonal"])
def test_design_chunk_and_step_run_the_kernels_and_equal_torch(decay):
    q, k, v, r2, ell2, alpha = inputs(T=13, decay=decay)
    kw = dict(r2=r2, ell2=ell2, alpha=alpha, output_final_state=True, return_variance=True, chunk_size=16)
    with triton_only() as calls:
        tri = BAYESIAN.chunk(q, k, v, backend="triton", **kw)
    assert calls == {"chunk": 1}
    ref = BAYESIAN.chunk(q, k, v, backend="torch", **kw)
    assert tri.gain is None and ref.gain is not None
    for a, b in ((tri.o, ref.o), (tri.variance, ref.variance), (tri.state[0], ref.state[0]),
                 (tri.state[1], ref.state[1])):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    st = ref.state
    step_kw = dict(r2=r2[:, 0], ell2=ell2[:, 0], alpha=None if alpha is None else alpha[:, 0], state=st)
    with triton_only() as calls:
        tri = BAYESIAN.step(q[:, 0], k[:, 0], v[:, 0], backend="triton", **step_kw)
    assert calls == {"step": 1}
    ref = BAYESIAN.step(q[:, 0], k[:, 0], v[:, 0], backend="torch", **step_kw)
    for a, b in ((tri.o, ref.o), (tri.variance, ref.variance), (tri.state[0], ref.state[0]),
                 (tri.state[1], ref.state[1])):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@interpreter
def test_a_step_that_needs_gradients_runs_the_differentiable_chunk_kernel():
    """The step kernel is not differentiable: with inputs that need gradients a forced Triton step
    runs the chunk forward on one token (never PyTorch), and its gradients equal the PyTorch step's."""
    q, k, v, r2, ell2, alpha = inputs(T=1)
    st = initial_bl_state(1, 2, 16, 8, p0=0.7, dtype=torch.float64)
    leaves = [x.requires_grad_(True) for x in (q, k, v, r2, ell2, alpha)]

    def run(backend):
        o, var, (M, P) = bl_step(q[:, 0], k[:, 0], v[:, 0], r2[:, 0], ell2[:, 0], alpha[:, 0], state=st,
                                 return_variance=True, backend=backend)
        return (o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum() + var.sum() + M.sum() + P.sum()

    with triton_only() as calls:
        out = run("triton")
        g1 = torch.autograd.grad(out, leaves)  # the chain's backward: Triton too
    assert calls == {"step": 1, "chunk": 1}  # the Triton step ran its chunk forward on one token
    assert calls.kernels == {"chain": 1, "chain_backward": 1}
    g2 = torch.autograd.grad(run("torch"), leaves)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        assert b.abs().max() > 0
    with torch.no_grad(), triton_only() as calls:
        run("triton")
    assert calls == {"step": 1} and not calls.kernels  # the step kernel: no chunk forward


@interpreter
def test_the_spy_catches_the_pytorch_path():
    """The spy that the layer and model tests rely on fails a run that takes the PyTorch path."""
    q, k, v, r2, ell2, alpha = inputs()
    with pytest.raises(TorchPathRan), triton_only():
        bl_chunk(q, k, v, r2, ell2, alpha, chunk_size=16, backend="torch")
    with pytest.raises(TorchPathRan), triton_only():
        BAYESIAN.chunk(q, k, v, r2=r2, ell2=ell2, alpha=alpha, chunk_size=16)  # CPU: auto -> torch
    with triton_only() as calls:
        bl_chunk(q, k, v, r2, ell2, alpha, chunk_size=16, backend="triton")
    assert calls == {"chunk": 1}


# -- (d) no import cycle (the whole package: tests/test_import_cycles.py) ---------------------------------
def test_import_walker_sees_a_cycle():
    """The walker is not vacuous: the pre-dispatch layout (ops/bayesian_layer/chunk.py importing the Triton path
    lazily, and the Triton path importing ops/bayesian_layer/chunk.py) is a cycle to it."""
    graph = import_graph(("ops",))
    assert "bayeslayer.ops.bayesian_layer.chunk" in graph["bayeslayer.ops.bayesian_layer.chunk_triton"]
    graph["bayeslayer.ops.bayesian_layer.chunk"].add("bayeslayer.ops.bayesian_layer.chunk_triton")
    cycle = find_cycle(graph)
    assert cycle is not None and "bayeslayer.ops.bayesian_layer.chunk" in cycle


def test_the_pytorch_path_never_imports_the_triton_path():
    graph = import_graph(("ops",))
    seen, todo = set(), ["bayeslayer.ops.bayesian_layer.chunk", "bayeslayer.ops.bayesian_layer.recurrent"]
    while todo:
        mod = todo.pop()
        if mod not in seen:
            seen.add(mod)
            todo.extend(graph.get(mod, ()))
    assert not {m for m in seen if "triton" in m.rsplit(".", 1)[-1] or m == "bayeslayer.ops.backend"}


def test_every_ops_module_imports_first_in_a_fresh_interpreter():
    """Each module of bayeslayer.ops imported first (bayeslayer's modules dropped before each, torch
    kept), then Triton itself must not have been imported by anything but the kernel modules.

    Python imports a module's parent packages before it, and ``bayeslayer/__init__`` imports ``bayeslayer.ops``:
    a module that the package itself imports on its way in is imported, whichever of them is asked for first, in
    the package's one order.  One fresh import of the package stands for all of those; every other module
    (the kernels, the scan's backward, ...) is imported first on its own."""
    kernels = ("bayeslayer.ops.bayesian_layer.kernels_triton", "bayeslayer.ops.utils.ldl_triton",  # @triton.jit: last
               "bayeslayer.ops.bayesian_layer.scan_triton", "bayeslayer.ops.bayesian_layer.scan_backward_triton",
               "bayeslayer.ops.bayesian_layer.chain_triton")
    mods = sorted((module_name(p) for p in (PACKAGE / "ops").rglob("*.py")), key=lambda m: (m in kernels, m))
    script = f"""
import importlib, sys
import torch
def first(name):
    for m in [m for m in sys.modules if m == "bayeslayer" or m.startswith("bayeslayer.")]:
        del sys.modules[m]
    importlib.import_module(name)
    if name not in {kernels!r}:
        assert "triton" not in sys.modules, f"importing {{name}} imported triton"
first("bayeslayer")
by_package = [name for name in {mods!r} if name in sys.modules]
alone = [name for name in {mods!r} if name not in by_package]
for name in alone:
    first(name)
print("ok", len(by_package), len(alone))
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=PACKAGE.parent)
    assert res.returncode == 0, res.stderr[-3000:]
    ok, by_package, alone = res.stdout.split()
    assert ok == "ok" and int(by_package) + int(alone) == len(mods)
    assert int(by_package) > 0 and int(alone) >= len(kernels)  # the kernels are never imported by the package
