"""The covariance chunk step and its adjoint, in PyTorch (docs/theory.md §5.2, §6.2, §6.5).

One chunk of ``C`` tokens from the covariance ``P`` at its start (leading dims ``[...]`` arbitrary).  With
``K̃ = Φᵀk``, ``B_j`` the process noise accrued in the chunk up to token ``j`` and ``base = S − K̃PK̃ᵀ =
sym(N) + diag(r²)`` (:func:`covariance_prework`, which does not depend on ``P``)::

    Y   = K̃ P,       S = base + Y K̃ᵀ = L_c L_cᵀ     (L = L_c diag(L_c)⁻¹ unit lower, β = 1/diag(L_c)²)
    U   = Φ (L⁻¹ Y) + (L⁻¹ ⊙ ρ)(B K)                (rows u_i = P̄_i k_i, ρ_ij = Φ_iΦ_j⁻¹)
    P_C = sym(Φ_C P Φ_Cᵀ + B_C − Σ_i β_i (Φ_CΦ_i⁻¹ u_i)(Φ_CΦ_i⁻¹ u_i)ᵀ)
    w   = β U,        variance_t = 1 + q̃_tᵀ P q̃_t + q_tᵀ B_t q_t − Σ_{i≤t} β_i (q_tᵀ Φ_tΦ_i⁻¹ u_i)²

:func:`covariance_step` computes it and :func:`covariance_step_adjoint` its vector–Jacobian product.  Every
PyTorch path runs these two: the chunk-serial pass (:func:`bayeslayer.ops.bayesian_layer.chunk.covariance_pass`),
the segment scan's Phase A and C (:mod:`~bayeslayer.ops.bayesian_layer.scan`, and through Phase A the
context-parallel elements of :mod:`~bayeslayer.ops.bayesian_layer.cp`) and the scan's backward
(:mod:`~bayeslayer.ops.bayesian_layer.scan_backward`).  The recurrent filter
(:mod:`~bayeslayer.ops.bayesian_layer.recurrent`) is written separately on purpose: it is the independent
check every path is tested against.

Scalar decay has a fast path, taken when nothing asks for ``L⁻¹``: ``ρ_ij = Γ_i/Γ_j`` is rank one, so
``L⁻¹ ⊙ ρ = (L ⊙ ρ)⁻¹`` and ``U`` is one triangular solve, ``Ū = (L_c ⊙ ρ)⁻¹ (B K + Γ ⊙ Y) = diag(√d)⁻¹ U``;
then ``w = Ū/√d`` and ``β_i u_i u_iᵀ = ū_i ū_iᵀ``.  Its adjoint is written in the same variables.
"""

from __future__ import annotations

import torch

from ..utils.validation import check_shaped
from .dynamics import ChunkDynamics, bmm_add, unit_lower_inverse


def sym(X: torch.Tensor) -> torch.Tensor:
    """``(X + Xᵀ)/2`` over the last two dims: the symmetric part, the only part a covariance (or its adjoint) has."""
    return torch.add(X, X.transpose(-1, -2)).mul_(0.5)


def covariance_prework(dyn: ChunkDynamics, k: torch.Tensor, r2: torch.Tensor, ell2: torch.Tensor):
    """What the covariance step needs that does not depend on ``P``, for any number of chunks at once.

    Returns ``(b, K̃, B k, base, B_C)``: the in-chunk process noise ``b`` (diagonal, None with
    rotations), ``k̃_j = Φ_jᵀ k_j``, ``B_j k_j``, the state-free part of ``S`` (symmetric
    ``N + Nᵀ − diag N + diag r²``) and the noise at the chunk end ``B_C`` (its diagonal
    ``[..., 1, Da]`` without rotations, added to ``P``'s diagonal in the step; dense ``[..., D, D]`` with them).
    """
    b = None if dyn.rot else dyn.noise_diag(ell2)
    kt = dyn.adj(k)  # k̃_j = Φ_jᵀ k_j
    NBk = dyn.noise_vec(ell2, k, b)  # B_j k_j
    Nl = dyn.scores(k, NBk)  # k_iᵀ Φ_iΦ_j⁻¹ B_j k_j, lower incl. diagonal
    base = Nl + Nl.transpose(-1, -2)  # symmetric; its diagonal 2 N_ii becomes N_ii + r²_i below
    base.diagonal(dim1=-2, dim2=-1).add_(r2 - torch.diagonal(Nl, dim1=-2, dim2=-1))
    BC = b[..., -1:, :] if b is not None else dyn.noise_end(ell2, b, k.shape[-1])
    return b, kt, NBk, base, BC


