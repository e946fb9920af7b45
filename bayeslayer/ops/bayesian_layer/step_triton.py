"""``bl_step_triton``: one fused Triton kernel for one decoding step of the Bayesian Layer.

Per (batch, head·group) program, exactly docs/theory.md §2.1 for one token::

    P̄ = A P Aᵀ + ℓ² I,   u = P̄ k,   β = 1 / (r² + kᵀ u)
    M = A M + β u (v − (A M)ᵀ k)ᵀ,   P = P̄ − β u uᵀ
    o = Mᵀ q,   variance = 1 + qᵀ P q

``A`` is identity, ``α I`` or ``diag(α)``; rotations have no kernel (``bayeslayer.ops.bl_step``
runs them on the PyTorch step; this entry point refuses them).
``P`` and ``M`` are read once and written once (BK×BK and BK×BV tiles), so the
step is one pass over the state, which is what bounds decoding speed.
"""

from __future__ import annotations

import torch

from . import groups as grp
from .prepare import prepare
from .triton_support import BackendError, next_pow2, triton_unavailable, unsupported


def step_tiles(D: int, m: int) -> tuple[int, int, int]:
    """``(BD, BK, BV)`` of the step kernel: 32-wide tiles keep the sm_90 build spill-free up to D = 256."""
    BD = max(16, next_pow2(D))
    return BD, min(BD, 32), min(max(16, next_pow2(m)), 32)


def bl_step_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    r2,
    ell2,
    alpha: torch.Tensor | None = None,
    theta: torch.Tensor | None = None,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_variance: bool = False,
):
    """One decoding step on a fused Triton kernel: same contract as :func:`bayeslayer.ops.bl_step`.

    q, k ``[B, H, D]``, v ``[B, H, m]``, r2 ``[B, H]`` / ``[B, H, G]``, ell2 ``[B, H]``,
    alpha None / ``[B, H]`` / ``[B, H, D]``; ``state = (M [B, H, D, m], P [B, H, D, D]
    or [B, H, G, D, D])`` is required and not modified.  Returns ``(o [B, H, m], new_state)``
    or ``(o, variance [B, H, G], new_state)``.  ``theta`` must be None: rotations have no kernel
    (``bayeslayer.ops.bl_step`` runs them on the PyTorch step); this function raises ``ValueError``.
    Not differentiable (decoding); use :func:`bl_chunk_triton` for training.
    """
    if state is None:
        raise ValueError("state is required for bl_step_triton; start from bayeslayer.ops.initial_bl_state()")
    if isinstance(q, torch.Tensor):
        reason = unsupported("step", rotation=theta is not None, head_dim=q.shape[-1] if q.dim() else None,
                             dtype=q.dtype if q.is_floating_point() else None)
        if reason is not None:
            raise ValueError(f"bl_step_triton cannot run this input: {reason}")
        reason = triton_unavailable(q.device)
        if reason is not None:
            raise BackendError(f"bl_step_triton cannot run: {reason}")
    pr = prepare(q, k, v, write="bayes", r2=r2, ell2=ell2, alpha=alpha, initial_state=state, single_step=True)
    dims, G = pr.dims, pr.G
    B, D = dims.B, dims.D
    Hf = pr.q.shape[2]
    mg = dims.m // G
    cd = dims.cdtype
    kind = pr.dyn.kind
    diag = kind == "diagonal"
    has_alpha = kind != "identity"
    la = pr.dyn.log_alpha.reshape(B, Hf, -1).contiguous() if has_alpha else pr.q.new_zeros(1)
    BD, BK, BV = step_tiles(D, mg)
    BMV = max(16, next_pow2(mg))
    P_in = pr.P0.contiguous()
    M_in = pr.M0.contiguous()
    P_out = torch.empty(B, Hf, D, D, dtype=cd, device=dims.device)
    M_out = torch.empty(B, Hf, D, mg, dtype=cd, device=dims.device)
    o = torch.empty(B, Hf, mg, dtype=dims.dtype, device=dims.device)
    var = torch.empty(B, Hf, dtype=cd, device=dims.device)
    Uscr = torch.empty(B, Hf, BD, dtype=cd, device=dims.device)
    from .kernels_triton import bl_step_kernel

    bl_step_kernel[(B * Hf,)](
        pr.q.reshape(B, Hf, D).contiguous(), pr.k.reshape(B, Hf, D).contiguous(),
        pr.v.reshape(B, Hf, mg).contiguous(), pr.r2.reshape(B, Hf).contiguous(),
        pr.ell2.reshape(B, Hf).contiguous(), la, P_in, M_in, P_out, M_out, Uscr, o, var,
        H=Hf, D=D, MV=mg, BD=BD, BK=BK, BMV=BMV, BV=BV, DIAG=diag, HAS_ALPHA=has_alpha, num_warps=4,
    )
    o = grp.unfold_values(o[:, None], G)[:, 0]
    new_state = (grp.unfold_state_mean(M_out, G), grp.unfold_state_cov(P_out, G))
    if return_variance:
        return o, grp.unfold_per_token(var[:, None], G)[:, 0], new_state
    return o, new_state
