"""The Bayesian Layer's mean pass on flash-linear-attention's GDN/GLA forward kernels (docs/theory.md §6.4).

Given the covariance scan's per-chunk outputs (:class:`bayeslayer.ops.bayesian_layer.scan.ScanOutput`) the BL
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
:func:`bayeslayer.ops.bayesian_layer.scan.mean_pass_reference` or its own kernel), rotations (no fla kernel).
G > 1 runs as ``H·G`` heads (the scan folds groups into heads; every group has its own W).

Backward (:func:`mean_pass_fla_backward`, docs/theory.md §6.4): fla's GDN backward minus its WY step
(scalar decay: ``chunk_bwd_dv_local``, ``chunk_gated_delta_rule_bwd_dhu``, ``chunk_bwd_dqkwg``); diagonal
decay: GLA/KDA's ``chunk_kda_bwd_dAv``, ``chunk_gla_bwd_dqk_intra``, ``chunk_gla_bwd_dqkg`` around the same
``bwd_dhu`` with ``gk``.  Every kernel has a plain-PyTorch twin (:data:`TWIN_KERNELS`);
:func:`substitution_backward` is the adjoint of ``L⁻¹(γ⊙K)``, ``L⁻¹V``.

The fla functions are internal API: :data:`FLA_VERSIONS` is the range whose source was read
(``fla/ops/common/{chunk_delta_h,chunk_o}.py``, ``fla/ops/gla/chunk.py``, ``fla/ops/kda/chunk_bwd.py``,
``fla/ops/utils/cumsum.py`` at 0.6.0), checked at call time by :func:`require_fla`.
"""

from __future__ import annotations

import contextlib
import math

import torch

from .triton_support import MAX_HEAD_DIM

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


def fla_hopper_guard(bypass: bool) -> dict:
    """fla's refusal of its gated ``chunk_bwd_dqkwg`` on Hopper with Triton 3.4 <= v < 3.7.1 (fla issue #640:
    wrong gradient values): whether it is active here and, with ``bypass``, switch it off.

    The guard reads module globals of ``fla.ops.common.chunk_o`` at call time, so setting its
    ``TRITON_ABOVE_3_7_1`` lets the kernels run (their times are what a user gets; their values are what
    ``benchmarks/gpu.py --scan`` checks).  It also gates BL's backward (the chain's and the scan's), whose
    scalar-decay mean-pass backward (:func:`mean_pass_fla_backward`) calls the same fla function.  Returns
    ``{"active", "bypassed", "triton", "fla"}`` (``active``: the guard would refuse here; None when fla is not
    installed; the versions None when not installed).
    """
    if not isinstance(bypass, bool):
        raise TypeError(f"bypass must be a bool, got {type(bypass).__name__}")
    out = {"active": None, "bypassed": False, "triton": None, "fla": None}
    try:
        import triton
    except ImportError:
        return out
    out["triton"] = triton.__version__
    try:
        import fla
        import fla.ops.common.chunk_o as fla_chunk_o
    except ImportError:
        return out
    out["fla"] = getattr(fla, "__version__", None)
    flags = [getattr(fla_chunk_o, n, None) for n in ("IS_NVIDIA_HOPPER", "TRITON_ABOVE_3_4_0", "TRITON_ABOVE_3_7_1")]
    if None in flags:  # another fla: the guard is not the one this function knows
        out["active"] = "unknown: fla.ops.common.chunk_o lacks IS_NVIDIA_HOPPER / TRITON_ABOVE_3_* (another fla?)"
        return out
    hopper, above_340, above_371 = (bool(f) for f in flags)
    out["active"] = hopper and above_340 and not above_371
    if bypass and out["active"]:
        fla_chunk_o.TRITON_ABOVE_3_7_1 = True
        out["bypassed"] = True
    return out


# the fla modules whose kernels this file calls (what :func:`one_autotune_config` imports before pinning)
FLA_MODULES = ("fla.ops.common.chunk_delta_h", "fla.ops.common.chunk_o", "fla.ops.gla.chunk", "fla.ops.kda.chunk_bwd",
               "fla.ops.utils.cumsum")