def covariance_step(dyn: ChunkDynamics, kt, NBk, base, BC, P, *, q=None, qt=None, qBq=None, v=None,
                    factors: bool = False, A=None, J=None, save: bool = False) -> dict:
    """One chunk of the covariance pass from ``P`` (module docstring).  Returns a dict.

    ``dyn``: the chunk's :class:`~bayeslayer.ops.bayesian_layer.dynamics.ChunkDynamics`; ``kt``, ``NBk``
    ``[..., C, D]``, ``base`` ``[..., C, C]`` and ``BC`` from :func:`covariance_prework`; ``P`` ``[..., D, D]``.

    Always ``P`` (the chunk's end state, symmetrised), ``W`` (write keys ``βu``) and ``info`` (nonzero where
    the Cholesky factorisation of ``S`` failed).  With ``q``, ``qt = Φᵀq``, ``qBq = qᵀBq``: ``var``, the
    predictive variance.  Off the fast path: also ``U``, ``beta`` and ``Linv``; with ``factors`` or ``v``:
    ``kw = L⁻¹K̃``; with ``v``: ``vu = L⁻¹V``; with ``A``, ``J`` (a segment element, docs/theory.md §6.2):
    ``H = L⁻¹K̃A``, ``A ← Φ_C A − W̃ᵀH`` and ``J ← sym(J + Hᵀ diag(β) H)``.  With ``save``: ``saved``, what
    :func:`covariance_step_adjoint` needs.  Scalar decay without any of ``factors``, ``v``, ``A`` takes the
    fast path (one triangular solve, no ``L⁻¹``).
    """
    Y = kt @ P  # rows (P k̃_j)ᵀ: the one D²C product
    S = bmm_add(base, Y, kt.transpose(-1, -2))
    # LAPACK is column-major: the upper factor of the row-major S is the cheap one, and its
    # transpose is the lower factor L_c already laid out the way the triangular solve wants it.
    Uc, info = torch.linalg.cholesky_ex(S, upper=True)
    Lc = Uc.transpose(-1, -2)
    dc = torch.diagonal(Uc, dim1=-2, dim2=-1)  # sqrt(d_t)
    out = dict(info=info)
    Gq = None
    if dyn.scalar and not factors and v is None and A is None:
        # Σ_j (L⁻¹)_ij (Γ_i/Γ_j) X_j with X_j = Γ_j Y_j + B_j k_j: since L⁻¹ ⊙ R = (L ⊙ R)⁻¹ for the
        # rank-one ratio R_ij = Γ_i/Γ_j, this is one triangular solve (only safe ratios i ≥ j).  Solving
        # with the Cholesky factor L_c = L diag(√d) itself gives Ū = diag(√d)⁻¹ U, so w = βU = Ū/√d
        # and β_t u_t u_tᵀ = ū_t ū_tᵀ: no rescaling to a unit diagonal, and fewer small ops per chunk.
        X = torch.addcmul(NBk, dyn.gamma, Y)
        LR = (Uc * dyn.ratio[..., 0].transpose(-1, -2)).transpose(-1, -2)  # L_c ⊙ R, column-major
        Ub = torch.linalg.solve_triangular(LR, X, upper=False)
        Ue = Ub * dyn.end  # Φ_C Φ_i⁻¹ ū_i
        eye = torch.eye(P.shape[-1], dtype=P.dtype, device=P.device)
        P_next = bmm_add(torch.addcmul(eye * BC, P, dyn.gamma_C * dyn.gamma_C), Ue.transpose(-1, -2), Ue, alpha=-1.0)
        if q is not None:
            Gq = dyn.scores(q, Ub)
            out["var"] = 1.0 + ((qt @ P) * qt).sum(-1) + qBq - (Gq * Gq).sum(-1)
        out["W"] = Ub / dc[..., None]
        if save:
            out["saved"] = dict(P=P, Y=Y, Lc=Lc, Ub=Ub, Gq=Gq)
    else:
        beta = 1.0 / (dc * dc)
        Linv = unit_lower_inverse(Lc / dc[..., None, :])  # L = L_c diag(√d)⁻¹ is unit lower
        Z = Linv @ Y
        U = dyn.fwd(Z) + dyn.mix(Linv, NBk)
        Ue = dyn.to_end(U)
        P_next = dyn.end_rows(dyn.end_rows(P).transpose(-1, -2))
        P_next = P_next + (BC if dyn.rot else torch.diag_embed(BC[..., 0, :].expand(*P.shape[:-1])))
        P_next = P_next - (Ue.transpose(-1, -2) * beta[..., None, :]) @ Ue
        if q is not None:
            Gq = dyn.scores(q, U)  # q_tᵀ Φ_tΦ_i⁻¹ u_i
            out["var"] = 1.0 + ((qt @ P) * qt).sum(-1) + qBq - (Gq * Gq * beta[..., None, :]).sum(-1)
        W = beta[..., None] * U
        out.update(W=W, U=U, beta=beta, Linv=Linv)
        if factors or v is not None:
            out["kw"] = Linv @ kt
        if v is not None:
            out["vu"] = Linv @ v
        if A is not None:
            Hm = Linv @ (kt @ A)
            out["A"] = dyn.end_rows(A) - dyn.to_end(W).transpose(-1, -2) @ Hm
            out["J"] = sym(J + (Hm.transpose(-1, -2) * beta[..., None, :]) @ Hm)
        if save:
            out["saved"] = dict(P=P, Y=Y, Lc=Lc, dc=dc, beta=beta, Linv=Linv, Z=Z, U=U, Ue=Ue, Gq=Gq)
    # symmetrise every chunk: P's value and the gradients it passes back then do not depend on
    # how the sequence is split into blocks (the Triton backward recomputes block by block)
    out["P"] = sym(P_next)
    return out


