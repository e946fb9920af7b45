"""A spy on the backend registry: counts the calls the dispatch makes into one backend and makes every other
registered backend raise, so that a test fails if anything silently runs on PyTorch when Triton was selected.

    with triton_only() as calls:
        model.generate(...)
    assert calls == {"chunk": n_layers, "step": n_layers * (new_tokens - 1)}
    assert calls.kernels["chain"] == n_layers  # each chunk call ran the covariance chain's forward

:func:`backend_only` wraps the ``chunk`` and ``step`` of each entry of
:data:`bayeslayer.ops.backend.BACKEND_REGISTRY` (on the registered object, so a backend's own call of
``self.chunk`` is counted too: a Triton step that needs gradients counts ``{"step": 1, "chunk": 1}``).
:func:`triton_only` adds the Triton path's pieces: the PyTorch chunk path's covariance pass (looked up in its own
module at call time, so it is caught however ``filter_chunk`` was called) and the PyTorch twins of the segment
scan's covariance phases (``ops/bayesian_layer/scan.py``) raise, while the chain's kernels (``"chain"``,
``"chain_backward"``) and the scan's Triton pieces are counted in ``calls.kernels``.  The mean pass's PyTorch twin
is allowed: float64 runs it by design (fla does not compute in float64).  Exact counts catch a caller that
bypasses the dispatch altogether.
"""

from __future__ import annotations

import contextlib
from collections import Counter


class TorchPathRan(AssertionError):
    """A backend other than the selected one ran (for the Triton spy: the PyTorch path)."""


class Calls(Counter):
    """Calls the dispatch made into the spied backend (``"chunk"``, ``"step"``: compare with a dict), and in
    ``kernels`` the pieces of the Triton path they reached: ``"chain"`` and ``"chain_backward"`` (the covariance
    chain's launches), ``"scan"`` (the segment-scan forward), ``"phase_a"``, ``"phase_b"`` (its Triton phases;
    called for every scan forward, launching only when a sequence has more than one segment), ``"mean"`` (the
    scan's mean kernel)."""

    def __init__(self):
        super().__init__()
        self.kernels: Counter = Counter()


class _Patches:
    """Attributes replaced for the length of a ``with`` block, put back (or removed) on exit."""

    _MISSING = object()

    def __init__(self):
        self._saved = []

    def set(self, owner, name, value):
        if not hasattr(owner, name):
            raise AttributeError(f"{owner!r} has no {name}: update tests/triton_spy.py")
        self._saved.append((owner, name, vars(owner).get(name, self._MISSING)))
        setattr(owner, name, value)

    def restore(self):
        for owner, name, value in reversed(self._saved):
            if value is self._MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._saved.clear()


def _counting(counter, key, fn):
    def spy(*args, **kwargs):
        counter[key] += 1
        return fn(*args, **kwargs)
    return spy


def _forbidden(what, selected):
    def raise_(*args, **kwargs):
        raise TorchPathRan(f"{what} ran although backend={selected!r} was selected")
    return raise_


@contextlib.contextmanager
def backend_only(name: str):
    """Count the dispatch's ``chunk`` / ``step`` calls into the registered backend ``name``; any other registered
    backend's ``chunk`` or ``step`` raises :class:`TorchPathRan`."""
    from bayeslayer.ops.backend import BACKEND_REGISTRY, get_backend

    get_backend(name)
    calls, patches = Calls(), _Patches()
    try:
        for entry in BACKEND_REGISTRY.values():
            for op in ("chunk", "step"):
                if entry.name == name:
                    patches.set(entry, op, _counting(calls, op, getattr(entry, op)))
                else:
                    patches.set(entry, op, _forbidden(f"the {entry.label} backend's {op}", name))
        yield calls
    finally:
        patches.restore()


@contextlib.contextmanager
def triton_only():
    """:func:`backend_only` for ``"triton"``, plus the segment-scan pieces (module docstring)."""
    from bayeslayer.ops.bayesian_layer import chain_triton
    from bayeslayer.ops.bayesian_layer import chunk as torch_chunk
    from bayeslayer.ops.bayesian_layer import scan as torch_scan
    from bayeslayer.ops.bayesian_layer import scan_triton as triton_scan

    patches = _Patches()
    with backend_only("triton") as calls:
        try:
            patches.set(torch_chunk, "covariance_pass",
                        _forbidden("the PyTorch path (ops.bayesian_layer.chunk.covariance_pass)", "triton"))
            for name in ("forward_scan_triton", "phase_a_triton", "phase_b_triton", "mean_pass_triton"):
                key = {"forward_scan_triton": "scan", "mean_pass_triton": "mean"}.get(name, name.replace("_triton", ""))
                patches.set(triton_scan, name, _counting(calls.kernels, key, getattr(triton_scan, name)))
            for name, key in (("chain_forward", "chain"), ("chain_backward", "chain_backward")):
                patches.set(chain_triton, name, _counting(calls.kernels, key, getattr(chain_triton, name)))
            # the PyTorch twins of the scan's covariance phases
            for name in ("phase_a", "phase_b", "covariance_scan"):
                patches.set(torch_scan, name,
                            _forbidden(f"the PyTorch path (ops.bayesian_layer.scan.{name})", "triton"))
            yield calls
        finally:
            patches.restore()


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

    from bayeslayer.ops.bayesian_layer import chain_triton as chain
    from bayeslayer.ops.bayesian_layer import kernels_triton as kernels
    from bayeslayer.ops.bayesian_layer import scan_backward_triton as scan_backward
    from bayeslayer.ops.bayesian_layer import scan_triton as scan
    from bayeslayer.ops.utils import ldl_triton as ldl

    backend = make_backend(GPUTarget("cuda", arch, 32))
    keys: dict[str, set] = defaultdict(set)
    saved = []
    for module in (chain, kernels, ldl, scan, scan_backward):
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
