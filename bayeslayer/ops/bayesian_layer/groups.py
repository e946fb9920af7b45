"""Observation-noise groups folded into heads.

With ``G`` groups the ``m`` value columns split into ``G`` blocks of ``m/G``,
each with its own ``r_t²`` and therefore its own key-space covariance
(docs/theory.md §1.3).  Every group is an independent filter that shares the head's keys,
queries and dynamics, so the ops run them as ``H·G`` heads of value dim ``m/G``.
"""

from __future__ import annotations

import torch


def fold_heads(x: torch.Tensor | None, G: int, dim: int = 2) -> torch.Tensor | None:
    """Repeat a per-head tensor for every group: ``[..., H, ...] -> [..., H*G, ...]`` along ``dim``."""
    if x is None or G == 1:
        return x
    return torch.repeat_interleave(x, G, dim=dim)


def fold_values(v: torch.Tensor, G: int) -> torch.Tensor:
    """``[B, T, H, m] -> [B, T, H*G, m/G]`` (group g holds columns ``g*m/G .. (g+1)*m/G - 1``)."""
    if G == 1:
        return v
    B, T, H, m = v.shape
    return v.reshape(B, T, H * G, m // G)


def unfold_values(o: torch.Tensor, G: int) -> torch.Tensor:
    """Inverse of :func:`fold_values`."""
    if G == 1:
        return o
    B, T, HG, mg = o.shape
    return o.reshape(B, T, HG // G, G * mg)


def fold_noise(r2: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``[B, T, H]`` (G = 1) or ``[B, T, H, G]`` -> ``([B, T, H*G], G)``."""
    if r2.dim() == 3:
        return r2, 1
    B, T, H, G = r2.shape
    return r2.reshape(B, T, H * G), G


def fold_state_mean(M: torch.Tensor, G: int) -> torch.Tensor:
    """``M [B, H, D, m] -> [B, H*G, D, m/G]``."""
    if G == 1:
        return M
    B, H, D, m = M.shape
    return M.reshape(B, H, D, G, m // G).permute(0, 1, 3, 2, 4).reshape(B, H * G, D, m // G)


def unfold_state_mean(M: torch.Tensor, G: int) -> torch.Tensor:
    if G == 1:
        return M
    B, HG, D, mg = M.shape
    return M.reshape(B, HG // G, G, D, mg).permute(0, 1, 3, 2, 4).reshape(B, HG // G, D, G * mg)


def fold_state_cov(P: torch.Tensor) -> torch.Tensor:
    """``P [B, H, G, D, D] -> [B, H*G, D, D]``."""
    B, H, G, D, _ = P.shape
    return P.reshape(B, H * G, D, D)


def unfold_state_cov(P: torch.Tensor, G: int) -> torch.Tensor:
    """``[B, H*G, D, D] -> [B, H, D, D]`` when G = 1 (the public contract), else ``[B, H, G, D, D]``."""
    if G == 1:
        return P
    B, HG, D, _ = P.shape
    return P.reshape(B, HG // G, G, D, D)


def unfold_per_token(x: torch.Tensor, G: int) -> torch.Tensor:
    """``[B, T, H*G] -> [B, T, H, G]`` (per-token, per-group quantities such as the variance)."""
    B, T, HG = x.shape
    return x.reshape(B, T, HG // G, G)