def cholesky_adjoint(L: torch.Tensor, dL: torch.Tensor) -> torch.Tensor:
    """The adjoint ``S̄`` of ``S = L Lᵀ`` given ``L̄`` (Murray 2016): ``sym(L⁻ᵀ Φ(Lᵀ L̄) L⁻¹)``, ``Φ`` the lower
    triangle with half its diagonal (batched over the leading dims)."""
    Phi = (L.transpose(-1, -2) @ dL).tril()
    Phi = Phi - 0.5 * torch.diag_embed(torch.diagonal(Phi, dim1=-2, dim2=-1))
    Sb = torch.linalg.solve_triangular(L.transpose(-1, -2), Phi, upper=True)
    return sym(torch.linalg.solve_triangular(L, Sb, upper=False, left=False))


#: the keys of :func:`covariance_step_adjoint`'s gradients: the step's inputs other than ``P``
STEP_GRAD_NAMES = ("kt", "NBk", "base", "BC", "ratio", "gamma", "end", "gamma_C", "qt", "qBq")


def covariance_step_adjoint(dyn: ChunkDynamics, kt, NBk, saved: dict, dP_next, *, q=None, qt=None, v=None,
                            dW=None, dbeta=None, dLinv=None, dvar=None, dkw=None, dvu=None):
    """The adjoint of :func:`covariance_step` (no autograd): its vector–Jacobian product, in plain tensor algebra.

    ``dyn``, ``kt``, ``NBk``, ``q``, ``qt``, ``v``: as the forward was called; ``saved``: the forward's
    ``saved`` (``save=True``), which also says which path it took.  ``dP_next``: the adjoint of the end state;
    ``dW``, ``dbeta``, ``dLinv``, ``dvar``, ``dkw``, ``dvu``: of the outputs ``W``, ``beta``, ``Linv``,
    ``var`` (needs ``q``, ``qt``), ``kw``, ``vu`` (needs ``v``); any may be None (zero).  The fast path has
    no ``beta``, ``Linv``, ``kw``, ``vu``; the general path takes per-channel factors (identity, scalar
    and diagonal decay as diagonal dynamics with ``D`` channels; no rotations).

    Returns ``(dP, grads, dq, dv)``: the adjoint of the start state (not symmetrised), a dict of the
    adjoints of the other inputs keyed by :data:`STEP_GRAD_NAMES` (the factors of ``dyn`` shaped as they
    are; ``ratio``: only its lower triangle is read; ``base``: symmetrised; ``qt``, ``qBq`` only with
    ``dvar``), the adjoint of ``q`` through the scores ``q_tᵀΦ_tΦ_i⁻¹u_i`` (None without ``dvar``) and
    of ``v`` (None without ``dvu``).
    """
    if not isinstance(saved, dict) or not {"P", "Y", "Lc"} <= saved.keys():
        raise ValueError(f"saved must be covariance_step's saved dict (save=True), got {type(saved).__name__}")
    P = saved["P"]
    check_shaped("dP_next", dP_next, P.shape)
    if dvar is not None and (q is None or qt is None):
        raise ValueError("covariance_step_adjoint: dvar needs q and qt")
    if dvu is not None and v is None:
        raise ValueError("covariance_step_adjoint: dvu needs v")
    if "Ub" in saved:
        if any(x is not None for x in (dbeta, dLinv, dkw, dvu)):
            raise ValueError("covariance_step_adjoint: the scalar fast path has no beta, Linv, kw or vu to take an "
                             "adjoint of (run the forward with factors=True)")
        return _fast_adjoint(dyn, kt, saved, dP_next, q, qt, dW, dvar)
    if dyn.rot or dyn.ratio.shape[-1] != kt.shape[-1]:
        raise ValueError("covariance_step_adjoint: the general path takes per-channel real factors (dyn built from "
                         f"log_alpha with D={kt.shape[-1]} channels, no rotations), got {tuple(dyn.ratio.shape)}")
    return _general_adjoint(dyn, kt, NBk, saved, dP_next, q, qt, v, dW, dbeta, dLinv, dvar, dkw, dvu)


