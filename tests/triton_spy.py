"""A spy on the backend dispatch: counts calls into the Triton entry points and makes the PyTorch
path raise, so that a test fails if anything silently runs on PyTorch when Triton was selected.

    with triton_only() as calls:
        model.generate(...)
    assert calls == {"chunk": n_layers, "step": n_layers * (new_tokens - 1)}

The spy wraps the names :mod:`bayeslayer.ops.backend` calls (``bl_chunk_triton``,
``bl_step_triton``; the kernels still run) and replaces its PyTorch entry points
(``filter_chunk``, ``filter_recurrent``) and the PyTorch chunk path's covariance pass (looked up
in its own module at call time, so it is caught however ``filter_chunk`` was imported) with a
function that raises.  Exact counts catch a caller that bypasses the dispatch altogether.
Forward only: the Triton backward recomputes blocks with the PyTorch chunk step by design.
"""

from __future__ import annotations

import contextlib
from collections import Counter


class TorchPathRan(AssertionError):
    pass


@contextlib.contextmanager
def triton_only():
    from bayeslayer.ops import backend
    from bayeslayer.ops import chunk as torch_chunk

    calls: Counter = Counter()
    saved = {}

    def patch(module, name, value):
        if not hasattr(module, name):
            raise AttributeError(f"{module.__name__} has no {name}: update tests/triton_spy.py")
        saved[(module, name)] = getattr(module, name)
        setattr(module, name, value)

    def counting(key, fn):
        def spy(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return spy

    def forbidden(name):
        def raise_(*args, **kwargs):
            raise TorchPathRan(f"the PyTorch path ({name}) ran although backend='triton' was selected")
        return raise_

    try:
        patch(backend, "bl_chunk_triton", counting("chunk", backend.bl_chunk_triton))
        patch(backend, "bl_step_triton", counting("step", backend.bl_step_triton))
        patch(backend, "filter_chunk", forbidden("ops.chunk.filter_chunk"))
        patch(backend, "filter_recurrent", forbidden("ops.recurrent.filter_recurrent"))
        patch(torch_chunk, "covariance_pass", forbidden("ops.chunk.covariance_pass"))
        yield calls
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
