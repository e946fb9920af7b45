"""A spy on the backend dispatch: counts calls into the Triton entry points and makes the PyTorch
path raise, so that a test fails if anything silently runs on PyTorch when Triton was selected.

    with triton_only() as calls:
        model.generate(...)
    assert calls == {"chunk": n_layers, "step": n_layers * (new_tokens - 1)}
    assert calls.kernels["scan"] == n_layers  # each chunk call ran the segment-scan forward

The spy wraps the names :mod:`bayeslayer.ops.backend` calls (``bl_chunk_triton``,
``bl_step_triton``; the kernels still run) and replaces its PyTorch entry points
(``filter_chunk``, ``filter_recurrent``) and the PyTorch chunk path's covariance pass (looked up
in its own module at call time, so it is caught however ``filter_chunk`` was imported) with a
function that raises; likewise the PyTorch twins of the segment scan (``ops/bayesian_layer/scan.py``) and the
chunk-serial Triton forward (``_forward_triton``), while the scan's Triton pieces are counted in
``calls.kernels``.  Exact counts catch a caller that bypasses the dispatch altogether.
Forward only: the Triton backward recomputes blocks with the PyTorch chunk step by design.
"""

from __future__ import annotations

import contextlib
from collections import Counter


class TorchPathRan(AssertionError):
    pass


class Calls(Counter):
    """Calls into the dispatch's Triton entry points (``"chunk"``, ``"step"``: compare with a dict), and in
    ``kernels`` the pieces of the segment-scan forward they reached: ``"scan"`` (the forward),
    ``"phase_a"``, ``"phase_b"`` (the Triton phases; called for every forward, launching only when a
    sequence has more than one segment), ``"mean"`` (the mean kernel)."""

    def __init__(self):
        super().__init__()
        self.kernels: Counter = Counter()


@contextlib.contextmanager
def triton_only():
    from bayeslayer.ops import backend
    from bayeslayer.ops.bayesian_layer import chunk as torch_chunk
    from bayeslayer.ops.bayesian_layer import chunk_triton as triton_chunk
    from bayeslayer.ops.bayesian_layer import scan as torch_scan
    from bayeslayer.ops.bayesian_layer import scan_triton as triton_scan

    calls = Calls()
    saved = {}

    def patch(module, name, value):
        if not hasattr(module, name):
            raise AttributeError(f"{module.__name__} has no {name}: update tests/triton_spy.py")
        saved[(module, name)] = getattr(module, name)
        setattr(module, name, value)

    def counting(key, fn, into=None):
        def spy(*args, **kwargs):
            (calls if into is None else into)[key] += 1
            return fn(*args, **kwargs)
        return spy

    def forbidden(name):
        def raise_(*args, **kwargs):
            raise TorchPathRan(f"the PyTorch path ({name}) ran although backend='triton' was selected")
        return raise_

    try:
        patch(backend, "bl_chunk_triton", counting("chunk", backend.bl_chunk_triton))
        patch(backend, "bl_step_triton", counting("step", backend.bl_step_triton))
        patch(backend, "filter_chunk", forbidden("ops.bayesian_layer.chunk.filter_chunk"))
        patch(backend, "filter_recurrent", forbidden("ops.bayesian_layer.recurrent.filter_recurrent"))
        patch(torch_chunk, "covariance_pass", forbidden("ops.bayesian_layer.chunk.covariance_pass"))
        for name in ("forward_scan_triton", "phase_a_triton", "phase_b_triton", "mean_pass_triton"):
            key = {"forward_scan_triton": "scan", "mean_pass_triton": "mean"}.get(name, name.replace("_triton", ""))
            patch(triton_scan, name, counting(key, getattr(triton_scan, name), calls.kernels))
        # the PyTorch twins of the scan, and the chunk-serial Triton forward the scan replaced
        for name in ("phase_a", "phase_b", "covariance_scan", "mean_pass_reference"):
            patch(torch_scan, name, forbidden(f"ops.bayesian_layer.scan.{name}"))
        patch(triton_chunk, "_forward_triton",
              forbidden("ops.bayesian_layer.chunk_triton._forward_triton (the chunk-serial forward)"))
        yield calls
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


@contextlib.contextmanager
def compile_keys(arch: int = 90):
    """Record, for every launch of one of the project's Triton kernels, the key Triton's JIT would look its
    compiled kernel up by on an ``sm_<arch>`` GPU: ``keys[kernel name]`` is the set of distinct keys, i.e. the
    number of compiles that kernel would need for what ran.

    Under ``TRITON_INTERPRET=1`` nothing compiles, so the key is computed the way ``JITFunction.run`` does
    (its argument binder: every ``tl.constexpr`` value, the dtype and 16-byte alignment of every pointer, and
    for an int argument without ``do_not_specialize`` whether it is 1 or a multiple of 16), for the CUDA backend,
    from the launch's own arguments; then the interpreted kernel runs as usual.
    """
    from collections import defaultdict

    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from bayeslayer.ops.bayesian_layer import kernels_triton as kernels
    from bayeslayer.ops.bayesian_layer import scan_backward_triton as scan_backward
    from bayeslayer.ops.bayesian_layer import scan_triton as scan
    from bayeslayer.ops.utils import ldl_triton as ldl

    backend = make_backend(GPUTarget("cuda", arch, 32))
    keys: dict[str, set] = defaultdict(set)
    saved = []
    for module in (kernels, ldl, scan, scan_backward):
        for name, fn in vars(module).items():
            if not isinstance(fn, InterpretedFunction) or fn.fn.__module__ != module.__name__:
                continue
            opts = {k: v for k, v in fn.kwargs.items() if k in ("do_not_specialize", "do_not_specialize_on_alignment")}
            jit = JITFunction(fn.fn, **opts)
            binder = create_function_from_signature(jit.signature, jit.params, backend)

            def run(*args, _name=name, _binder=binder, _run=fn.run, **kwargs):
                launch = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
                _, specialization, options = _binder(*args, **launch)
                keys[_name].add(str(specialization) + str(sorted(options.items())))
                return _run(*args, **kwargs)

            saved.append((fn, "run" in vars(fn)))
            fn.run = run
    try:
        yield keys
    finally:
        for fn, had in saved:
            if not had:
                del fn.run