def _fast_adjoint(dyn: ChunkDynamics, kt, saved: dict, dP_next, q, qt, dW, dvar):
    """The scalar fast path's adjoint, in its variables ``Ū = (L_c ⊙ R)⁻¹(B K + Γ ⊙ Y)``, ``w = Ū/√d``."""
    P, Y, Lc, Ub = (saved[n] for n in ("P", "Y", "Lc", "Ub"))
    ratio, end, gamma_C = dyn.ratio[..., 0], dyn.end, dyn.gamma_C
    dc = torch.diagonal(Lc, dim1=-2, dim2=-1)
    g = {}
    Gs = sym(dP_next)  # P' = sym(Pn)
    Ue = Ub * end
    dUe = -2.0 * Ue @ Gs  # Pn ∋ −UeᵀUe, Gs symmetric
    dUb = end * dUe
    g["end"] = (dUe * Ub).sum(-1, keepdim=True)
    ddc = torch.zeros_like(dc)
    if dW is not None:
        check_shaped("dW", dW, Ub.shape)
        dUb = dUb + dW / dc[..., None]
        ddc = -(dW * Ub).sum(-1) / (dc * dc)
    g["gamma_C"] = 2.0 * gamma_C * (Gs * P).sum((-1, -2), keepdim=True)
    g["BC"] = torch.diagonal(Gs, dim1=-2, dim2=-1).sum(-1)[..., None, None]
    dP = gamma_C * gamma_C * Gs
    dratio = torch.zeros_like(ratio)
    dq = None
    if dvar is not None:  # var = 1 + q̃ᵀPq̃ + qBq − Σ_i Gq_ti²,  Gq = (q Ūᵀ) ⊙ R
        dP = dP + (qt.transpose(-1, -2) * dvar[..., None, :]) @ qt
        g["qt"] = dvar[..., None] * (qt @ (P + P.transpose(-1, -2)))
        g["qBq"] = dvar
        dGq = -2.0 * dvar[..., :, None] * saved["Gq"]
        dGR = dGq * ratio
        dq = dGR @ Ub
        dUb = dUb + dGR.transpose(-1, -2) @ q
        dratio = dGq * (q @ Ub.transpose(-1, -2))
    LR = Lc * ratio
    dX = torch.linalg.solve_triangular(LR.transpose(-1, -2), dUb, upper=True)  # Ū = LR⁻¹X
    dLR = -(dX @ Ub.transpose(-1, -2)).tril()
    dLc = dLR * ratio + torch.diag_embed(ddc)
    g["ratio"] = (dratio + dLR * Lc)[..., None]
    g["NBk"] = dX
    g["gamma"] = (dX * Y).sum(-1, keepdim=True)
    dY = dyn.gamma * dX
    Sb = cholesky_adjoint(Lc, dLc)
    g["base"] = Sb
    dY = dY + Sb @ kt
    g["kt"] = Sb @ Y + dY @ P.transpose(-1, -2)
    return dP + kt.transpose(-1, -2) @ dY, g, dq, None


