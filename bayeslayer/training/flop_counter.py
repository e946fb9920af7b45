"""Measuring a training step's FLOPs with PyTorch's ``FlopCounterMode``: the check of :mod:`bayeslayer.ops.flops`.

:func:`measure_training_flops` runs one forward and one backward pass under the counter, with the
operations the counter does not know registered at :mod:`bayeslayer.ops.flops`' counts
(:func:`flop_counter_formulas`), and counts beside them the elementwise work the convention leaves out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..ops.flops import (
    FlopCount,
    cholesky_flops,
    cholesky_solve_flops,
    eigh_flops,
    triangular_solve_flops,
)


def flop_counter_formulas() -> dict:
    """``custom_mapping`` for ``FlopCounterMode``: the factorizations and solves at :mod:`bayeslayer.ops.flops`'
    counts, a depthwise convolution's backward at two forward-sized convolutions, and PyTorch's CPU attention
    kernel at the formula the counter uses for its GPU twins."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten

    def cholesky(A, *args, out_shape=None, **kwargs) -> int:
        *lead, n, _ = A
        return math.prod(lead) * cholesky_flops(n)

    def solve_triangular(A, Bm, *args, left=True, out_shape=None, **kwargs) -> int:
        *lead, n, _ = A
        *lead_b, rows, cols = Bm
        k = cols if left else rows
        return math.prod(torch.broadcast_shapes(tuple(lead), tuple(lead_b))) * triangular_solve_flops(n, k)

    def chol_solve(Bm, L, *args, out_shape=None, **kwargs) -> int:
        *lead, n, k = Bm
        return math.prod(torch.broadcast_shapes(tuple(lead), tuple(L[:-2]))) * cholesky_solve_flops(n, k)

    def eigh(A, *args, out_shape=None, **kwargs) -> int:
        *lead, n, _ = A
        return math.prod(lead) * eigh_flops(n)

    def conv_backward(grad_out, x, w, bias, stride, padding, dilation, transposed, output_padding, groups,
                      output_mask, out_shape=None, **kwargs) -> int:
        # PyTorch's own formula prices a grouped (depthwise) convolution's backward as a dense one; each
        # gradient of a stride-1 convolution takes the forward's multiply-adds, 2 FLOPs each
        forward = 2 * grad_out[0] * math.prod(grad_out[2:]) * w[0] * w[1] * math.prod(w[2:])
        return forward * (int(output_mask[0]) + int(output_mask[1]))

    def sdpa_cpu(q, k, v, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_flop_count(q, k, v)

    def sdpa_cpu_backward(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_backward_flop_count(grad_out, q, k, v)

    return {
        aten.linalg_cholesky_ex: cholesky, aten.linalg_solve_triangular: solve_triangular,
        aten.cholesky_solve: chol_solve, aten._cholesky_solve_helper: chol_solve, aten.linalg_eigh: eigh,
        aten._linalg_eigh: eigh, aten.convolution_backward: conv_backward,
        aten._scaled_dot_product_flash_attention_for_cpu: sdpa_cpu,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_cpu_backward,
    }


@dataclass(frozen=True)
class MeasuredFlops:
    """What :func:`measure_training_flops` measured: the counted FLOPs (:class:`FlopCount`), the output
    elements of every other operation (``elementwise``, forward and backward) and the counted FLOPs per
    operation (``by_op``, forward and backward)."""

    flops: FlopCount
    elementwise: FlopCount
    by_op: dict


def measure_training_flops(step: Callable[[], torch.Tensor]) -> MeasuredFlops:
    """Run ``loss = step()`` and ``loss.backward()`` under ``FlopCounterMode`` (with
    :func:`flop_counter_formulas`) and count, beside the FLOPs, one per output element of every operation
    the counter does not price (views and factory functions excluded): the elementwise work
    :mod:`bayeslayer.ops.flops`' convention leaves out."""
    from torch.utils.flop_counter import FlopCounterMode

    if not callable(step):
        raise TypeError(f"step must be a callable returning the loss, got {type(step).__name__}")
    formulas = flop_counter_formulas()
    counts, elems, by_op = [], [], []
    loss = None
    for phase in ("forward", "backward"):
        counter = FlopCounterMode(display=False, custom_mapping=formulas)
        sizes = _ElementCounter(set(counter.flop_registry) | set(formulas))
        with counter, sizes:
            if phase == "forward":
                loss = step()
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError("step must return the loss, a tensor of one element")
            else:
                loss.backward()
        counts.append(counter.get_total_flops())
        elems.append(sizes.total)
        by_op.append({str(op): int(f) for op, f in counter.get_flop_counts().get("Global", {}).items()})
    return MeasuredFlops(FlopCount(*counts), FlopCount(*elems), {"forward": by_op[0], "backward": by_op[1]})


class _ElementCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Output elements of every operation outside ``priced`` that computes (views, copies, fills and factory
    functions are data movement)."""

    _MOVES = {"view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "slice", "select",
              "unsqueeze", "squeeze", "as_strided", "alias", "detach", "diagonal", "unbind", "split",
              "split_with_sizes", "clone", "contiguous", "copy_", "_to_copy", "cat", "stack", "zeros",
              "zeros_like", "ones", "ones_like", "new_zeros", "new_empty", "new_empty_strided", "empty",
              "empty_like", "empty_strided", "fill_", "eye", "lift_fresh", "_local_scalar_dense",
              "scalar_tensor", "full", "full_like", "new_full", "arange", "flip", "repeat_interleave",
              "index_select", "embedding", "lift_fresh_copy", "select_backward", "slice_backward",
              "diagonal_backward", "unsqueeze_copy", "_reshape_alias", "constant_pad_nd", "masked_fill",
              "masked_fill_", "tril", "triu", "zero_", "diag_embed", "where", "split_backward",
              "unbind_backward", "embedding_dense_backward", "new_ones", "set_", "_conj", "resolve_conj"}

    def __init__(self, priced: set) -> None:
        super().__init__()
        self.priced = {str(op) for op in priced}
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if name not in self.priced and name.split(".")[-1] not in self._MOVES:
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor) and o.is_floating_point():
                    self.total += o.numel()
        return out


__all__ = ["MeasuredFlops", "flop_counter_formulas", "measure_training_flops"]
