"""The Bayesian Layer's mean pass on flash-linear-attention's GDN/GLA forward kernels (design note §1).

Given the covariance scan's per-chunk outputs (:class:`bayeslayer.ops.scan.ScanOutput`) the BL
mean pass is fla's gated-delta-rule state/output pass on substituted tensors::

    fla k := W = βU (write keys),   fla w := L⁻¹(γ⊙K),   fla u := L⁻¹V,   g := cumulative log-decay

With ``h`` the state at a chunk's start (fla's ``chunk_gated_delta_rule_fwd_h``)::

    E = u − w h ;   h ← Φ_C h + (Φ_CΦ_i⁻¹ k_i)ᵀ E

and the output (fla's ``chunk_fwd_o``; scale 1): ``o = (γ⊙q) h + A E``, ``A_ti = q_tᵀΦ_tΦ_i⁻¹k_i``
(``i ≤ t``).  fla's gates are base 2 (``exp2``): ``g`` is passed as ``g / ln 2``.

Scalar decay: ``fwd_h(k=W, w, u, g)`` and ``chunk_fwd_o(q, W, E, h, g)``.  Diagonal decay (fla's
KDA/GLA conventions): ``fwd_h(k=Φ_CΦ_i⁻¹W, w, u, gk=g)`` (with a per-channel gate fla's ``fwd_h``
does not rescale ``k``), ``A`` from GLA's intra-chunk kernel ``chunk_gla_fwd_intra_gk(q, W, g)``
(its sub-chunk split keeps the C×C×D contraction on ``tl.dot``), then ``chunk_gla_fwd_o_gk``.

Not taken by fla here: float64 (fla keeps its final state in float32; the caller uses
:func:`bayeslayer.ops.scan.mean_pass_reference` or its own kernel), rotations (no fla kernel).
G > 1 runs as ``H·G`` heads (the scan folds groups into heads; every group has its own W).

The fla functions are internal API: :data:`FLA_VERSIONS` is the range whose source was read
(``fla/ops/common/{chunk_delta_h,chunk_o}.py``, ``fla/ops/gla/chunk.py`` at 0.6.0), checked at call
time by :func:`require_fla`.
"""

from __future__ import annotations

import contextlib
import math

import torch

# the fla releases whose internal call conventions this module was written against: [low, high)
FLA_VERSIONS = ((0, 6, 0), (0, 7, 0))
_RCP_LN2 = 1.0 / math.log(2.0)


def _version_tuple(s: str) -> tuple[int, ...]:
    out = []
    for part in s.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def require_fla():
    """Import flash-linear-attention and check its version is in :data:`FLA_VERSIONS`; returns the module."""
    lo, hi = FLA_VERSIONS
    want = f">={'.'.join(map(str, lo))},<{'.'.join(map(str, hi))}"
    try:
        import fla
    except ImportError as e:
        raise RuntimeError(
            f"the mean pass on fla's kernels needs flash-linear-attention {want} (pip install 'bayeslayer[gpu]')"
        ) from e
    v = _version_tuple(getattr(fla, "__version__", "0"))
    if not lo <= v < hi:
        raise RuntimeError(
            f"bayeslayer calls internal functions of flash-linear-attention {want}; found {fla.__version__}. "
            "Install a version in that range or use the own mean pass (mean=None)."
        )
    return fla


@contextlib.contextmanager
def one_autotune_config():
    """Pin fla's autotuned kernels (of the modules this file calls) to their first config, then restore.

    For the Triton interpreter (CPU tests, ``benchmarks/gpu.py --scan --dry-run``), which cannot
    benchmark configs; never needed on a GPU.
    """
    import fla.ops.common.chunk_delta_h as m0
    import fla.ops.common.chunk_o as m1
    import fla.ops.gla.chunk as m2
    from triton.runtime.autotuner import Autotuner

    saved = []
    for mod in (m0, m1, m2):
        for name in dir(mod):
            o = getattr(mod, name)
            while o is not None and not isinstance(o, Autotuner) and hasattr(o, "fn"):
                o = o.fn
            if isinstance(o, Autotuner) and len(o.configs) > 1:
                saved.append((o, o.configs))
                o.configs = o.configs[:1]
    try:
        yield
    finally:
        for o, c in saved:
            o.configs = c


