"""The transition ``A_t`` of the latent memory, applied one token at a time (docs/theory.md §1.3).

Shared by the recurrent oracle (:mod:`bayeslayer.ops.bayesian_layer.recurrent`), the write models' token scans
(:mod:`bayeslayer.ops.bayesian_layer.write_models`) and the low-rank filter
(:mod:`bayeslayer.ops.bayesian_layer.lowrank`).
"""

from __future__ import annotations

import torch

from ..utils.validation import Dynamics


def apply_transition(X: torch.Tensor, kind: str, log_alpha_t, theta_t) -> torch.Tensor:
    """``A_t X`` for ``X: [B, H, D, n]`` (acts on the key dimension, dim -2).

    ``log_alpha_t``: [B, H, Da]; ``theta_t``: [B, H, D/2] (rotation only).
    """
    if kind == "identity":
        return X
    alpha = torch.exp(log_alpha_t)
    if kind == "scalar":
        return alpha[..., None] * X  # [B,H,1,1]
    if kind == "diagonal":
        return alpha[..., :, None] * X
    # rotation: pair (2c, 2c+1) = (re, im) is multiplied by α e^{iθ}
    re, im = X[..., 0::2, :], X[..., 1::2, :]
    c = torch.cos(theta_t)[..., None]
    s = torch.sin(theta_t)[..., None]
    a = alpha[..., None]  # [B, H, Da, 1], Da = 1 or D/2
    new_re = a * (c * re - s * im)
    new_im = a * (s * re + c * im)
    return torch.stack((new_re, new_im), dim=-2).reshape(X.shape)


def noise_mask(dyn: Dynamics, D: int, dtype, device) -> torch.Tensor:
    """Diagonal of Σ: all ones, or ones on the real (even) channels with rotations (docs/theory.md §1.3)."""
    sig = torch.ones(D, dtype=dtype, device=device)
    if dyn.rotation:
        sig[1::2] = 0
    return sig
