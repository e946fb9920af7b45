"""The covariance pass's backward through the segment scan, as an explicit plain-PyTorch twin (no autograd).

docs/theory.md §6.5 (the backward through the scan) and §6.7 (kernels B2–B4).  The forward
is :func:`bayeslayer.ops.bayesian_layer.scan.covariance_scan`; this module computes the vector–Jacobian product of
its outputs (``w``, ``beta``, ``linv``, ``variance``, ``kw``, ``vu``, ``g`` and the final ``P``) with
respect to its inputs (``q``, ``k``, ``v``, ``r2``, ``ell2``, ``log_alpha``, ``P0``) in plain tensor
algebra, so that the Triton kernels can be ported from it and tested against it::

    B2  parallel over segments:  replay each segment's chunks from its checkpoint P_s and run the
                                  per-chunk adjoint with a zero incoming adjoint at the segment end
                                  (the last segment of a sequence: the final state's adjoint)
                                  → G_s, the local adjoint of P_s
    B3  serial over segments:     P̄_s = Ā_sᵀ P̄_{s+1} Ā_s + G_s,   Ā_s = A_s (I + P_s J_s)⁻¹
    B4  parallel over segments:  replay + the per-chunk adjoint with incoming P̄_{s+1} at the
                                  segment end → the gradients of every input of the pass

``Ā_s`` is the derivative of the segment map ``P ↦ A (I + PJ)⁻¹ P Aᵀ + C``
(:func:`bayeslayer.ops.bayesian_layer.scan.apply_element`): ``dP_{s+1} = Ā dP Āᵀ``.  It is computed from the
factors Phase B already forms (``G = chol(P_s)``, ``M = I + GᵀJG``): ``Ā = A − (AG) M⁻¹ GᵀJ``
(Woodbury), :func:`element_transition`.  Because the chunks replayed from ``P_s`` end exactly at
``P_{s+1}``, the gradients of ``k, r², ℓ², α`` through the segment elements ``(A_s, C_s, J_s)`` are
the gradients through the replayed chunks: B4 needs no adjoint of Phase A.

Per chunk (:func:`chunk_replay`, :func:`chunk_adjoint`) every decay is handled as a diagonal one:
scalar decay is the diagonal decay with all channels equal, and its gradient is the channel sum
(exact).  The prep (the P-free terms of a chunk, :func:`chunk_terms`) has its own adjoint
(:func:`terms_adjoint`: kernel B5's twin).  Gradients of a symmetric matrix (P0, the P_s) are
returned symmetrised: only that part is defined by a function of a covariance.

Not here: rotations (the scan refuses them); the adjoint of :func:`bayeslayer.ops.bayesian_layer.prepare.prepare`
(α → log α, group folding, ``P0 = p0·I``); the mean pass (B1); ``ScanOutput.P_starts`` are
checkpoints and take no adjoint.  The twin keeps a ``[C, C, D]`` ratio per chunk even for scalar
decay and Phase A's elements are recomputed unless passed in (``elements=``).

:func:`chunk_adjoint_scalar` (and its sweep :func:`covariance_pass_adjoint_scalar`) is the same
per-chunk adjoint in the variables of the scalar-decay loop of
:func:`bayeslayer.ops.bayesian_layer.chunk.covariance_pass` (``Ū = (L_c ⊙ R)⁻¹ X``, no ``L⁻¹``), the form a
scalar-decay kernel would specialise to (``tests/ops/test_covariance_adjoint.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..utils.validation import check_shaped
from . import scan
from .chunk import unit_lower_inverse


def _sym(X: torch.Tensor) -> torch.Tensor:
    return 0.5 * (X + X.transpose(-1, -2))


def cholesky_adjoint(L: torch.Tensor, dL: torch.Tensor) -> torch.Tensor:
    """The adjoint ``S̄`` of ``S = L Lᵀ`` given ``L̄`` (Murray 2016): ``sym(L⁻ᵀ Φ(Lᵀ L̄) L⁻¹)``, ``Φ`` the lower
    triangle with half its diagonal (batched over the leading dims)."""
    Phi = (L.transpose(-1, -2) @ dL).tril()
    Phi = Phi - 0.5 * torch.diag_embed(torch.diagonal(Phi, dim1=-2, dim2=-1))
    Sb = torch.linalg.solve_triangular(L.transpose(-1, -2), Phi, upper=True)
    return _sym(torch.linalg.solve_triangular(L, Sb, upper=False, left=False))


# ---------------------------------------------------------------------------------------------------
# per-chunk terms (the prep, kernel F1) and their adjoint (kernel B5)
# ---------------------------------------------------------------------------------------------------

def chunk_terms(k, r2, ell2, log_alpha, q=None) -> dict:
    """The P-free terms of a chunk, every decay as a diagonal one (leading dims ``[...]`` arbitrary).

    k ``[..., C, D]``, r2/ell2 ``[..., C]``, log_alpha ``[..., C, Da]`` (Da = 1 or D), q ``[..., C, D]``
    or None.  Returns a dict: ``gamma = Φ_i`` ``[..., C, D]``, ``ratio = Φ_iΦ_j⁻¹`` (``i ≥ j``, else 0)
    ``[..., C, C, D]``, ``end = Φ_CΦ_i⁻¹``, ``gC = Φ_C`` ``[..., D]``, ``b`` (diag of B_j), ``kt = Φᵀk``,
    ``NBk = B k``, ``base = N + Nᵀ − diag N + diag r²`` ``[..., C, C]``, ``bC = diag B_C`` ``[..., D]``
    and, with q, ``qt = Φᵀq`` and ``qBq``.  Same values as :func:`bayeslayer.ops.bayesian_layer.scan.chunk_prep`.
    """
    if not isinstance(k, torch.Tensor) or k.dim() < 2:
        raise ValueError(f"k must be a [..., C, D] tensor, got {getattr(k, 'shape', type(k).__name__)}")
    C, D = k.shape[-2:]
    check_shaped("r2", r2, k.shape[:-1])
    check_shaped("ell2", ell2, k.shape[:-1])
    if not isinstance(log_alpha, torch.Tensor) or log_alpha.shape[:-1] != k.shape[:-1] or \
            log_alpha.shape[-1] not in (1, D):
        raise ValueError(f"log_alpha must be [..., C, 1] or [..., C, D] with k {tuple(k.shape)}, got "
                         f"{getattr(log_alpha, 'shape', type(log_alpha).__name__)}")
    if q is not None:
        check_shaped("q", q, k.shape)
    g = torch.cumsum(log_alpha.expand(k.shape), -2)
    mask = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    diff = g[..., :, None, :] - g[..., None, :, :]
    ratio = diff.masked_fill(~mask[..., None], float("-inf")).exp()
    end = torch.exp(g[..., -1:, :] - g)
    gamma = torch.exp(g)
    b = torch.einsum("...jld,...l->...jd", ratio * ratio, ell2)
    NBk = b * k
    Nl = torch.einsum("...id,...ijd,...jd->...ij", k, ratio, NBk)
    base = Nl + Nl.transpose(-1, -2)
    base = base + torch.diag_embed(r2 - torch.diagonal(Nl, dim1=-2, dim2=-1))
    out = dict(gamma=gamma, ratio=ratio, end=end, gC=gamma[..., -1, :], b=b, kt=gamma * k, NBk=NBk, base=base,
               bC=b[..., -1, :])
    if q is not None:
        out["qt"] = gamma * q
        out["qBq"] = (b * q * q).sum(-1)
    return out


def terms_adjoint(k, r2, ell2, log_alpha, terms: dict, d: dict, q=None, dg=None):
    """Adjoint of :func:`chunk_terms`: ``(dk, dr2, dell2, dlog_alpha, dq)`` from the terms' adjoints ``d``.

    ``d`` holds any of ``gamma, ratio, end, gC, kt, NBk, base, bC, qt, qBq`` (missing: zero);
    ``dg``: adjoint of the chunk-local cumulative log-decay ``g`` (what the forward hands the mean
    pass), ``[..., C, Da]`` or None.  ``dq`` is None without q.  ``dlog_alpha`` has log_alpha's shape.
    """
    check_shaped("k", k, terms["kt"].shape)
    z = torch.zeros_like
    gamma, ratio, end, b = terms["gamma"], terms["ratio"], terms["end"], terms["b"]
    NBk = terms["NBk"]
    dbase = d.get("base", z(terms["base"]))
    dr2 = torch.diagonal(dbase, dim1=-2, dim2=-1).clone()
    dNl = dbase + dbase.transpose(-1, -2) - torch.diag_embed(torch.diagonal(dbase, dim1=-2, dim2=-1))
    dkt = d.get("kt", z(k))
    dNBk = d.get("NBk", z(k)) + torch.einsum("...ij,...ijd,...id->...jd", dNl, ratio, k)
    dratio = d.get("ratio", z(ratio)) + dNl[..., None] * k[..., :, None, :] * NBk[..., None, :, :]
    dk = gamma * dkt + b * dNBk + torch.einsum("...ij,...ijd,...jd->...id", dNl, ratio, NBk)
    db = dNBk * k
    db[..., -1, :] += d.get("bC", z(terms["bC"]))
    dgamma = d.get("gamma", z(gamma)) + dkt * k
    dq = None
    if q is not None:
        dqBq = d.get("qBq", z(terms["qBq"]))
        dqt = d.get("qt", z(q))
        db = db + dqBq[..., None] * q * q
        dq = gamma * dqt + 2.0 * dqBq[..., None] * b * q
        dgamma = dgamma + dqt * q
    dell2 = torch.einsum("...jd,...jld->...l", db, ratio * ratio)
    dratio = dratio + 2.0 * db[..., :, None, :] * ratio * ell2[..., None, :, None]
    # every term is an exponential of differences of g: collect dL/dg, then reverse the cumsum
    dG = dgamma * gamma
    dG[..., -1, :] += d.get("gC", z(terms["gC"])) * terms["gC"]
    te = d.get("end", z(end)) * end
    dG = dG - te
    dG[..., -1, :] += te.sum(-2)
    tr = dratio * ratio
    dG = dG + tr.sum(-2) - tr.sum(-3)
    if log_alpha.shape[-1] == 1:  # scalar decay: every channel's g is the same g
        dG = dG.sum(-1, keepdim=True)
    if dg is not None:
        check_shaped("dg", dg, log_alpha.shape)
        dG = dG + dg
    dla = torch.flip(torch.cumsum(torch.flip(dG, (-2,)), -2), (-2,))
    return dk, dr2, dell2, dla, dq


# ---------------------------------------------------------------------------------------------------
# one chunk: replay and adjoint
# ---------------------------------------------------------------------------------------------------

def chunk_replay(terms: dict, P: torch.Tensor, q=None) -> dict:
    """One chunk from ``P`` (as :func:`bayeslayer.ops.bayesian_layer.scan.chunk_step`), keeping what the adjoint needs.

    ``terms`` from :func:`chunk_terms` (leading dims ``[...]``), P ``[..., D, D]``, q ``[..., C, D]``
    (for the variance) or None.  Returns a dict with ``P`` (the start), ``Y = K̃P``, ``Lc`` (Cholesky
    factor of S), ``dc = diag Lc``, ``beta``, ``Linv``, ``Z = L⁻¹Y``, ``U``, ``Ue = Φ_CΦ_i⁻¹u_i``,
    ``W = βU``, ``P_next`` (symmetrised), ``info`` and with q ``Gq`` and ``var``.
    """
    kt = terms["kt"]
    check_shaped("P", P, (*kt.shape[:-2], kt.shape[-1], kt.shape[-1]))
    Y = kt @ P
    S = terms["base"] + Y @ kt.transpose(-1, -2)
    Lc, info = torch.linalg.cholesky_ex(S)
    dc = torch.diagonal(Lc, dim1=-2, dim2=-1)
    beta = 1.0 / (dc * dc)
    Linv = unit_lower_inverse(Lc / dc[..., None, :])
    Z = Linv @ Y
    ratio = terms["ratio"]
    U = terms["gamma"] * Z + torch.einsum("...ij,...ijd,...jd->...id", Linv, ratio, terms["NBk"])
    Ue = terms["end"] * U
    gC = terms["gC"]
    Pn = gC[..., :, None] * P.transpose(-1, -2) * gC[..., None, :] + torch.diag_embed(terms["bC"])
    Pn = Pn - (Ue.transpose(-1, -2) * beta[..., None, :]) @ Ue
    out = dict(P=P, Y=Y, Lc=Lc, dc=dc, beta=beta, Linv=Linv, Z=Z, U=U, Ue=Ue, W=beta[..., None] * U,
               P_next=_sym(Pn), info=info)
    if q is not None:
        qt = terms["qt"]
        Gq = torch.einsum("...id,...ijd,...jd->...ij", q, ratio, U)
        out["Gq"] = Gq
        out["var"] = 1.0 + ((qt @ P) * qt).sum(-1) + terms["qBq"] - (Gq * Gq * beta[..., None, :]).sum(-1)
    return out


def chunk_adjoint(terms: dict, saved: dict, dP_next: torch.Tensor, *, q=None, v=None, dW=None, dbeta=None,
                  dLinv=None, dvar=None, dkw=None, dvu=None):
    """Adjoint of one chunk (:func:`chunk_replay`), no autograd.

    ``dP_next``: adjoint of the chunk's end state ``[..., D, D]``; ``dW``, ``dbeta``, ``dLinv``,
    ``dvar``: adjoints of its outputs ``W = βU``, ``β``, ``L⁻¹``, the variance (needs q); ``dkw``,
    ``dvu``: adjoints of ``kw = L⁻¹K̃`` and ``vu = L⁻¹V`` (``dvu`` needs v).  Any may be None (zero).
    Returns ``(dP, dterms, dq_direct, dv)``: the adjoint of the start state (not symmetrised), of the
    chunk terms (a dict for :func:`terms_adjoint`), of q through the scores ``q_tᵀΦ_tΦ_i⁻¹u_i`` (None
    without dvar) and of v (None without dvu).
    """
    check_shaped("dP_next", dP_next, saved["P"].shape)
    P, Y, Lc, dc, beta, Linv, Z, U, Ue = (saved[n] for n in ("P", "Y", "Lc", "dc", "beta", "Linv", "Z", "U", "Ue"))
    kt, ratio, gamma, gC = terms["kt"], terms["ratio"], terms["gamma"], terms["gC"]
    Gs = _sym(dP_next)
    dt = {}
    # P' = sym(Φ_C Pᵀ Φ_C + diag b_C − Ueᵀ diag(β) Ue)
    dP = (gC[..., :, None] * Gs * gC[..., None, :]).transpose(-1, -2)
    dt["gC"] = ((Gs * P.transpose(-1, -2)) * gC[..., None, :]).sum(-1) + ((Gs * P.transpose(-1, -2)) *
                                                                        gC[..., :, None]).sum(-2)
    dt["bC"] = torch.diagonal(Gs, dim1=-2, dim2=-1).clone()
    UeG = Ue @ Gs
    dUe = -2.0 * beta[..., None] * UeG
    db = -(UeG * Ue).sum(-1)
    if dbeta is not None:
        db = db + dbeta
    dt["end"] = dUe * U
    dU = terms["end"] * dUe
    if dW is not None:
        dU = dU + beta[..., None] * dW
        db = db + (dW * U).sum(-1)
    dq = None
    if dvar is not None:
        if q is None:
            raise ValueError("chunk_adjoint: dvar needs q")
        qt, Gq = terms["qt"], saved["Gq"]
        dP = dP + (qt.transpose(-1, -2) * dvar[..., None, :]) @ qt
        dt["qt"] = dvar[..., None] * (qt @ (P + P.transpose(-1, -2)))
        dt["qBq"] = dvar
        dGq = -2.0 * dvar[..., :, None] * beta[..., None, :] * Gq
        db = db - (dvar[..., :, None] * Gq * Gq).sum(-2)
        dq = torch.einsum("...ti,...tid,...id->...td", dGq, ratio, U)
        dU = dU + torch.einsum("...ti,...tid,...td->...id", dGq, ratio, q)
        dratio = dGq[..., None] * q[..., :, None, :] * U[..., None, :, :]
    else:
        dratio = torch.zeros_like(ratio)
    # U = γ ⊙ Z + mix(L⁻¹, B k),  Z = L⁻¹ Y
    NBk = terms["NBk"]
    dt["gamma"] = dU * Z
    dZ = gamma * dU
    dLi = torch.einsum("...id,...ijd,...jd->...ij", dU, ratio, NBk) + dZ @ Y.transpose(-1, -2)
    dt["NBk"] = torch.einsum("...ij,...ijd,...id->...jd", Linv, ratio, dU)
    dt["ratio"] = dratio + dU[..., :, None, :] * Linv[..., None] * NBk[..., None, :, :]
    dY = Linv.transpose(-1, -2) @ dZ
    dkt = torch.zeros_like(kt)
    if dLinv is not None:
        dLi = dLi + dLinv
    if dkw is not None:
        dLi = dLi + dkw @ kt.transpose(-1, -2)
        dkt = dkt + Linv.transpose(-1, -2) @ dkw
    dv = None
    if dvu is not None:
        if v is None:
            raise ValueError("chunk_adjoint: dvu needs v")
        dLi = dLi + dvu @ v.transpose(-1, -2)
        dv = Linv.transpose(-1, -2) @ dvu
    # L⁻¹ = Lu⁻¹ with Lu = Lc diag(dc)⁻¹ unit lower: dLu = −L⁻ᵀ dL⁻¹ L⁻ᵀ (strictly lower part)
    LiT = Linv.transpose(-1, -2)
    dLu = -(LiT @ dLi @ LiT).tril(-1)
    dLc = dLu / dc[..., None, :]
    ddc = -(dLu * Lc).sum(-2) / (dc * dc) - 2.0 * db / (dc * dc * dc)
    dLc = dLc + torch.diag_embed(ddc)
    Sb = cholesky_adjoint(Lc, dLc)
    dt["base"] = Sb
    # S = base + Y K̃ᵀ,  Y = K̃ P
    dY = dY + Sb @ kt
    dt["kt"] = dkt + Sb @ Y + dY @ P.transpose(-1, -2)
    dP = dP + kt.transpose(-1, -2) @ dY
    return dP, dt, dq, dv


# ---------------------------------------------------------------------------------------------------
# the segment map's derivative (B3's transition)
# ---------------------------------------------------------------------------------------------------

def element_transition(A: torch.Tensor, J: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """``Ā = A (I + P J)⁻¹``, the derivative of the segment map: ``dP_{s+1} = Ā dP_s Āᵀ``.

    In the factors of :func:`bayeslayer.ops.bayesian_layer.scan.apply_element`: ``G = chol(P)``, ``M = I + GᵀJG``
    (eigenvalues ≥ 1), ``Ā = A − (AG) M⁻¹ GᵀJ``.  All ``[..., D, D]``; P, J symmetric, P positive
    definite.  The adjoint of the map is ``P̄_s = Āᵀ P̄_{s+1} Ā``.
    """
    if not isinstance(A, torch.Tensor) or A.dim() < 2 or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"A must be a [..., D, D] tensor, got {getattr(A, 'shape', type(A).__name__)}")
    check_shaped("J", J, A.shape)
    check_shaped("P", P, A.shape)
    G = torch.linalg.cholesky(P)
    eye = torch.eye(P.shape[-1], dtype=P.dtype, device=P.device)
    GtJ = G.transpose(-1, -2) @ J
    R = torch.linalg.cholesky(_sym(eye + GtJ @ G))
    return A - (A @ G) @ torch.cholesky_solve(GtJ, R)


# ---------------------------------------------------------------------------------------------------
# B2 / B4: replay a segment and run its adjoint; B3: the reverse pass over segments
# ---------------------------------------------------------------------------------------------------

GRAD_NAMES = ("w", "beta", "linv", "variance", "kw", "vu", "g")


class ScanGrads(NamedTuple):
    """Gradients of the covariance scan's inputs (packed ``[NT, H', ...]`` like the inputs; ``P0`` ``[N, H', D, D]``).

    ``q`` is zero without a variance adjoint, ``v`` zero without a ``vu`` adjoint.  ``P0`` symmetrised.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    r2: torch.Tensor
    ell2: torch.Tensor
    log_alpha: torch.Tensor
    P0: torch.Tensor


def segment_adjoint(lay: scan.ScanLayout, xs: dict, dxs: dict, P_starts: torch.Tensor, P_end_bar: torch.Tensor,
                    *, inputs: bool):
    """Replay every segment from its checkpoint and run the adjoint back to its start (B2 and B4).

    ``xs``: the inputs in the layout's grid ``[n_s, S, H', C, ...]`` (keys q, k, v, r2, ell2, la; q and
    v may be None); ``dxs``: the output adjoints in the same grid (keys of :data:`GRAD_NAMES`, None
    for none); ``P_starts``, ``P_end_bar`` ``[S, H', D, D]``: each segment's start state and the
    adjoint arriving at its end.  All segments run together: one :func:`chunk_replay` and one
    :func:`chunk_adjoint` call per chunk position, however many segments.  Returns ``(dP_start,
    grads)``: the adjoint of each segment's start state (symmetrised) and, with ``inputs``, a dict of
    the input gradients in the grid (``q, k, v, r2, ell2, la``), else None (B2 needs only dP_start).
    """
    if not isinstance(lay, scan.ScanLayout):
        raise TypeError(f"lay must be a ScanLayout, got {type(lay).__name__}")
    kshape = xs["k"].shape
    S, Hf, D = lay.n_segments, kshape[2], kshape[-1]
    check_shaped("P_starts", P_starts, (S, Hf, D, D))
    check_shaped("P_end_bar", P_end_bar, (S, Hf, D, D))
    want_q = dxs.get("variance") is not None
    saved, terms = [], []
    P = P_starts
    for j in range(lay.n_s):  # replay (forward), keeping each chunk's saved state
        t = chunk_terms(xs["k"][j], xs["r2"][j], xs["ell2"][j], xs["la"][j], q=xs["q"][j] if want_q else None)
        sv = chunk_replay(t, P, q=xs["q"][j] if want_q else None)
        saved.append(sv)
        terms.append(t)
        P = sv["P_next"]
    grads = {name: [None] * lay.n_s for name in ("q", "k", "v", "r2", "ell2", "la")} if inputs else None
    Pbar = P_end_bar
    for j in range(lay.n_s - 1, -1, -1):
        dj = {name: (x[j] if x is not None else None) for name, x in dxs.items()}
        Pbar, dt, dq, dv = chunk_adjoint(
            terms[j], saved[j], Pbar, q=xs["q"][j] if want_q else None,
            v=xs["v"][j] if dj.get("vu") is not None else None, dW=dj.get("w"), dbeta=dj.get("beta"),
            dLinv=dj.get("linv"), dvar=dj.get("variance"), dkw=dj.get("kw"), dvu=dj.get("vu"))
        if inputs:
            dk, dr2, dell2, dla, dq2 = terms_adjoint(xs["k"][j], xs["r2"][j], xs["ell2"][j], xs["la"][j], terms[j],
                                                     dt, q=xs["q"][j] if want_q else None, dg=dj.get("g"))
            grads["k"][j], grads["r2"][j], grads["ell2"][j], grads["la"][j] = dk, dr2, dell2, dla
            grads["q"][j] = dq + dq2 if want_q else torch.zeros_like(xs["k"][j])
            grads["v"][j] = dv
    if inputs:
        grads = {name: (torch.stack(x) if x[0] is not None else None) for name, x in grads.items()}
    return _sym(Pbar), grads


def reverse_segments(lay: scan.ScanLayout, G: torch.Tensor, Abar: torch.Tensor) -> torch.Tensor:
    """B3: ``P̄_s = Ā_sᵀ P̄_{s+1} Ā_s + G_s`` backwards over each sequence's segments.

    ``G`` ``[S, H', D, D]``: the local adjoints from B2 (the last segment of a sequence already holds
    its total adjoint); ``Abar`` ``[len(lay.element_segments), H', D, D]``: :func:`element_transition`
    of the segments that are not last, in the order of ``lay.element_segments``.  Returns P̄ ``[S, ...]``:
    the total adjoint of every segment's start state.  Serial only over segments (the steps of
    ``lay.phase_b_steps`` in reverse; all sequences together).
    """
    if not isinstance(lay, scan.ScanLayout):
        raise TypeError(f"lay must be a ScanLayout, got {type(lay).__name__}")
    check_shaped("G", G, (lay.n_segments, *G.shape[1:]))
    check_shaped("Abar", Abar, (lay.element_segments.numel(), *G.shape[1:]))
    Pbar = G.clone()
    where = torch.full((lay.n_segments,), -1, dtype=torch.int64, device=G.device)
    where[lay.element_segments] = torch.arange(lay.element_segments.numel(), device=G.device)
    for _seqs, cur in reversed(lay.phase_b_steps):
        Ab = Abar[where[cur]]
        Pbar[cur] = G[cur] + _sym(Ab.transpose(-1, -2) @ Pbar[cur + 1] @ Ab)
    return Pbar


def covariance_scan_backward(q, k, v, r2, ell2, log_alpha, P0, cu: list[int], C: int, *, segment_chunks: int,
                             P_starts: torch.Tensor, dw=None, dbeta=None, dlinv=None, dvariance=None, dkw=None,
                             dvu=None, dg=None, dP=None, elements=None,
                             element_dtype: torch.dtype | None = torch.float64) -> ScanGrads:
    """Gradients of :func:`bayeslayer.ops.bayesian_layer.scan.covariance_scan`'s inputs from its outputs' adjoints
    (B2–B4).

    Inputs as the forward (packed ``[NT, H', ...]``, ``P0`` ``[N, H', D, D]``, ``cu``, ``C``,
    ``segment_chunks``) plus its checkpoints ``P_starts`` ``[S, H', D, D]`` (``ScanOutput.P_starts``).
    Adjoints, each None (zero) or shaped like the output: ``dw`` ``[NT, H', D]``, ``dbeta`` ``[NT, H']``,
    ``dlinv`` ``[NT, H', C]``, ``dvariance`` ``[NT, H']``, ``dkw`` ``[NT, H', D]``, ``dvu`` ``[NT, H', m]``,
    ``dg`` ``[NT, H', Da]``, ``dP`` ``[N, H', D, D]`` (the final state).  ``elements``: Phase A's
    ``(A, C, J)`` of ``lay.element_segments`` if the forward kept them, else recomputed here.
    ``element_dtype``: the arithmetic of the elements, ``Ā`` and B3 (None: the inputs' dtype), as the
    forward's Phase A/B; the replays B2/B4 run in the inputs' dtype.  Returns :class:`ScanGrads`.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a packed [NT, H', ·] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    NT, Hf, D = k.shape
    check_shaped("q", q, k.shape)
    if v.shape[:2] != (NT, Hf):
        raise ValueError(f"v must be [NT={NT}, H'={Hf}, m], got {tuple(v.shape)}")
    check_shaped("r2", r2, (NT, Hf))
    check_shaped("ell2", ell2, (NT, Hf))
    if not isinstance(log_alpha, torch.Tensor) or log_alpha.shape[:2] != (NT, Hf) or log_alpha.dim() != 3 or \
            log_alpha.shape[-1] not in (1, D):
        raise ValueError(f"log_alpha must be [NT={NT}, H'={Hf}, 1 or {D}], got "
                         f"{getattr(log_alpha, 'shape', type(log_alpha).__name__)}")
    if not isinstance(cu, (list, tuple)) or len(cu) < 2 or cu[0] != 0 or cu[-1] != NT or \
            any(b < a for a, b in zip(cu[:-1], cu[1:], strict=False)):
        raise ValueError(f"cu must be a non-decreasing list of offsets from 0 to NT={NT}, got {cu!r}")
    N = len(cu) - 1
    check_shaped("P0", P0, (N, Hf, D, D))
    for name, x in (("q", q), ("v", v), ("r2", r2), ("ell2", ell2), ("log_alpha", log_alpha), ("P0", P0),
                    ("P_starts", P_starts)):
        if not isinstance(x, torch.Tensor) or x.dtype != k.dtype or x.device != k.device:
            raise ValueError(f"{name} must be a {k.dtype} tensor on {k.device} like k, got "
                             f"{getattr(x, 'dtype', type(x).__name__)} on {getattr(x, 'device', None)}")
    lay = scan.scan_layout(list(cu), C, segment_chunks, k.device)
    check_shaped("P_starts", P_starts, (lay.n_segments, Hf, D, D))
    shapes = dict(w=(NT, Hf, D), beta=(NT, Hf), linv=(NT, Hf, lay.C), variance=(NT, Hf), kw=(NT, Hf, D),
                  vu=tuple(v.shape), g=tuple(log_alpha.shape))
    outs = dict(w=dw, beta=dbeta, linv=dlinv, variance=dvariance, kw=dkw, vu=dvu, g=dg)
    for name, x in outs.items():
        if x is not None:
            check_shaped(f"d{name}", x, shapes[name], k.dtype)
    if dP is not None:
        check_shaped("dP", dP, (N, Hf, D, D), k.dtype)
    xs = {name: lay.grid(x, fill) for name, x, fill in
          (("q", q, 0.0), ("k", k, 0.0), ("v", v, 0.0), ("r2", r2, 1.0), ("ell2", ell2, 0.0), ("la", log_alpha, 0.0))}
    dxs = {name: (lay.grid(x, 0.0) if x is not None else None) for name, x in outs.items()}
    last = lay.last_segments
    end_bar = torch.zeros_like(P_starts)
    if dP is not None:
        end_bar[last] = dP
    # B2: local adjoints of the checkpoints (the last segment of a sequence gets the final state's adjoint)
    G, _ = segment_adjoint(lay, xs, dxs, P_starts, end_bar, inputs=False)
    # B3: the reverse pass over segments
    segs = lay.element_segments
    ed = element_dtype or k.dtype
    if elements is None:
        A, _, J, _ = scan.phase_a(lay, {name: xs[name].to(ed) for name in ("k", "r2", "ell2", "la")}, segs)
    else:
        if not isinstance(elements, (tuple, list)) or len(elements) != 3:
            raise ValueError(f"elements must be Phase A's (A, C, J), got {type(elements).__name__}")
        A, _, J = elements
        check_shaped("elements' A", A, (segs.numel(), Hf, D, D))
        check_shaped("elements' J", J, (segs.numel(), Hf, D, D))
    Abar = element_transition(A.to(ed), J.to(ed), P_starts[segs].to(ed))
    Pbar = reverse_segments(lay, G.to(ed), Abar).to(k.dtype)
    # B4: the true adjoint, P̄_{s+1} arriving at the end of every segment that is not last
    nxt = torch.zeros_like(end_bar)
    nxt[segs] = Pbar[segs + 1]
    end_bar = torch.where(_is(last, lay.n_segments, k.device)[:, None, None, None], end_bar, nxt)
    dP_start, gr = segment_adjoint(lay, xs, dxs, P_starts, end_bar, inputs=True)
    zero_v = torch.zeros_like(v)
    return ScanGrads(
        q=lay.scatter(gr["q"], NT), k=lay.scatter(gr["k"], NT),
        v=lay.scatter(gr["v"], NT) if gr["v"] is not None else zero_v, r2=lay.scatter(gr["r2"], NT),
        ell2=lay.scatter(gr["ell2"], NT), log_alpha=lay.scatter(gr["la"], NT), P0=dP_start[lay.seq_first_seg],
    )


def _is(idx: torch.Tensor, n: int, device) -> torch.Tensor:
    m = torch.zeros(n, dtype=torch.bool, device=device)
    m[idx] = True
    return m


# ---------------------------------------------------------------------------------------------------
# the scalar-decay loop of chunk.covariance_pass, in its own variables
# ---------------------------------------------------------------------------------------------------

SCALAR_GRAD_NAMES = ("kt", "base", "NBk", "gamma", "ratio", "end", "b_end", "gC2")


def chunk_adjoint_scalar(dP_next, dw, saved: tuple, kt, gamma, ratio, end, gC2):
    """Adjoint of one chunk of the scalar-decay loop of :func:`bayeslayer.ops.bayesian_layer.chunk.covariance_pass`.

    Forward (per chunk, leading dims ``[...]``): ``Y = K̃P``, ``S = base + YK̃ᵀ = L_c L_cᵀ``,
    ``Ū = (L_c ⊙ R)⁻¹(NBk + γ ⊙ Y)``, ``P' = sym(b_C I + γ_C² P − ŪᵀdiagẼ²Ū)`` (``Ẽ = end``),
    ``w = Ū / diag(L_c)``.  ``saved = (P, Y, L_c, Ū)`` of the chunk; ``dP_next``, ``dw``: adjoints of
    ``P'`` and ``w``.  Returns ``(dP, grads)``, ``grads`` keyed by :data:`SCALAR_GRAD_NAMES`
    (``ratio``: its lower triangle is what the forward reads; ``base``: symmetrised).
    """
    if not isinstance(saved, (tuple, list)) or len(saved) != 4:
        raise ValueError(f"saved must be the chunk's (P, Y, Lc, Ub), got {type(saved).__name__}")
    P, Y, Lc, Ub = saved
    check_shaped("dP_next", dP_next, P.shape)
    check_shaped("dw", dw, Ub.shape)
    out = {}
    dc = torch.diagonal(Lc, dim1=-2, dim2=-1)
    Gs = _sym(dP_next)  # P' = sym(Pn)
    Ue = Ub * end
    dUe = -2.0 * Ue @ Gs  # Pn ∋ −UeᵀUe, Gs symmetric
    dUb = dw / dc[..., None] + end * dUe
    out["end"] = (dUe * Ub).sum(-1, keepdim=True)
    ddc = -(dw * Ub).sum(-1) / (dc * dc)
    out["gC2"] = (Gs * P).sum((-1, -2), keepdim=True)
    out["b_end"] = torch.diagonal(Gs, dim1=-2, dim2=-1).sum(-1)[..., None, None]
    dP = gC2 * Gs
    LR = Lc * ratio
    dX = torch.linalg.solve_triangular(LR.transpose(-1, -2), dUb, upper=True)  # Ū = LR⁻¹X
    dLR = -(dX @ Ub.transpose(-1, -2)).tril()
    dLc = dLR * ratio + torch.diag_embed(ddc)
    out["ratio"] = dLR * Lc
    out["NBk"] = dX
    out["gamma"] = (dX * Y).sum(-1, keepdim=True)
    dY = gamma * dX
    Sb = cholesky_adjoint(Lc, dLc)
    out["base"] = Sb
    dY = dY + Sb @ kt
    out["kt"] = Sb @ Y + dY @ P.transpose(-1, -2)
    return dP + kt.transpose(-1, -2) @ dY, out


def covariance_pass_adjoint_scalar(dw, dP_end, saved: list, kt, gamma, ratio, end, gC2):
    """Reverse sweep of :func:`chunk_adjoint_scalar` over ``n`` chunks (inputs ``[n, ...]``, ``saved`` n tuples).

    Returns ``(dP_0, grads)``, ``grads`` keyed by :data:`SCALAR_GRAD_NAMES`, each stacked ``[n, ...]``.
    """
    if not isinstance(saved, (list, tuple)) or not saved:
        raise ValueError(f"saved must be a non-empty list of per-chunk (P, Y, Lc, Ub), got {type(saved).__name__}")
    n = len(saved)
    for name, x in (("dw", dw), ("kt", kt), ("gamma", gamma), ("ratio", ratio), ("end", end), ("gC2", gC2)):
        if not isinstance(x, torch.Tensor) or x.shape[0] != n:
            raise ValueError(f"{name} must be a tensor with {n} chunks along dim 0, got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    G = dP_end
    out = {name: [None] * n for name in SCALAR_GRAD_NAMES}
    for i in range(n - 1, -1, -1):
        G, gi = chunk_adjoint_scalar(G, dw[i], saved[i], kt[i], gamma[i], ratio[i], end[i], gC2[i])
        for name, x in gi.items():
            out[name][i] = x
    return G, {name: torch.stack(v) for name, v in out.items()}