@contextlib.contextmanager
def one_autotune_config(modules=FLA_MODULES):
    """Pin every autotuned kernel of the loaded ``fla`` modules to its first config, then restore.

    ``modules``: fla module names imported first (default: those this file calls; the benchmark adds GDN's).
    Every ``fla.*`` module loaded by then is covered, each autotuner once (one reachable under two names is
    restored to its own configs).  For the Triton interpreter (CPU tests, ``benchmarks/gpu.py --scan
    --dry-run``), which cannot benchmark configs, and for value checks on a GPU that should not autotune.
    """
    import importlib
    import sys

    from triton.runtime.autotuner import Autotuner

    if isinstance(modules, str) or not all(isinstance(m, str) for m in modules):
        raise TypeError(f"modules must be a sequence of module names, got {modules!r}")
    for name in modules:
        importlib.import_module(name)
    saved, seen = [], set()
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for obj in list(vars(mod).values()):
            while obj is not None and not isinstance(obj, Autotuner) and hasattr(obj, "fn"):
                obj = obj.fn
            if isinstance(obj, Autotuner) and id(obj) not in seen and len(obj.configs) > 1:
                seen.add(id(obj))
                saved.append((obj, obj.configs))
                obj.configs = obj.configs[:1]
    try:
        yield
    finally:
        for obj, configs in saved:
            obj.configs = configs


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """fla's accumulation dtype (float32), or float64 for float64 twins."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def chunk_last_index(cu, C: int, device, n_tokens: int | None = None, n_seq: int | None = None) -> torch.Tensor:
    """For every packed token, the index of the last token of its chunk ``[NT]`` (chunks restart per sequence).

    ``cu``: the sequence offsets as a host list, a device tensor (read on the device only), or None for
    ``n_seq`` sequences of equal length ``n_tokens / n_seq``."""
    if isinstance(cu, (list, tuple)):
        idx = []
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            t = torch.arange(a, b, device=device)
            idx.append(torch.clamp(a + ((t - a) // C + 1) * C, max=b) - 1)
        return torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64, device=device)
    if cu is None:
        cu = torch.arange(n_seq + 1, device=device, dtype=torch.int64) * (n_tokens // max(n_seq, 1))
    cu = cu.to(device=device, dtype=torch.int64)
    t = torch.arange(n_tokens, device=device, dtype=torch.int64)
    seq = torch.searchsorted(cu, t, right=True) - 1
    a, b = cu[seq], cu[seq + 1]
    return torch.minimum(a + torch.div(t - a, C, rounding_mode="floor") * C + C, b) - 1


def fla_layout(cu, n_tokens: int, n_seq: int, device) -> tuple[torch.Tensor | None, int, int]:
    """How packed ``[NT, H', ·]`` tensors go to fla's kernels: ``(cu_seqlens, B, T)``.

    ``cu`` None: ``n_seq`` sequences of equal length, laid out ``[B = n_seq, T, H', ·]`` with no ``cu_seqlens``
    (nothing for fla to read on the host); a device tensor: passed as it is (fla builds its chunk indices from
    it, one host read per distinct tensor, cached by fla); a host list: made a tensor."""
    if cu is None:
        return None, n_seq, n_tokens // max(n_seq, 1)
    if isinstance(cu, torch.Tensor):
        return cu.to(device=device, dtype=torch.int64), 1, n_tokens
    return torch.tensor(list(cu), dtype=torch.int64, device=device), 1, n_tokens


def fwd_h_reference(k, w, u, g=None, gk=None, initial_state=None, output_final_state=False, chunk_size=64,
                    cu_seqlens=None):
    """Plain-PyTorch twin of fla's ``chunk_gated_delta_rule_fwd_h`` (same layout and base-2 gates).

    k, w ``[B, T, H, K]``, u ``[B, T, H, V]``, g ``[B, T, H]`` or gk ``[B, T, H, K]`` (chunk-local
    cumulative, log2), initial_state ``[N, H, K, V]``.  Per chunk, ``h`` its start state (stored)::

        v_new = u − w h ;   h ← 2^{g_last} h + kᵀ (2^{g_last − g} v_new)     (gk: h ← diag(2^{gk_last}) h + kᵀ v_new)

    Returns ``(h [B, NC, H, K, V], v_new [B, T, H, V], final [N, H, K, V] float32 or None)``
    (float64 throughout for float64 inputs: the twins are the float64 reference of the backward).
    """
    _check_fla(chunk_size, cu_seqlens, k=k, w=w, u=u, g=g, gk=gk)
    B, T, H, K = k.shape
    V = u.shape[-1]
    C = chunk_size
    if cu_seqlens is None:
        seqs = [(b, 0, T) for b in range(B)]
    else:
        c = cu_seqlens.tolist()
        seqs = [(0, a, e) for a, e in zip(c[:-1], c[1:], strict=True)]
    acc = _acc_dtype(k)
    hs, finals = [], []
    v_new = torch.zeros_like(u)
    for n, (b, a, e) in enumerate(seqs):
        h = (initial_state[n].to(acc) if initial_state is not None
             else torch.zeros(H, K, V, dtype=acc, device=k.device))
        for s in range(a, e, C):
            t = slice(s, min(s + C, e))
            hs.append(h.to(k.dtype))
            kt, wt, ut = k[b, t].to(acc), w[b, t].to(acc), u[b, t].to(acc)  # [c, H, ·]
            vn = ut - torch.einsum("chk,hkv->chv", wt, h)
            v_new[b, t] = vn.to(u.dtype)
            if g is not None:
                gt = g[b, t].to(acc)  # [c, H]
                vn = vn * torch.exp2(gt[-1] - gt)[..., None]
                h = h * torch.exp2(gt[-1])[:, None, None]
            if gk is not None:
                h = h * torch.exp2(gk[b, t].to(acc)[-1])[..., None]
            h = h + torch.einsum("chk,chv->hkv", kt, vn.to(k.dtype).to(acc))
        finals.append(h)
    hs_t = torch.stack(hs).reshape(B, -1, H, K, V) if hs else k.new_zeros(B, 0, H, K, V)
    final = torch.stack(finals) if output_final_state else None
    return hs_t, v_new, final


def mean_pass_fla(q, w, kw, vu, g, M0, cu, C: int, *, fwd_h=None):
    """The BL mean pass on fla's kernels, with :func:`bayeslayer.ops.bayesian_layer.scan.mean_pass_reference`'s
    contract.

    Packed ``[NT, H', ·]``: q, w (βU), kw (``L⁻¹(γ⊙K)``), vu (``L⁻¹V``), g ``[NT, H', Da]``
    (chunk-local cumulative log-decay, natural log; Da = 1 scalar, D diagonal), M0 ``[N, H', D, m]``.
    Returns ``(o [NT, H', m], M [N, H', D, m])`` in the inputs' dtype (fla accumulates in fp32).
    ``cu``: the sequence offsets, a host list or a device tensor, or None for ``N = M0.shape[0]`` sequences of
    equal length (:func:`fla_layout`; then nothing is read on the host).  ``fwd_h``: the state kernel (default
    fla's; :func:`fwd_h_reference` for CPU tests, where fla's ``fwd_h`` does not run under the Triton interpreter).
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
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"fla's fwd_h supports key dims up to {MAX_HEAD_DIM}, got D={q.shape[-1]}")
    cu_t, B, T = fla_layout(cu, q.shape[0], M0.shape[0], q.device)
    diag = g.shape[-1] > 1
    g2 = (g.float() * _RCP_LN2).contiguous()

    def fla(x):  # packed [NT, H, ·] -> fla's layout [B, T, H, ·] (B = 1 with cu_seqlens)
        return x.reshape(B, T, *x.shape[1:]).contiguous()

    h0 = M0.to(torch.float32).contiguous()
    if not diag:
        gs = fla(g2[..., 0])
        h, v_new, M = fwd_h(fla(w), fla(kw), fla(vu), g=gs, initial_state=h0, output_final_state=True,
                            chunk_size=C, cu_seqlens=cu_t)
        o = chunk_fwd_o(fla(q), fla(w), v_new, h, g=gs, scale=1.0, cu_seqlens=cu_t, chunk_size=C)
    else:
        last = chunk_last_index(cu, C, q.device, q.shape[0], M0.shape[0])
        w_end = w * torch.exp(g[last] - g).to(w.dtype)  # Φ_CΦ_i⁻¹ w_i (always ≤ 1: no overflow)
        gk = fla(g2)
        h, v_new, M = fwd_h(fla(w_end), fla(kw), fla(vu), gk=gk, initial_state=h0, output_final_state=True,
                            chunk_size=C, cu_seqlens=cu_t)
        A = chunk_gla_fwd_intra_gk(fla(q), fla(w), gk, 1.0, cu_seqlens=cu_t, chunk_size=C)
        o = chunk_gla_fwd_o_gk(fla(q), v_new, gk, A, h, 1.0, cu_seqlens=cu_t, chunk_size=C)
    return o.reshape(q.shape[0], *o.shape[2:]).to(q.dtype), M.to(M0.dtype)


# ---------------------------------------------------------------------------------------------------
# Backward (docs/theory.md §6.4): fla's GDN backward kernels on the substituted tensors, their twins, and
# the adjoint of the substitution.
# ---------------------------------------------------------------------------------------------------


def _check_fla(chunk_size, cu_seqlens, states=(), **xs):
    """Validate a twin's fla-layout arguments: tensors ``[B, T, H, ·]`` sharing B and T (``states``: the
    names of ``[B, NC, H, K, V]`` per-chunk states), a positive chunk size, and packed ``cu_seqlens``."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    ref = None
    for name, x in xs.items():
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
        if name in states:
            if x.dim() != 5:
                raise ValueError(f"{name} must be per-chunk states [B, NC, H, K, V], got {tuple(x.shape)}")
            continue
        if x.dim() < 3:
            raise ValueError(f"{name} must be [B, T, H, ...] (fla's layout), got {tuple(x.shape)}")
        if ref is None:
            ref = (name, x.shape[:2])
        elif x.shape[:2] != ref[1]:
            raise ValueError(f"{name} must share {ref[0]}'s [B, T] = {tuple(ref[1])}, got {tuple(x.shape)}")
    if cu_seqlens is not None and ref is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or ref[1][0] != 1:
            raise ValueError("cu_seqlens must be a 1-D offsets tensor with packed inputs (B = 1)")
        c = cu_seqlens.tolist()
        if not c or c[0] != 0 or c[-1] != ref[1][1] or any(b < a for a, b in zip(c[:-1], c[1:], strict=True)):
            raise ValueError(f"cu_seqlens must rise from 0 to T={ref[1][1]}, got {c}")


def _chunks(B: int, T: int, C: int, cu_seqlens):
    """``(b, slice, n, j)`` for every chunk in fla's order (j: its index in fla's ``h``/``dh``; n: its sequence)."""
    if cu_seqlens is None:
        seqs = [(b, b, 0, T) for b in range(B)]
    else:
        c = cu_seqlens.tolist()
        seqs = [(0, n, a, e) for n, (a, e) in enumerate(zip(c[:-1], c[1:], strict=True))]
    j = {}
    for b, n, a, e in seqs:
        for s in range(a, e, C):
            j[b] = j.get(b, -1) + 1
            yield b, slice(s, min(s + C, e)), n, j[b]


def _causal_chunks(B: int, T: int, C: int, cu_seqlens, dtype: torch.dtype, device):
    """``(b, slice, n, low)`` for every chunk of :func:`_chunks`: ``n`` its length, ``low`` ``[n, 1, n]`` the causal
    mask ``[t, ·, i] = 1`` for ``i ≤ t`` of its intra-chunk ``[t, H, i]`` matrices."""
    for b, t, _, _ in _chunks(B, T, C, cu_seqlens):
        n = t.stop - t.start
        yield b, t, n, torch.tril(torch.ones(n, n, dtype=dtype, device=device))[:, None, :]


def bwd_dv_local_reference(q, k, do, g=None, scale=1.0, cu_seqlens=None, chunk_size=64):
    """Plain-PyTorch twin of fla's ``chunk_bwd_dv_local`` (scalar gate ``g`` [B, T, H], log2).

    Per chunk, the intra-chunk part of ``dv``: ``dv_i = Σ_{t ≥ i} scale·(k_i·q_t)·2^{g_t − g_i} do_t``.
    """
    _check_fla(chunk_size, cu_seqlens, q=q, k=k, do=do, g=g)
    B, T, H, _ = k.shape
    acc = _acc_dtype(k)
    dv = torch.zeros_like(do)
    for b, t, _, _ in _chunks(B, T, chunk_size, cu_seqlens):
        A = torch.einsum("ihk,thk->hit", k[b, t].to(acc), q[b, t].to(acc)) * scale  # [H, i, t]
        if g is not None:
            gt = g[b, t].to(acc).transpose(0, 1)  # [H, c]
            A = A * torch.exp2(gt[:, None, :] - gt[:, :, None])
        A = torch.triu(A)  # i ≤ t
        dv[b, t] = torch.einsum("hit,thv->ihv", A.to(do.dtype).to(acc), do[b, t].to(acc)).to(do.dtype)
    return dv


def bwd_dhu_reference(q, k, w, do, dv, g=None, gk=None, h0=None, dht=None, scale=1.0, cu_seqlens=None,
                      chunk_size=64):
    """Plain-PyTorch twin of fla's ``chunk_gated_delta_rule_bwd_dhu`` (``state_v_first=False``).

    Reverse over each sequence's chunks, ``dh`` the adjoint of the chunk's END state (stored per chunk)::

        dv2 = 2^{g_last − g} ⊙ (k dh) + dv ;   dh ← 2^{g_last} dh + scale·(2^{g} ⊙ q)ᵀ do − wᵀ dv2

    (per-channel ``gk``: ``dv2 = k dh + dv``, ``dh ← diag(2^{gk_last}) dh + scale·qᵀ do − wᵀ dv2``:
    fla then neither rescales k nor q).  Returns ``(dh [B, NC, H, K, V], dh0 [N, H, K, V] float32
    or None, dv2 [B, T, H, V])``; ``dh0`` is returned only when ``h0`` is given, as fla does.
    """
    _check_fla(chunk_size, cu_seqlens, q=q, k=k, w=w, do=do, dv=dv, g=g, gk=gk)
    B, T, H, K = q.shape
    V = do.shape[-1]
    acc = _acc_dtype(q)
    C = chunk_size
    chunks = list(_chunks(B, T, C, cu_seqlens))
    n_seq = B if cu_seqlens is None else cu_seqlens.numel() - 1
    NC = max([j + 1 for _, _, _, j in chunks] + [0])
    dh = q.new_zeros(B, NC, H, K, V)
    dh0 = torch.zeros(n_seq, H, K, V, dtype=acc, device=q.device) if h0 is not None else None
    dv2 = torch.zeros_like(dv)
    for n in range(n_seq):
        mine = [c for c in chunks if c[2] == n]
        b_dh = (dht[n].to(acc) if dht is not None else torch.zeros(H, K, V, dtype=acc, device=q.device))
        for b, t, _, j in reversed(mine):
            dh[b, j] = b_dh.to(dh.dtype)
            kt, qt, wt = k[b, t].to(acc), q[b, t].to(acc), w[b, t].to(acc)
            x = torch.einsum("chk,hkv->chv", kt, b_dh.to(k.dtype).to(acc))
            if g is not None:
                gt = g[b, t].to(acc)  # [c, H]
                x = x * torch.exp2(gt[-1] - gt)[..., None]
                b_dh = b_dh * torch.exp2(gt[-1])[:, None, None]
                qt = qt * torch.exp2(gt)[..., None]
            if gk is not None:
                b_dh = b_dh * torch.exp2(gk[b, t].to(acc)[-1])[..., None]
            d = x + dv[b, t].to(acc)
            dv2[b, t] = d.to(dv.dtype)
            b_dh = (b_dh + scale * torch.einsum("chk,chv->hkv", qt, do[b, t].to(acc))
                    - torch.einsum("chk,chv->hkv", wt, d.to(w.dtype).to(acc)))
        if dh0 is not None:
            dh0[n] = b_dh
    return dh, dh0, dv2


def bwd_dqkwg_reference(q, k, v, do, h, dh, w=None, g=None, dv=None, scale=1.0, cu_seqlens=None, chunk_size=64):
    """Plain-PyTorch twin of fla's ``chunk_bwd_dqkwg`` (scalar gate ``g`` [B, T, H], log2; ``v`` = v_new).

    Per chunk, ``h`` its start state and ``dh`` the adjoint of its end state::

        dq = scale·2^{g} ⊙ (do hᵀ) + dS k,   dk = 2^{g_last − g} ⊙ (v dhᵀ) + dSᵀ q,   dw = −dv hᵀ
        dS_ti = scale·(do_t·v_i)·2^{g_t − g_i} (i ≤ t)
        dg_t = q_t·dq_t − k_t·dk_t  (+ Σ h⊙dh·2^{g_last} + Σ_i k_i·(v dhᵀ)_i 2^{g_last − g_i} at the last row)

    ``dg`` is the adjoint of the chunk-local cumulative gate in NATURAL log units (fla's kernels
    drop the ln 2 of ``exp2``; fla's caller reverse-cumsums it), float32, ``[B, T, H]``.
    Returns ``(dq, dk, dw or None, dg or None)``.
    """
    _check_fla(chunk_size, cu_seqlens, ("h", "dh"), q=q, k=k, v=v, do=do, h=h, dh=dh, w=w, g=g, dv=dv)
    B, T, H, K = q.shape
    acc = _acc_dtype(q)
    dq, dk = torch.zeros_like(q), torch.zeros_like(k)
    dw = torch.zeros_like(w) if w is not None else None
    dg = torch.zeros(B, T, H, dtype=acc, device=q.device) if g is not None else None
    for b, t, _, j in _chunks(B, T, chunk_size, cu_seqlens):
        hj, dhj = h[b, j].to(acc), dh[b, j].to(acc)  # [H, K, V]
        qt, kt, vt, dot = q[b, t].to(acc), k[b, t].to(acc), v[b, t].to(acc), do[b, t].to(acc)
        bq = torch.einsum("chv,hkv->chk", dot, hj)
        bk = torch.einsum("chv,hkv->chk", vt, dhj)
        dS = torch.einsum("thv,ihv->hti", dot, vt)  # [H, t, i]
        if w is not None and dv is not None:
            dw[b, t] = (-torch.einsum("chv,hkv->chk", dv[b, t].to(acc), hj)).to(dw.dtype)
        if g is not None:
            gt = g[b, t].to(acc)  # [c, H]
            gl = gt[-1]
            last = (hj * dhj).sum((-2, -1)) * torch.exp2(gl)
            bq = bq * torch.exp2(gt)[..., None] * scale
            bk = bk * torch.exp2(gl - gt)[..., None]
            last = last + (bk * kt).sum((0, 2))
            gT = gt.transpose(0, 1)
            dS = dS * torch.exp2(gT[:, :, None] - gT[:, None, :])
        else:
            bq = bq * scale
        dS = torch.tril(dS) * scale
        bq = bq + torch.einsum("hti,ihk->thk", dS, kt)
        bk = bk + torch.einsum("hti,thk->ihk", dS, qt)
        dq[b, t], dk[b, t] = bq.to(dq.dtype), bk.to(dk.dtype)
        if g is not None:
            dgt = (bq * qt).sum(-1) - (bk * kt).sum(-1)
            dgt[-1] = dgt[-1] + last
            dg[b, t] = dgt
    return dq, dk, dw, (dg.float() if dg is not None and acc == torch.float32 else dg)


def _check_packed(**xs):
    for name, x in xs.items():
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a packed [NT, H', ·] tensor, got {getattr(x, 'shape', type(x).__name__)}")


def _check_like(name: str, x, ref: torch.Tensor, ref_name: str):
    if not isinstance(x, torch.Tensor) or x.shape != ref.shape:
        raise ValueError(f"{name} must have {ref_name}'s shape {tuple(ref.shape)}, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")


def local_cumsum_reference(g, chunk_size, reverse=False, cu_seqlens=None, **_):
    """Plain-PyTorch twin of fla's ``chunk_local_cumsum`` (``[B, T, H(, K)]``, per chunk; float32 out,
    float64 kept)."""
    _check_fla(chunk_size, cu_seqlens, g=g)
    B, T = g.shape[:2]
    out = torch.zeros_like(g, dtype=_acc_dtype(g))
    for b, t, _, _ in _chunks(B, T, chunk_size, cu_seqlens):
        x = g[b, t].to(out.dtype)
        out[b, t] = torch.flip(torch.cumsum(torch.flip(x, (0,)), 0), (0,)) if reverse else torch.cumsum(x, 0)
    return out


def _ratio(gt):  # [c, H, K] per-channel log2 gates -> 2^{g_t − g_i} [H, t, i, K]
    gT = gt.transpose(0, 1)
    return torch.exp2(gT[:, :, None, :] - gT[:, None, :, :])


def gla_fwd_intra_gk_reference(q, k, g, scale, cu_seqlens=None, chunk_size=64):
    """Plain-PyTorch twin of fla's ``chunk_gla_fwd_intra_gk``: ``A[t, i] = scale·Σ_d q_td k_id 2^{g_td − g_id}``
    (i ≤ t, i chunk-local), ``[B, T, H, BT]`` float32 (zero above the diagonal, where fla leaves it unset)."""
    _check_fla(chunk_size, cu_seqlens, q=q, k=k, g=g)
    B, T, H, _ = q.shape
    acc = _acc_dtype(q)
    A = torch.zeros(B, T, H, chunk_size, dtype=acc, device=q.device)
    for b, t, n, low in _causal_chunks(B, T, chunk_size, cu_seqlens, acc, q.device):
        a = torch.einsum("thd,ihd,htid->thi", q[b, t].to(acc), k[b, t].to(acc), _ratio(g[b, t].to(acc))) * scale
        A[b, t, :, :n] = a * low
    return A


def kda_bwd_dAv_reference(q, k, v, do, A=None, scale=1.0, cu_seqlens=None, chunk_size=64):
    """Plain-PyTorch twin of fla's ``chunk_kda_bwd_dAv`` given ``A``: ``dA[t, i] = scale·do_t·v_i`` (i ≤ t)
    ``[B, T, H, BT]`` float32, and ``dv_i = Σ_{t ≥ i} A[t, i] do_t``."""
    _check_fla(chunk_size, cu_seqlens, q=q, k=k, v=v, do=do, A=A)
    B, T, H, _ = do.shape
    acc = _acc_dtype(do)
    dA = torch.zeros(B, T, H, chunk_size, dtype=acc, device=do.device)
    dv = torch.zeros_like(do)
    for b, t, n, low in _causal_chunks(B, T, chunk_size, cu_seqlens, acc, do.device):
        dot, vt = do[b, t].to(acc), v[b, t].to(acc)
        dA[b, t, :, :n] = torch.einsum("thv,ihv->thi", dot, vt) * low * scale
        At = A[b, t, :, :n].to(acc) * low
        dv[b, t] = torch.einsum("thi,thv->ihv", At.to(do.dtype).to(acc), dot).to(dv.dtype)
    return dA, dv


def gla_bwd_dqk_intra_reference(q, k, g, dA, cu_seqlens=None, chunk_size=64):
    """Plain-PyTorch twin of fla's ``chunk_gla_bwd_dqk_intra``: the adjoint of ``A`` (no scale: dA carries it)::

        dq_t = Σ_{i ≤ t} dA[t, i] 2^{g_t − g_i} ⊙ k_i ,   dk_i = Σ_{t ≥ i} dA[t, i] 2^{g_t − g_i} ⊙ q_t

    Returns ``(dq, dk)`` float32 ``[B, T, H, K]``."""
    _check_fla(chunk_size, cu_seqlens, q=q, k=k, g=g, dA=dA)
    B, T, H, K = q.shape
    acc = _acc_dtype(q)
    dq = torch.zeros(B, T, H, K, dtype=acc, device=q.device)
    dk = torch.zeros_like(dq)
    for b, t, n, low in _causal_chunks(B, T, chunk_size, cu_seqlens, acc, q.device):
        dAt = dA[b, t, :, :n].to(acc) * low
        R = _ratio(g[b, t].to(acc))  # [H, t, i, K]
        dq[b, t] = torch.einsum("thi,htik,ihk->thk", dAt, R, k[b, t].to(acc))
        dk[b, t] = torch.einsum("thi,htik,thk->ihk", dAt, R, q[b, t].to(acc))
    return dq, dk


def gla_bwd_dqkg_reference(q, k, v, h, g, do, dh, dq, dk, scale=1.0, cu_seqlens=None, chunk_size=64):
    """Plain-PyTorch twin of fla's ``chunk_gla_bwd_dqkg`` (per-channel log2 gate ``g`` ``[B, T, H, K]``)::

        dq2 = dq + scale·2^{g} ⊙ (do hᵀ) ,   dk2 = dk + 2^{g_last − g} ⊙ (v dhᵀ)
        dg  = revcumsum_t(q ⊙ dq2 − k ⊙ dk2) + 2^{g_last} ⊙ Σ_v h⊙dh + Σ_t k ⊙ 2^{g_last − g} ⊙ (v dhᵀ)

    ``dg`` is the adjoint of the PER-TOKEN gate (fla folds the reverse cumsum in), natural-log units."""
    _check_fla(chunk_size, cu_seqlens, ("h", "dh"), q=q, k=k, v=v, h=h, g=g, do=do, dh=dh, dq=dq, dk=dk)
    B, T, H, K = q.shape
    acc = _acc_dtype(q)
    dq2, dk2 = torch.zeros_like(dq), torch.zeros_like(dk)
    dg = torch.zeros(B, T, H, K, dtype=acc, device=q.device)
    for b, t, _, j in _chunks(B, T, chunk_size, cu_seqlens):
        hj, dhj = h[b, j].to(acc), dh[b, j].to(acc)
        qt, kt, gt = q[b, t].to(acc), k[b, t].to(acc), g[b, t].to(acc)
        gn = gt[-1]  # [H, K]
        bq = torch.einsum("chv,hkv->chk", do[b, t].to(acc), hj) * scale * torch.exp2(gt)
        bk = torch.einsum("chv,hkv->chk", v[b, t].to(acc), dhj) * torch.exp2(gn - gt)
        dgk = (hj * dhj).sum(-1) * torch.exp2(gn) + (bk * kt).sum(0)
        bq, bk = bq + dq[b, t].to(acc), bk + dk[b, t].to(acc)
        x = qt * bq - kt * bk
        dg[b, t] = torch.flip(torch.cumsum(torch.flip(x, (0,)), 0), (0,)) + dgk
        dq2[b, t], dk2[b, t] = bq.to(dq2.dtype), bk.to(dk2.dtype)
    return dq2, dk2, dg.to(g.dtype)


# the fla kernels the backward calls, by fla's names, and their twins
FLA_BACKWARD_KERNELS = {
    "chunk_gated_delta_rule_fwd_h": "fla.ops.common.chunk_delta_h",
    "chunk_gated_delta_rule_bwd_dhu": "fla.ops.common.chunk_delta_h",
    "chunk_bwd_dv_local": "fla.ops.common.chunk_o",
    "chunk_bwd_dqkwg": "fla.ops.common.chunk_o",
    "chunk_local_cumsum": "fla.ops.utils",
    "chunk_gla_fwd_intra_gk": "fla.ops.gla.chunk",
    "chunk_kda_bwd_dAv": "fla.ops.kda.chunk_bwd",
    "chunk_gla_bwd_dqk_intra": "fla.ops.gla.chunk",
    "chunk_gla_bwd_dqkg": "fla.ops.gla.chunk",
}
TWIN_KERNELS = {
    "chunk_gated_delta_rule_fwd_h": fwd_h_reference,
    "chunk_gated_delta_rule_bwd_dhu": bwd_dhu_reference,
    "chunk_bwd_dv_local": bwd_dv_local_reference,
    "chunk_bwd_dqkwg": bwd_dqkwg_reference,
    "chunk_local_cumsum": local_cumsum_reference,
    "chunk_gla_fwd_intra_gk": gla_fwd_intra_gk_reference,
    "chunk_kda_bwd_dAv": kda_bwd_dAv_reference,
    "chunk_gla_bwd_dqk_intra": gla_bwd_dqk_intra_reference,
    "chunk_gla_bwd_dqkg": gla_bwd_dqkg_reference,
}
# fla 0.6.0's kernels that do not run under the Triton 3.9 interpreter (``i_t.to(tl.int64)`` on a Python int)
NOT_INTERPRETABLE = ("chunk_gated_delta_rule_fwd_h", "chunk_gated_delta_rule_bwd_dhu")
_SCALAR_NEEDS = ("chunk_gated_delta_rule_fwd_h", "chunk_gated_delta_rule_bwd_dhu", "chunk_bwd_dv_local",
                 "chunk_bwd_dqkwg", "chunk_local_cumsum")
_DIAG_NEEDS = ("chunk_gated_delta_rule_fwd_h", "chunk_gated_delta_rule_bwd_dhu", "chunk_bwd_dqkwg",
               "chunk_gla_fwd_intra_gk", "chunk_kda_bwd_dAv", "chunk_gla_bwd_dqk_intra", "chunk_gla_bwd_dqkg")


def mean_pass_fla_backward(q, w, kw, vu, g, M0, cu, C: int, do, dM=None, *, fwd_h=None, dhu=None,
                           kernels=None):
    """Adjoint of :func:`mean_pass_fla` on fla's GDN (scalar decay) or GLA/KDA + GDN (diagonal) backward kernels.

    Inputs as :func:`mean_pass_fla` (packed ``[NT, H', ·]``, g ``[NT, H', Da]`` chunk-local cumulative,
    M0 ``[N, H', D, m]``), ``do`` the adjoint of ``o`` ``[NT, H', m]``, ``dM`` that of the final state
    (None: zero).  Returns ``(dq, dw, dkw, dvu, dlog_alpha, dM0)`` in the inputs' dtypes (fla accumulates
    in float32), where ``dlog_alpha`` ``[NT, H', Da]`` is the adjoint of the PER-TOKEN log-decay whose
    chunk-local cumsum is ``g`` (the reverse cumsum fla's backward folds in; :func:`substitution_backward`
    adds the K̃ term).  fla's kernels (base-2 gates ``g/ln 2``, scale 1), scalar decay::

        h, v_new      = chunk_gated_delta_rule_fwd_h(k=w, w=kw, u=vu, g)    # recomputed, as fla's GDN does
        dv            = chunk_bwd_dv_local(q, k=w, do, g)                    # intra-chunk part of d(v_new)
        dh, dM0, dvu  = chunk_gated_delta_rule_bwd_dhu(q, k=w, w=kw, do, dv, g, h0=M0, dht=dM)
        dq, dw, dkw, dg = chunk_bwd_dqkwg(q, k=w, v=v_new, do, h, dh, w=kw, g, dv=dvu)
        dlog_alpha    = chunk_local_cumsum(dg, reverse=True)

    (fla's GDN backward minus its WY step: here w and u are inputs).  Diagonal decay (the forward's
    KDA/GLA mapping, ``w_end = Φ_CΦ_i⁻¹w``, ``gk = g/ln 2``)::

        h, v_new      = chunk_gated_delta_rule_fwd_h(k=w_end, w=kw, u=vu, gk)
        A             = chunk_gla_fwd_intra_gk(q, w, gk)                      # recomputed
        dA, dv        = chunk_kda_bwd_dAv(q, w, v_new, do, A)
        dh, dM0, dvu  = chunk_gated_delta_rule_bwd_dhu(q=γ⊙q, k=w_end, w=kw, do, dv, gk, h0=M0, dht=dM)
        dq, dw        = chunk_gla_bwd_dqk_intra(q, w, gk, dA)
        dq, dw, dlog_alpha = chunk_gla_bwd_dqkg(q, w, v_new, h, gk, do, dh, dq, dw)
        dkw           = chunk_bwd_dqkwg(q, w, v_new, do, h, dh, w=kw, dv=dvu)[2]   # ungated: −dvu hᵀ only

    ``kernels``: ``{fla name: callable}`` replacing any of them (:data:`TWIN_KERNELS` holds the
    plain-PyTorch twins); ``fwd_h=``/``dhu=`` replace the two that do not run under the Triton
    interpreter (:data:`NOT_INTERPRETABLE`).  float64 only when every kernel used is a twin
    (:func:`mean_pass_backward_reference`).
    """
    _check_packed(q=q, w=w, kw=kw, vu=vu, g=g)
    if not isinstance(M0, torch.Tensor) or M0.dim() != 4:
        raise ValueError(f"M0 must be [N, H', D, m], got {getattr(M0, 'shape', type(M0).__name__)}")
    _check_like("do", do, vu, "vu")
    if dM is not None:
        _check_like("dM", dM, M0, "M0")
    D = q.shape[-1]
    if g.shape[-1] not in (1, D) or g.shape[:2] != q.shape[:2]:
        raise ValueError(f"g must be [NT, H', 1] (scalar decay) or [NT, H', D={D}] (diagonal), got {tuple(g.shape)}")
    if isinstance(C, bool) or not isinstance(C, int) or C < 1:
        raise ValueError(f"C must be a positive int, got {C!r}")
    if isinstance(cu, torch.Tensor):
        if cu.dim() != 1 or cu.numel() != M0.shape[0] + 1:
            raise ValueError(f"cu must be {M0.shape[0] + 1} offsets, got a tensor of shape {tuple(cu.shape)}")
    elif cu is None:
        if M0.shape[0] < 1 or q.shape[0] % M0.shape[0]:
            raise ValueError(f"cu=None needs NT={q.shape[0]} tokens in N={M0.shape[0]} sequences of equal length")
    elif not isinstance(cu, (list, tuple)) or len(cu) != M0.shape[0] + 1 or cu[0] != 0 or cu[-1] != q.shape[0]:
        raise ValueError(f"cu must be {M0.shape[0] + 1} offsets from 0 to NT={q.shape[0]}, got {cu!r}")
    if kernels is not None and not (isinstance(kernels, dict) and set(kernels) <= set(FLA_BACKWARD_KERNELS)):
        raise ValueError(f"kernels must be a dict with keys among {sorted(FLA_BACKWARD_KERNELS)}, got {kernels!r}")
    diag = g.shape[-1] > 1 and D > 1
    ks = dict(kernels or {})
    if fwd_h is not None:
        ks["chunk_gated_delta_rule_fwd_h"] = fwd_h
    if dhu is not None:
        ks["chunk_gated_delta_rule_bwd_dhu"] = dhu
    missing = [n for n in (_DIAG_NEEDS if diag else _SCALAR_NEEDS) if n not in ks]
    if missing:
        require_fla()
        if q.dtype == torch.float64:
            raise TypeError("mean_pass_fla_backward: fla keeps its state in float32; float64 needs every kernel "
                            "a twin (mean_pass_backward_reference)")
        if D > MAX_HEAD_DIM:
            raise ValueError(f"fla's bwd_dhu supports key dims up to {MAX_HEAD_DIM}, got D={D}")
        import importlib

        for n in missing:
            ks[n] = getattr(importlib.import_module(FLA_BACKWARD_KERNELS[n]), n)

    acc = _acc_dtype(q)
    cu_t, B, T = fla_layout(cu, q.shape[0], M0.shape[0], q.device)
    common = dict(cu_seqlens=cu_t, chunk_size=C)

    def fla(x):  # packed [NT, H, ·] -> fla's layout [B, T, H, ·] (B = 1 with cu_seqlens)
        return x.reshape(B, T, *x.shape[1:]).contiguous()

    h0 = M0.to(acc).contiguous()
    dht = dM.to(acc).contiguous() if dM is not None else None
    qf, wf, kwf, dof = fla(q), fla(w), fla(kw), fla(do)
    if not diag:
        g2 = fla(g[..., 0].to(acc) * _RCP_LN2)
        h, v_new, _ = ks["chunk_gated_delta_rule_fwd_h"](k=wf, w=kwf, u=fla(vu), g=g2, initial_state=h0,
                                                         output_final_state=False, **common)
        dv = ks["chunk_bwd_dv_local"](q=qf, k=wf, do=dof, g=g2, scale=1.0, **common)
        dh, dM0, dvu = ks["chunk_gated_delta_rule_bwd_dhu"](q=qf, k=wf, w=kwf, do=dof, dv=dv, g=g2, h0=h0, dht=dht,
                                                            scale=1.0, **common)
        dq, dw, dkw, dg = ks["chunk_bwd_dqkwg"](q=qf, k=wf, v=v_new, do=dof, h=h, dh=dh, w=kwf, g=g2, dv=dvu,
                                                scale=1.0, **common)
        dla = ks["chunk_local_cumsum"](dg, reverse=True, **common)[..., None]
    else:
        gk = fla(g.to(acc) * _RCP_LN2)
        last = chunk_last_index(cu, C, q.device, q.shape[0], M0.shape[0])
        w_end = fla(w * torch.exp(g[last] - g).to(w.dtype))
        h, v_new, _ = ks["chunk_gated_delta_rule_fwd_h"](k=w_end, w=kwf, u=fla(vu), gk=gk, initial_state=h0,
                                                         output_final_state=False, **common)
        A = ks["chunk_gla_fwd_intra_gk"](q=qf, k=wf, g=gk, scale=1.0, **common)
        dA, dv = ks["chunk_kda_bwd_dAv"](q=qf, k=wf, v=v_new, do=dof, A=A, scale=1.0, **common)
        qg = fla(q * torch.exp(g).to(q.dtype))
        dh, dM0, dvu = ks["chunk_gated_delta_rule_bwd_dhu"](q=qg, k=w_end, w=kwf, do=dof, dv=dv, gk=gk, h0=h0,
                                                            dht=dht, scale=1.0, **common)
        dq, dw = ks["chunk_gla_bwd_dqk_intra"](q=qf, k=wf, g=gk, dA=dA, **common)
        dq, dw, dla = ks["chunk_gla_bwd_dqkg"](q=qf, k=wf, v=v_new, h=h, g=gk, do=dof, dh=dh, dq=dq, dk=dw, scale=1.0,
                                               **common)
        dkw = ks["chunk_bwd_dqkwg"](q=qf, k=wf, v=v_new, do=dof, h=h, dh=dh, w=kwf, dv=dvu, scale=1.0, **common)[2]
    def packed(x):  # fla's [B, T, H, ·] -> packed [NT, H, ·]
        return x.reshape(q.shape[0], *x.shape[2:])

    return (packed(dq).to(q.dtype), packed(dw).to(w.dtype), packed(dkw).to(kw.dtype), packed(dvu).to(vu.dtype),
            packed(dla).to(g.dtype), dM0.to(M0.dtype))


def mean_pass_backward_reference(q, w, kw, vu, g, M0, cu: list[int], C: int, do, dM=None):
    """The explicit plain-PyTorch twin of :func:`mean_pass_fla_backward`: the same steps on the twins of
    fla's kernels (:data:`TWIN_KERNELS`; no autograd; any float dtype, float64 included).  Tested against
    autograd through :func:`bayeslayer.ops.bayesian_layer.scan.mean_pass_reference`."""
    return mean_pass_fla_backward(q, w, kw, vu, g, M0, cu, C, do, dM, kernels=TWIN_KERNELS)


def substitution_backward(linv, k, v, log_alpha, cu: list[int], C: int, dkw, dvu, dlog_alpha=None):
    """Adjoint of the substitution :func:`bayeslayer.ops.bayesian_layer.scan_triton.substituted_inputs`.

    Forward, per chunk (``L⁻¹`` from the per-token rows ``linv [NT, H', C]``, ``g`` the chunk-local
    cumsum of ``log_alpha [NT, H', Da]``, ``K̃ = e^{g} ⊙ K``)::

        kw = L⁻¹ K̃ ,   vu = L⁻¹ V

    Adjoint (``dkw``, ``dvu``, ``dlog_alpha`` from :func:`mean_pass_fla_backward`; ``dlog_alpha``:
    the mean pass's adjoint of the per-token log-decay, None: zero)::

        dK̃ = L⁻ᵀ dkw ,   dV = L⁻ᵀ dvu ,   dL⁻¹ = tril(dvu Vᵀ + dkw K̃ᵀ)
        dK = e^{g} ⊙ dK̃ ,   dlog_alpha += reverse chunk-local cumsum of Σ_d dK̃ ⊙ K̃
                                          (per channel when diagonal)

    ``dL⁻¹`` is restricted to the lower triangle, diagonal included (the entries L⁻¹ can hold; the
    diagonal is structurally 1 and drops out of a unit-triangular inverse's adjoint downstream).
    The other uses of K̃ (the covariance pass) add their own ``dK̃``.  Returns
    ``(dlinv [NT, H', C], dk [NT, H', D], dv [NT, H', m], dlog_alpha [NT, H', Da])``, arithmetic in
    ``linv``'s dtype.
    """
    from .scan import scan_layout

    _check_packed(linv=linv, k=k, v=v, log_alpha=log_alpha)
    _check_like("dkw", dkw, k, "k")
    _check_like("dvu", dvu, v, "v")
    if dlog_alpha is not None:
        _check_like("dlog_alpha", dlog_alpha, log_alpha, "log_alpha")
    if linv.shape[-1] != C:
        raise ValueError(f"linv must hold C={C} columns per row, got {tuple(linv.shape)}")
    lay = scan_layout(list(cu), C, 1, k.device)  # one chunk per segment: every chunk independent
    NT, dt = k.shape[0], linv.dtype
    Lg = lay.grid(linv, 0.0)  # [1, S, H', C, C]
    g = torch.cumsum(lay.grid(log_alpha.to(dt), 0.0), dim=-2)
    Kt = torch.exp(g) * lay.grid(k.to(dt), 0.0)
    dkw_g, dvu_g = lay.grid(dkw.to(dt), 0.0), lay.grid(dvu.to(dt), 0.0)
    LT = Lg.transpose(-1, -2)
    dKt = LT @ dkw_g
    dV = LT @ dvu_g
    dL = torch.tril(dvu_g @ lay.grid(v.to(dt), 0.0).transpose(-1, -2) + dkw_g @ Kt.transpose(-1, -2))
    dgg = dKt * Kt
    dgg = dgg.sum(-1, keepdim=True) if log_alpha.shape[-1] == 1 else dgg
    dla = lay.scatter(torch.flip(torch.cumsum(torch.flip(dgg, (-2,)), dim=-2), (-2,)), NT)
    if dlog_alpha is not None:
        dla = dla + dlog_alpha.to(dt)
    dK = torch.exp(g) * dKt
    return (lay.scatter(dL, NT).to(linv.dtype), lay.scatter(dK, NT).to(k.dtype), lay.scatter(dV, NT).to(v.dtype),
            dla.to(log_alpha.dtype))
