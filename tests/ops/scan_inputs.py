"""Inputs for the segment-scan tests: docs/theory.md §6.6's long-memory and stress regimes.

With typical decays (α 0.9–1) a segment's transition A_s is ≈ 0 and a scan that drops it would
still pass; these regimes keep A_s large (docs/theory.md §6.6).
"""

from __future__ import annotations

import torch


def regime_inputs(regime: str, B: int, T: int, H: int, D: int, m: int, *, diagonal: bool = False, G: int = 1,
                  dtype=torch.float64, seed: int = 0, device="cpu"):
    """``(q, k, v, r2, ell2, alpha)`` for ``regime`` in {"longmem", "stress"} (float64, then cast).

    long-memory: α ∈ [0.998, 1], ℓ² ∈ [1e-4, 2e-4], r² ∈ [0.1, 1.1];
    stress: α ∈ [0.999, 1], ℓ² ∈ [1e-6, 2e-6], r² ∈ [1e-3, 2e-3], unit keys in a ``min(16, D/2)``-dim
    subspace plus 1e-2 noise.  ``G > 1`` gives r² ``[B, T, H, G]``.
    """
    g = torch.Generator().manual_seed(seed)
    f = dict(dtype=torch.float64)

    def rand(*s):
        return torch.rand(*s, generator=g, **f)

    def randn(*s):
        return torch.randn(*s, generator=g, **f)

    rs = (B, T, H) if G == 1 else (B, T, H, G)
    ash = (B, T, H, D) if diagonal else (B, T, H)
    if regime == "longmem":
        k = torch.nn.functional.normalize(randn(B, T, H, D), dim=-1)
        r2 = 0.1 + rand(*rs)
        ell2 = 1e-4 + 1e-4 * rand(B, T, H)
        alpha = 0.998 + 0.002 * rand(*ash)
    elif regime == "stress":
        sub = min(16, max(D // 2, 1))
        basis = torch.nn.functional.normalize(randn(sub, D), dim=-1)
        k = torch.nn.functional.normalize(randn(B, T, H, sub) @ basis + 1e-2 * randn(B, T, H, D), dim=-1)
        r2 = 1e-3 + 1e-3 * rand(*rs)
        ell2 = 1e-6 + 1e-6 * rand(B, T, H)
        alpha = 0.999 + 0.001 * rand(*ash)
    else:
        raise ValueError(f"regime must be 'longmem' or 'stress', got {regime!r}")
    q = randn(B, T, H, D)
    v = randn(B, T, H, m)
    return tuple(x.to(dtype=dtype, device=device) for x in (q, k, v, r2, ell2, alpha))


def note_inputs(regime: str, H: int = 4, T: int = 4096, D: int = 64, dtype=torch.float64):
    """The inputs of the float64 precision study behind ``NOTE_FP32`` (docs/theory.md §6.6; same distributions,
    draw order and seed).

    Returns ``(k, r2, ell2, log_alpha)`` laid out ``[1, T, H, ·]``, so that precision figures can be
    compared with the note's table on the very same numbers.
    """
    torch.manual_seed(0)
    f = dict(dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(H, T, D, **f), dim=-1)
    if regime == "longmem":
        r2 = 0.1 + torch.rand(H, T, **f)
        l2 = 1e-4 + 1e-4 * torch.rand(H, T, **f)
        la = torch.log(0.998 + 0.002 * torch.rand(H, T, **f))
    elif regime == "stress":
        basis = torch.nn.functional.normalize(torch.randn(16, D, **f), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(H, T, 16, **f) @ basis + 1e-2 * torch.randn(H, T, D, **f), dim=-1)
        r2 = 1e-3 + 1e-3 * torch.rand(H, T, **f)
        l2 = 1e-6 + 1e-6 * torch.rand(H, T, **f)
        la = torch.log(0.999 + 0.001 * torch.rand(H, T, **f))
    else:
        raise ValueError(f"regime must be 'longmem' or 'stress', got {regime!r}")
    return tuple(x.transpose(0, 1).unsqueeze(0).to(dtype) for x in (k, r2, l2, la))
