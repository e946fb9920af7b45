"""One compile per (D, C, variant): the sequence lengths, their packing and the segment count never reach a
kernel's compile key.

Under ``TRITON_INTERPRET=1`` nothing compiles, so :func:`tests.triton_spy.compile_keys` computes, for every
launch of the project's kernels, the key Triton's JIT would look the compiled kernel up by on an sm_90 GPU (every
``tl.constexpr``, pointer dtypes and alignment, the 1 / multiple-of-16 specialisation of int arguments).  A
forward and backward of ``bl_chunk_triton`` — the covariance chain, and the segment scan (``n_segments``) — at other
lengths, packings and segment counts, same D, C and variant, must add no key: on a GPU they reuse the first call's
compiles (the device check then compiles each kernel once per head dim, not once per row).
"""

from __future__ import annotations

import os

import pytest
import torch

from bayeslayer.ops.bayesian_layer import mean_pass_fla

from ..triton_spy import compile_keys
from .scan_inputs import regime_inputs

pytest.importorskip("triton")
interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
pytestmark = pytest.mark.skipif(not interpreted, reason="computes compile keys of interpreted launches")


def _forward_backward(T: int, n_segments: int, diagonal: bool):
    from bayeslayer.ops.bayesian_layer.chunk_triton import bl_chunk_triton

    q, k, v, r2, ell2, alpha = regime_inputs("longmem", 1, T, 1, 16, 8, diagonal=diagonal, seed=T + n_segments,
                                             dtype=torch.float32)
    leaves = [x.requires_grad_(True) for x in (q, k, v, r2, ell2, alpha)]
    with mean_pass_fla.one_autotune_config():  # the interpreter cannot benchmark fla's autotune configs
        o, var, (M, P) = bl_chunk_triton(*leaves, output_final_state=True, return_variance=True, chunk_size=16,
                                         n_segments=n_segments)
        (o.square().sum() + var.sum() + M.sum() + P.sum()).backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in leaves)


@pytest.mark.parametrize("diagonal", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["scalar", "diagonal"])
def test_segment_count_and_length_add_no_compile(diagonal):
    """Segments of 1 chunk (T = 32, 2 segments: every kernel of the forward and the backward runs), then of 2
    (T = 80: 5 chunks in 3 segments, the last ragged): every kernel launched keeps the keys of the first call.
    The second call differs from the first in every quantity a compile key could read: the chunks per segment
    (1, which Triton specialises for an int argument, then 2), the segment count (2, 3), the chunk count and
    length (2 and 5 chunks: no power of two in common) and T.
    (While B2/B4 took the chunks per segment as a ``tl.constexpr``, each segment length was a new compile.)"""
    with compile_keys() as keys:
        _forward_backward(32, 2, diagonal)
        first = {name: set(k) for name, k in keys.items()}
        _forward_backward(80, 3, diagonal)
    for name in ("bl_chunk_cov_kernel", "bl_chunk_prep_kernel", "scan_track_kernel", "scan_phase_b_kernel",
                 "bl_chunk_mean_kernel", "scan_segment_adjoint_kernel", "scan_reverse_kernel"):
        assert name in first, f"{name} was not launched: the test no longer covers it"
    for name, k in keys.items():
        assert k == first.get(name), f"{name}: {len(k - first.get(name, set()))} new compile key(s) {k - first[name]}"
    # B2 and B4 are two variants (REPLAY, INPUTS) of one kernel; nothing else may multiply it
    assert len(first["scan_segment_adjoint_kernel"]) == 2


def _chain_forward_backward(T: int, cu: list[int] | None):
    from bayeslayer.ops.bayesian_layer.chunk_triton import bl_chunk_triton

    q, k, v, r2, ell2, alpha = regime_inputs("longmem", 1 if cu else 2, T, 1, 16, 8, seed=T, dtype=torch.float32)
    leaves = [x.requires_grad_(True) for x in (q, k, v, r2, ell2, alpha)]
    cu_t = torch.tensor(cu) if cu else None
    with mean_pass_fla.one_autotune_config():
        o, var, (M, P) = bl_chunk_triton(*leaves, output_final_state=True, return_variance=True, cu_seqlens=cu_t)
        (o.square().sum() + var.sum() + M.sum() + P.sum()).backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in leaves)


def test_chain_lengths_and_packing_add_no_compile():
    """The chain kernels compile once per (D, m, variant): two sequences of 40 tokens, then three packed ones of other
    lengths (20, 0 and 37 tokens: an empty one among them, T = 57) reuse the first call's keys."""
    from bayeslayer.ops.bayesian_layer.chunk_triton import RUN_ON_DEVICE  # noqa: F401 (the chain is the default)

    with compile_keys() as keys:
        _chain_forward_backward(40, None)
        first = {name: set(k) for name, k in keys.items()}
        _chain_forward_backward(57, [0, 20, 20, 57])
    for name in ("chain_forward_kernel", "chain_backward_kernel"):
        assert name in first, f"{name} was not launched: the test no longer covers it"
        assert len(first[name]) == 1
    for name, k in keys.items():
        if name.startswith("chain_"):
            assert k == first[name], f"{name}: new compile key(s) {k - first[name]}"
