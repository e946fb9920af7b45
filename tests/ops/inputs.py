"""Random inputs for the op tests, and a pairwise-covering grid builder.

Not a test module: imported by ``tests/ops`` and ``tests/design``.  Keys are scaled to about
unit norm, noise variances and decays sit in ranges where the filter is well conditioned, so
that float64 differences between two paths measure the algorithm and not ill-conditioning.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

# Every transition A_t the ops support (docs/theory.md §1.3); rotations come with no shrink, one shrink
# per head (alpha [B, T, H]) and one shrink per channel pair (alpha [B, T, H, D/2]).
DYNAMICS = ("identity", "scalar", "diagonal", "rotation", "rotation_scalar", "rotation_pairs")


def dynamics_inputs(
    kind: str, B: int, T: int, H: int, D: int, *, dtype=torch.float64, low: float = 0.8, high: float = 1.0
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(alpha, theta)`` for a dynamics ``kind`` with decays uniform in ``[low, high]``."""
    if kind not in DYNAMICS:
        raise ValueError(f"unknown dynamics kind {kind!r}")

    def decay(*shape):
        return low + (high - low) * torch.rand(*shape, dtype=dtype)

    alpha = theta = None
    if kind == "scalar":
        alpha = decay(B, T, H)
    elif kind == "diagonal":
        alpha = decay(B, T, H, D)
    elif kind.startswith("rotation"):
        theta = torch.randn(B, T, H, D // 2, dtype=dtype)
        if kind == "rotation_scalar":
            alpha = decay(B, T, H)
        elif kind == "rotation_pairs":
            alpha = decay(B, T, H, D // 2)
    return alpha, theta


def random_psd(*lead: int, D: int, dtype=torch.float64, floor: float = 0.1) -> torch.Tensor:
    """A random symmetric positive-definite ``[*lead, D, D]`` matrix with eigenvalues ≥ ``floor``."""
    A = torch.randn(*lead, D, D, dtype=dtype) / D**0.5
    return A @ A.transpose(-1, -2) + floor * torch.eye(D, dtype=dtype)


def bl_inputs(
    *,
    B: int = 2,
    T: int = 37,
    H: int = 2,
    D: int = 6,
    m: int = 4,
    G: int = 1,
    dynamics: str = "scalar",
    initial_state: bool = False,
    dtype=torch.float64,
) -> dict[str, Any]:
    """Keyword arguments for ``bl_recurrent``/``bl_chunk``: q, k, v, r2, ell2, alpha, theta, initial_state."""
    q = torch.randn(B, T, H, D, dtype=dtype)
    k = torch.randn(B, T, H, D, dtype=dtype) / D**0.5
    v = torch.randn(B, T, H, m, dtype=dtype)
    r2_shape = (B, T, H) if G == 1 else (B, T, H, G)
    r2 = 0.1 + torch.rand(*r2_shape, dtype=dtype)
    ell2 = 0.01 + 0.1 * torch.rand(B, T, H, dtype=dtype)
    alpha, theta = dynamics_inputs(dynamics, B, T, H, D, dtype=dtype)
    state = None
    if initial_state:
        M0 = torch.randn(B, H, D, m, dtype=dtype)
        P0 = random_psd(B, H, D=D, dtype=dtype) if G == 1 else random_psd(B, H, G, D=D, dtype=dtype)
        state = (M0, P0)
    return dict(q=q, k=k, v=v, r2=r2, ell2=ell2, alpha=alpha, theta=theta, initial_state=state)


def pairwise(factors: dict[str, tuple]) -> list[dict[str, Any]]:
    """A small list of cases in which every pair of levels of every two factors occurs at least once.

    Greedy: repeatedly take the case of the full product (in its fixed order) that covers the
    most pairs not yet covered.  Deterministic, so test ids are stable.
    """
    names = list(factors)
    full = [dict(zip(names, levels, strict=True)) for levels in itertools.product(*factors.values())]

    def pairs_of(case):
        return {(a, case[a], b, case[b]) for a, b in itertools.combinations(names, 2)}

    uncovered = set().union(*(pairs_of(c) for c in full))
    chosen = []
    while uncovered:
        best = max(full, key=lambda c: len(pairs_of(c) & uncovered))
        chosen.append(best)
        uncovered -= pairs_of(best)
    return chosen


def case_id(case: dict[str, Any]) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items())


def fixed_weights(tensors, seed: int = 1234) -> list[torch.Tensor]:
    """Random weights for a scalar loss ``Σ_i <w_i, x_i>``, the same for every path.

    Drawn by shape, not with ``randn_like``: ``randn_like`` follows the memory layout, so two
    paths returning the same values with different strides would get different weights.
    """
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tuple(x.shape), generator=g, dtype=x.dtype) for x in tensors]
