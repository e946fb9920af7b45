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

Per chunk, the replay and its adjoint are the covariance step of every PyTorch path and its adjoint
(:func:`~bayeslayer.ops.bayesian_layer.covariance.covariance_step`,
:func:`~bayeslayer.ops.bayesian_layer.covariance.covariance_step_adjoint`), with every decay handled as a
diagonal one: scalar decay is the diagonal decay with all channels equal, and its gradient is the channel sum
(exact).  The prep (the P-free terms of a chunk, :func:`chunk_terms`) has its own adjoint
(:func:`terms_adjoint`: kernel B5's twin).  Gradients of a symmetric matrix (P0, the P_s) are
returned symmetrised: only that part is defined by a function of a covariance.

Not here: rotations (the scan refuses them); the adjoint of :func:`bayeslayer.ops.bayesian_layer.prepare.prepare`
(α → log α, group folding, ``P0 = p0·I``); the mean pass (B1); ``ScanOutput.P_starts`` are
checkpoints and take no adjoint.  The twin keeps a ``[C, C, D]`` ratio per chunk even for scalar
decay and Phase A's elements are recomputed unless passed in (``elements=``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..utils.validation import check_shaped
from . import scan
from .covariance import covariance_step, covariance_step_adjoint, sym

# ---------------------------------------------------------------------------------------------------
# per-chunk terms (the prep, kernel F1) and their adjoint (kernel B5)
# ---------------------------------------------------------------------------------------------------

def chunk_terms(k, r2, ell2, log_alpha, q=None) -> dict:
    """The P-free terms of a chunk, every decay as a diagonal one (leading dims ``[...]`` arbitrary).

    k ``[..., C, D]``, r2/ell2 ``[..., C]``, log_alpha ``[..., C, Da]`` (Da = 1 or D), q ``[..., C, D]``
    or None.  Returns :func:`bayeslayer.ops.bayesian_layer.scan.chunk_prep` of ``log_alpha`` expanded to
    ``D`` channels: ``dyn`` (per-channel factors ``ratio = Φ_iΦ_j⁻¹`` ``[..., C, C, D]``, ``gamma``, ``end``,
    ``gamma_C``), ``kt``, ``NBk``, ``base``, ``BC = diag B_C`` ``[..., 1, D]``, ``b``, ``g`` and, with q,
    ``qt = Φᵀq`` and ``qBq``: the inputs of :func:`~bayeslayer.ops.bayesian_layer.covariance.covariance_step`
    in the form its adjoint takes.
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
    return scan.chunk_prep(k, r2, ell2, log_alpha.expand(k.shape), q=q)


def terms_adjoint(k, r2, ell2, log_alpha, terms: dict, d: dict, q=None, dg=None):
    """Adjoint of :func:`chunk_terms`: ``(dk, dr2, dell2, dlog_alpha, dq)`` from the terms' adjoints ``d``.

    ``d`` holds any of :data:`~bayeslayer.ops.bayesian_layer.covariance.STEP_GRAD_NAMES` (missing: zero), as
    :func:`~bayeslayer.ops.bayesian_layer.covariance.covariance_step_adjoint` returns them;
    ``dg``: adjoint of the chunk-local cumulative log-decay ``g`` (what the forward hands the mean
    pass), ``[..., C, Da]`` or None.  ``dq`` is None without q.  ``dlog_alpha`` has log_alpha's shape.
    """
    check_shaped("k", k, terms["kt"].shape)
    z = torch.zeros_like
    dyn, b = terms["dyn"], terms["b"]
    gamma, ratio, end, gC = dyn.gamma, dyn.ratio, dyn.end, dyn.gamma_C[..., 0, :]
    NBk = terms["NBk"]
    dbase = d.get("base", z(terms["base"]))
    dr2 = torch.diagonal(dbase, dim1=-2, dim2=-1).clone()
    dNl = dbase + dbase.transpose(-1, -2) - torch.diag_embed(torch.diagonal(dbase, dim1=-2, dim2=-1))
    dkt = d.get("kt", z(k))
    dNBk = d.get("NBk", z(k)) + torch.einsum("...ij,...ijd,...id->...jd", dNl, ratio, k)
    dratio = d.get("ratio", z(ratio)) + dNl[..., None] * k[..., :, None, :] * NBk[..., None, :, :]
    dk = gamma * dkt + b * dNBk + torch.einsum("...ij,...ijd,...jd->...id", dNl, ratio, NBk)
    db = dNBk * k
    if "BC" in d:
        db[..., -1, :] += d["BC"][..., 0, :]
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
    if "gamma_C" in d:
        dG[..., -1, :] += d["gamma_C"][..., 0, :] * gC
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
    R = torch.linalg.cholesky(sym(eye + GtJ @ G))
    return A - (A @ G) @ torch.cholesky_solve(GtJ, R)


# ---------------------------------------------------------------------------------------------------
# B2 / B4: replay a segment and run its adjoint; B3: the reverse pass over segments
# ---------------------------------------------------------------------------------------------------

GRAD_NAMES = ("w", "beta", "linv", "variance", "kw", "vu", "g")


class ScanGrads(NamedTuple):
    """Gradients of the covariance scan's inputs (packed ``[NT, H', ...]`` like the inputs; ``P0`` ``[N, H', D, D]``).

    ``q`` is zero without a variance adjoint (None from the chain path's
    :func:`~bayeslayer.ops.bayesian_layer.chain_triton.chain_backward`), ``v`` zero without a ``vu`` adjoint.
    ``P0`` symmetrised.
    """

    q: torch.Tensor | None
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
    adjoint arriving at its end.  All segments run together: one
    :func:`~bayeslayer.ops.bayesian_layer.covariance.covariance_step` and one
    :func:`~bayeslayer.ops.bayesian_layer.covariance.covariance_step_adjoint` call per chunk position, however
    many segments.  Returns ``(dP_start,
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
        st = covariance_step(t["dyn"], t["kt"], t["NBk"], t["base"], t["BC"], P, q=xs["q"][j] if want_q else None,
                             qt=t.get("qt"), qBq=t.get("qBq"), factors=True, save=True)
        saved.append(st["saved"])
        terms.append(t)
        P = st["P"]
    grads = {name: [None] * lay.n_s for name in ("q", "k", "v", "r2", "ell2", "la")} if inputs else None
    Pbar = P_end_bar
    for j in range(lay.n_s - 1, -1, -1):
        dj = {name: (x[j] if x is not None else None) for name, x in dxs.items()}
        t = terms[j]
        Pbar, dt, dq, dv = covariance_step_adjoint(
            t["dyn"], t["kt"], t["NBk"], saved[j], Pbar, q=xs["q"][j] if want_q else None, qt=t.get("qt"),
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
    return sym(Pbar), grads


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
        Pbar[cur] = G[cur] + sym(Ab.transpose(-1, -2) @ Pbar[cur + 1] @ Ab)
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