def chunk_last_index(cu: list[int], C: int, device) -> torch.Tensor:
    """For every packed token, the index of the last token of its chunk ``[NT]`` (chunks restart per sequence)."""
    idx = []
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        t = torch.arange(a, b, device=device)
        idx.append(torch.clamp(a + ((t - a) // C + 1) * C, max=b) - 1)
    return torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64, device=device)


def fwd_h_reference(k, w, u, g=None, gk=None, initial_state=None, output_final_state=False, chunk_size=64,
                    cu_seqlens=None):
    """Plain-PyTorch twin of fla's ``chunk_gated_delta_rule_fwd_h`` (same layout and base-2 gates).

    k, w ``[B, T, H, K]``, u ``[B, T, H, V]``, g ``[B, T, H]`` or gk ``[B, T, H, K]`` (chunk-local
    cumulative, log2), initial_state ``[N, H, K, V]``.  Per chunk, ``h`` its start state (stored)::

        v_new = u − w h ;   h ← 2^{g_last} h + kᵀ (2^{g_last − g} v_new)     (gk: h ← diag(2^{gk_last}) h + kᵀ v_new)

    Returns ``(h [B, NC, H, K, V], v_new [B, T, H, V], final [N, H, K, V] float32 or None)``.
    """
    B, T, H, K = k.shape
    V = u.shape[-1]
    C = chunk_size
    if cu_seqlens is None:
        seqs = [(b, 0, T) for b in range(B)]
    else:
        c = cu_seqlens.tolist()
        seqs = [(0, a, e) for a, e in zip(c[:-1], c[1:], strict=True)]
    hs, finals = [], []
    v_new = torch.zeros_like(u)
    for n, (b, a, e) in enumerate(seqs):
        h = (initial_state[n].to(torch.float32) if initial_state is not None
             else torch.zeros(H, K, V, dtype=torch.float32, device=k.device))
        for s in range(a, e, C):
            t = slice(s, min(s + C, e))
            hs.append(h.to(k.dtype))
            kt, wt, ut = k[b, t].float(), w[b, t].float(), u[b, t].float()  # [c, H, ·]
            vn = ut - torch.einsum("chk,hkv->chv", wt, h)
            v_new[b, t] = vn.to(u.dtype)
            if g is not None:
                gt = g[b, t].float()  # [c, H]
                vn = vn * torch.exp2(gt[-1] - gt)[..., None]
                h = h * torch.exp2(gt[-1])[:, None, None]
            if gk is not None:
                h = h * torch.exp2(gk[b, t].float()[-1])[..., None]
            h = h + torch.einsum("chk,chv->hkv", kt, vn.to(k.dtype).float())
        finals.append(h)
    hs_t = torch.stack(hs).reshape(B, -1, H, K, V) if hs else k.new_zeros(B, 0, H, K, V)
    final = torch.stack(finals) if output_final_state else None
    return hs_t, v_new, final


def mean_pass_fla(q, w, kw, vu, g, M0, cu: list[int], C: int, *, fwd_h=None):
    """The BL mean pass on fla's kernels, with :func:`bayeslayer.ops.scan.mean_pass_reference`'s contract.

    Packed ``[NT, H', ·]``: q, w (βU), kw (``L⁻¹(γ⊙K)``), vu (``L⁻¹V``), g ``[NT, H', Da]``
    (chunk-local cumulative log-decay, natural log; Da = 1 scalar, D diagonal), M0 ``[N, H', D, m]``.
    Returns ``(o [NT, H', m], M [N, H', D, m])`` in the inputs' dtype (fla accumulates in fp32).
    ``fwd_h``: the state kernel (default fla's; :func:`fwd_h_reference` for CPU tests, where fla's
    ``fwd_h`` does not run under the Triton interpreter).
    """
    require_fla()
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gla.chunk import chunk_gla_fwd_intra_gk, chunk_gla_fwd_o_gk

    if fwd_h is None:
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h as fwd_h
    for name, x in (("q", q), ("w", w), ("kw", kw), ("vu", vu), ("g", g)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a packed [NT, H', ·] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if q.dtype == torch.float64:
        raise TypeError("mean_pass_fla: fla keeps its state in float32; use the own mean pass for float64")
    if q.shape[-1] > 256:
        raise ValueError(f"fla's fwd_h supports key dims up to 256, got D={q.shape[-1]}")
    cu_t = torch.tensor(cu, dtype=torch.int64, device=q.device)
    diag = g.shape[-1] > 1
    g2 = (g.float() * _RCP_LN2).contiguous()

    def fla(x):  # packed [NT, H, ·] -> fla's varlen layout [1, NT, H, ·]
        return x.unsqueeze(0).contiguous()

    h0 = M0.to(torch.float32).contiguous()
    if not diag:
        gs = fla(g2[..., 0])
        h, v_new, M = fwd_h(fla(w), fla(kw), fla(vu), g=gs, initial_state=h0, output_final_state=True,
                            chunk_size=C, cu_seqlens=cu_t)
        o = chunk_fwd_o(fla(q), fla(w), v_new, h, g=gs, scale=1.0, cu_seqlens=cu_t, chunk_size=C)
    else:
        last = chunk_last_index(cu, C, q.device)
        w_end = w * torch.exp(g[last] - g).to(w.dtype)  # Φ_CΦ_i⁻¹ w_i (always ≤ 1: no overflow)
        gk = fla(g2)
        h, v_new, M = fwd_h(fla(w_end), fla(kw), fla(vu), gk=gk, initial_state=h0, output_final_state=True,
                            chunk_size=C, cu_seqlens=cu_t)
        A = chunk_gla_fwd_intra_gk(fla(q), fla(w), gk, 1.0, cu_seqlens=cu_t, chunk_size=C)
        o = chunk_gla_fwd_o_gk(fla(q), v_new, gk, A, h, 1.0, cu_seqlens=cu_t, chunk_size=C)
    return o[0].to(q.dtype), M.to(M0.dtype)