def _general_adjoint(dyn: ChunkDynamics, kt, NBk, saved: dict, dP_next, q, qt, v, dW, dbeta, dLinv, dvar, dkw, dvu):
    """The general path's adjoint, in the LDLᵀ factors (per-channel decay ``ρ`` ``[..., C, C, D]``)."""
    P, Y, Lc, dc, beta, Linv, Z, U, Ue = (saved[n] for n in ("P", "Y", "Lc", "dc", "beta", "Linv", "Z", "U", "Ue"))
    ratio, gamma, end = dyn.ratio, dyn.gamma, dyn.end
    gC = dyn.gamma_C[..., 0, :]
    Gs = sym(dP_next)
    g = {}
    # P' = sym(Φ_C Pᵀ Φ_C + diag b_C − Ueᵀ diag(β) Ue)
    dP = (gC[..., :, None] * Gs * gC[..., None, :]).transpose(-1, -2)
    GP = Gs * P.transpose(-1, -2)
    g["gamma_C"] = ((GP * gC[..., None, :]).sum(-1) + (GP * gC[..., :, None]).sum(-2))[..., None, :]
    g["BC"] = torch.diagonal(Gs, dim1=-2, dim2=-1)[..., None, :].clone()
    UeG = Ue @ Gs
    dUe = -2.0 * beta[..., None] * UeG
    db = -(UeG * Ue).sum(-1)
    if dbeta is not None:
        db = db + dbeta
    g["end"] = dUe * U
    dU = end * dUe
    if dW is not None:
        dU = dU + beta[..., None] * dW
        db = db + (dW * U).sum(-1)
    dq = None
    if dvar is not None:
        Gq = saved["Gq"]
        dP = dP + (qt.transpose(-1, -2) * dvar[..., None, :]) @ qt
        g["qt"] = dvar[..., None] * (qt @ (P + P.transpose(-1, -2)))
        g["qBq"] = dvar
        dGq = -2.0 * dvar[..., :, None] * beta[..., None, :] * Gq
        db = db - (dvar[..., :, None] * Gq * Gq).sum(-2)
        dq = torch.einsum("...ti,...tid,...id->...td", dGq, ratio, U)
        dU = dU + torch.einsum("...ti,...tid,...td->...id", dGq, ratio, q)
        dratio = dGq[..., None] * q[..., :, None, :] * U[..., None, :, :]
    else:
        dratio = torch.zeros_like(ratio)
    # U = γ ⊙ Z + mix(L⁻¹, B k),  Z = L⁻¹ Y
    g["gamma"] = dU * Z
    dZ = gamma * dU
    dLi = torch.einsum("...id,...ijd,...jd->...ij", dU, ratio, NBk) + dZ @ Y.transpose(-1, -2)
    g["NBk"] = torch.einsum("...ij,...ijd,...id->...jd", Linv, ratio, dU)
    g["ratio"] = dratio + dU[..., :, None, :] * Linv[..., None] * NBk[..., None, :, :]
    dY = Linv.transpose(-1, -2) @ dZ
    dkt = torch.zeros_like(kt)
    if dLinv is not None:
        dLi = dLi + dLinv
    if dkw is not None:
        dLi = dLi + dkw @ kt.transpose(-1, -2)
        dkt = dkt + Linv.transpose(-1, -2) @ dkw
    dv = None
    if dvu is not None:
        dLi = dLi + dvu @ v.transpose(-1, -2)
        dv = Linv.transpose(-1, -2) @ dvu
    # L⁻¹ = Lu⁻¹ with Lu = Lc diag(dc)⁻¹ unit lower: dLu = −L⁻ᵀ dL⁻¹ L⁻ᵀ (strictly lower part)
    LiT = Linv.transpose(-1, -2)
    dLu = -(LiT @ dLi @ LiT).tril(-1)
    dLc = dLu / dc[..., None, :]
    ddc = -(dLu * Lc).sum(-2) / (dc * dc) - 2.0 * db / (dc * dc * dc)
    dLc = dLc + torch.diag_embed(ddc)
    Sb = cholesky_adjoint(Lc, dLc)
    g["base"] = Sb
    # S = base + Y K̃ᵀ,  Y = K̃ P
    dY = dY + Sb @ kt
    g["kt"] = dkt + Sb @ Y + dY @ P.transpose(-1, -2)
    dP = dP + kt.transpose(-1, -2) @ dY
    return dP, g, dq, dv
