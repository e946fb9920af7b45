"""Precision of the segment scan's covariance pass by product precision and hand-off dtype, against float64.

Emulated in PyTorch on the CPU (the Triton interpreter ignores ``input_precision``, so it cannot show what a
GPU's tensor cores would compute): TF32 operands are fp32 rounded to nearest to a 10-bit mantissa, as the
hardware rounds them; ``3xtf32`` splits each operand into a TF32 high part and a TF32 low part and sums the three
products ``hi·hi + (hi·lo + lo·hi)`` in fp32 (what Triton's ``input_precision="tf32x3"`` emits); ``bf16x3`` the
same with bf16 parts.  Scalar decay; the chunk step is the Cholesky form of docs/theory.md §5.2, algebraically the
kernels' LDLᵀ form (``W = βU``, ``Lc = L diag(√d)``).

Phases as :func:`bayeslayer.ops.bayesian_layer.scan_triton.scan_packed` runs them: Phase A (segment elements, from P =
0) with its state in float64; its per-token hand-off to the tracking recursion either float64 (``f64``) or the compute
dtype (``fp32``: W and the ``L⁻¹`` rows stored in fp32, ``L⁻¹(γ⊙K)`` formed by an fp32 product from them, β
recovered as ``(1 − kᵀw)/r²`` from an fp32 dot product, the P-free base of S read from the fp32 prep); Phase B in
float64; Phase C in fp32 with the given product precision.  Reference: the chunk-serial pass in float64.
A bf16 hand-off (W, ``L⁻¹``, ``L⁻¹(γ⊙K)`` and the prep rounded to bf16) is the control: it shows that the
measurement sees what the hand-off's precision does to the segment elements.

Regimes (docs/theory.md §6.6): typical (α ∈ [0.9, 1],
ℓ² ∈ [1e-3, 1.1e-2], r² ∈ [0.1, 1.1]), long-memory (α ∈ [0.998, 1], ℓ² ≈ 1e-4) and stress (α ∈ [0.999, 1],
ℓ² ≈ 1e-6, r² ≈ 1e-3, keys in a 16-dim subspace).  H = 4, T = 4096, D = C = 64, segments of 16 chunks.
Prints the max relative error of β (over every token) and of the final P (max abs / max abs of the reference).

    python benchmarks/scan_precision.py                 # all regimes, all variants (≈ 1–3 min on one core)
    python benchmarks/scan_precision.py stress --T 2048
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

F32, F64 = torch.float32, torch.float64


def tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 rounded to TF32 (10-bit mantissa), round to nearest even on the dropped 13 bits."""
    i = x.contiguous().view(torch.int32)
    i = (i + 0x0FFF + ((i >> 13) & 1)) & ~0x1FFF
    return i.view(F32)


def matmul(mode: str):
    """``a @ b`` in fp64/fp32 (IEEE), or emulated ``tf32``, ``3xtf32``, ``bf16x3`` (fp32 accumulation)."""
    if mode in ("f64", "ieee"):
        return lambda a, b: a @ b
    if mode == "tf32":
        return lambda a, b: tf32(a) @ tf32(b)
    if mode in ("3xtf32", "bf16x3"):
        def split(x):
            hi = tf32(x) if mode == "3xtf32" else x.bfloat16().float()
            lo = x - hi
            return hi, (tf32(lo) if mode == "3xtf32" else lo.bfloat16().float())

        def f(a, b):
            ah, al = split(a)
            bh, bl = split(b)
            return ah @ bh + (ah @ bl + al @ bh)
        return f
    raise ValueError(mode)


def inputs(regime: str, H: int, T: int, D: int):
    """The three regimes' inputs (docs/theory.md §6.6): ``(k, r2, ell2, log_alpha)`` ``[H, T, ·]`` in float64."""
    torch.manual_seed(0)
    f = dict(dtype=F64)
    k = torch.nn.functional.normalize(torch.randn(H, T, D, **f), dim=-1)
    if regime == "typical":
        r2 = 0.1 + torch.rand(H, T, **f)
        l2 = 1e-3 + 0.01 * torch.rand(H, T, **f)
        la = torch.log(0.9 + 0.1 * torch.rand(H, T, **f))
    elif regime == "longmem":
        r2 = 0.1 + torch.rand(H, T, **f)
        l2 = 1e-4 + 1e-4 * torch.rand(H, T, **f)
        la = torch.log(0.998 + 0.002 * torch.rand(H, T, **f))
    elif regime == "stress":
        basis = torch.nn.functional.normalize(torch.randn(16, D, **f), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(H, T, 16, **f) @ basis + 1e-2 * torch.randn(H, T, D, **f),
                                          dim=-1)
        r2 = 1e-3 + 1e-3 * torch.rand(H, T, **f)
        l2 = 1e-6 + 1e-6 * torch.rand(H, T, **f)
        la = torch.log(0.999 + 0.001 * torch.rand(H, T, **f))
    else:
        raise ValueError(f"regime must be typical, longmem or stress, got {regime!r}")
    return k, r2, l2, la


def chunk_consts(k, r2, l2, la):
    """The P-free per-chunk terms (the prep kernel's), ``[H, N, C, ·]``, in the inputs' dtype."""
    C = k.shape[-2]
    g = torch.cumsum(la, -1)
    low = torch.ones(C, C, dtype=torch.bool).tril()
    rho = torch.where(low, torch.exp((g[..., :, None] - g[..., None, :]).clamp(max=0)), 0.0)
    b = (rho * rho * l2[..., None, :]).sum(-1)
    end = torch.exp(g[..., -1:] - g)
    Nl = torch.where(low, (k @ k.transpose(-1, -2)) * rho * b[..., None, :], 0.0)
    base = Nl + Nl.transpose(-1, -2) - torch.diag_embed(torch.diagonal(Nl, dim1=-2, dim2=-1)) + torch.diag_embed(r2)
    gam = torch.exp(g)
    return dict(k=k, r2=r2, rho=rho, gam=gam, end=end, bC=(end * end * l2).sum(-1), gC2=torch.exp(2 * g[..., -1]),
                base=base, Kt=gam[..., None] * k, NBk=b[..., None] * k)


def chunk_step(P, c, i, mm, track=None, handoff=F64):
    """One chunk from P (arithmetic in P's dtype, products by ``mm``); returns ``(P_next, β, track)``.

    ``track = (A, J)``: Phase A's recursion, fed the per-token hand-off in ``handoff``'s dtype."""
    dt = P.dtype
    Kt, base = c["Kt"][:, i].to(dt), c["base"][:, i].to(dt)
    Y = mm(Kt, P)
    S = mm(Y, Kt.transpose(-1, -2)) + base
    Lc = torch.linalg.cholesky(S)
    dc = torch.diagonal(Lc, dim1=-2, dim2=-1)
    X = c["gam"][:, i, :, None].to(dt) * Y + c["NBk"][:, i].to(dt)
    Ub = torch.linalg.solve_triangular(Lc * c["rho"][:, i].to(dt), X, upper=False)  # = √β U
    Ue = Ub * c["end"][:, i, :, None].to(dt)
    eye = torch.eye(P.shape[-1], dtype=dt)
    Pn = c["gC2"][:, i, None, None].to(dt) * P + c["bC"][:, i, None, None].to(dt) * eye - mm(Ue.transpose(-1, -2), Ue)
    Pn = 0.5 * (Pn + Pn.transpose(-1, -2))
    beta = 1.0 / (dc * dc)
    if track is not None:
        A, J = track
        sb = dc.reciprocal()  # √β
        Lu_inv = torch.linalg.solve_triangular(Lc / dc[..., None, :], eye[: Lc.shape[-1], : Lc.shape[-1]]
                                               .expand_as(Lc), upper=False, unitriangular=True)
        W = (sb[..., None] * Ub).to(handoff)  # write keys βU, as stored
        Li = Lu_inv.to(handoff)  # the unit L⁻¹ rows, as stored
        k, r2 = c["k"][:, i], c["r2"][:, i]
        if handoff == F64:
            kw = Li @ Kt
            bt = beta
        else:  # kw by a product in the hand-off dtype, β recovered from an fp32 dot product
            kw = (Li.to(F32) @ Kt.to(F32)).to(handoff).to(dt)
            bt = (1.0 - (k.to(F32) * W.to(F32)).sum(-1).to(dt)) / r2.to(F32).to(dt)
        W = W.to(dt)
        Hm = mm(kw, A)
        A = c["gC2"][:, i, None, None].to(dt).sqrt() * A - mm((W * c["end"][:, i, :, None].to(dt)).transpose(-1, -2),
                                                               Hm)
        J = J + mm(Hm.transpose(-1, -2), bt[..., None] * Hm)
        track = (A, 0.5 * (J + J.transpose(-1, -2)))
    return Pn, beta, track


def combine(A, Cm, J, P):
    """Phase B's step in float64: ``A (I + PJ)⁻¹ P Aᵀ + C`` in the Cholesky form."""
    eye = torch.eye(P.shape[-1], dtype=P.dtype)
    G = torch.linalg.cholesky(P)
    M = eye + G.transpose(-1, -2) @ J @ G
    R = torch.linalg.cholesky(0.5 * (M + M.transpose(-1, -2)))
    Z = torch.linalg.solve_triangular(R, (A @ G).transpose(-1, -2), upper=False).transpose(-1, -2)
    out = Z @ Z.transpose(-1, -2) + Cm
    return 0.5 * (out + out.transpose(-1, -2))


def serial(P0, c, mm):
    P, betas = P0, []
    for i in range(c["Kt"].shape[1]):
        P, beta, _ = chunk_step(P, c, i, mm)
        betas.append(beta)
    return P, torch.stack(betas, 1)


def scan(P0, c64, c32, n_s, *, handoff, mm_c):
    """Phase A (float64 state, ``handoff`` dtype), Phase B (float64), Phase C (fp32, ``mm_c``).

    ``c64``: the float64 prep of the fp32 inputs (what Phase A read before); ``c32``: the fp32 prep, which Phase A
    reads with an fp32 hand-off (every P-free term, decays included, formed in fp32: a little more rounding than
    the kernel, which takes only g, b and the base of S from it and forms ``e^g`` in float64)."""
    H, N = c64["Kt"].shape[:2]
    D = P0.shape[-1]
    eye = torch.eye(D, dtype=F64)
    ca = c64 if handoff == F64 else {name: x.double() for name, x in c32.items()}
    if handoff not in (F64, F32):  # a narrower hand-off (the control) rounds the prep too
        ca = {name: x.to(handoff).double() for name, x in c32.items()}
    starts = [P0.double()]
    for s in range(N // n_s - 1):
        P = torch.zeros(H, D, D, dtype=F64)
        tr = (eye.expand(H, D, D).clone(), torch.zeros(H, D, D, dtype=F64))
        for i in range(s * n_s, (s + 1) * n_s):
            P, _, tr = chunk_step(P, ca, i, matmul("f64"), track=tr, handoff=handoff)
        starts.append(combine(tr[0], P, tr[1], starts[-1]))
    betas = []
    for s in range(N // n_s):
        P = starts[s].float()
        for i in range(s * n_s, (s + 1) * n_s):
            P, beta, _ = chunk_step(P, c32, i, mm_c)
            betas.append(beta)
    return P, torch.stack(betas, 1)


VARIANTS = {  # name: (Phase A hand-off, Phase C products)
    "A f64 hand-off, C ieee (before)": (F64, "ieee"),
    "A fp32 hand-off, C ieee": (F32, "ieee"),
    "A bf16 hand-off, C ieee (control)": (torch.bfloat16, "ieee"),
    "A fp32 hand-off, C 3xtf32": (F32, "3xtf32"),
    "A fp32 hand-off, C bf16x3": (F32, "bf16x3"),
    "A fp32 hand-off, C tf32": (F32, "tf32"),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("regimes", nargs="*", default=["typical", "longmem", "stress"])
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--C", type=int, default=64)
    p.add_argument("--segment-chunks", type=int, default=16)
    p.add_argument("--out", help="write the table as JSON here")
    args = p.parse_args(argv)
    H, T, D, C = args.H, args.T, args.D, args.C
    rows = []
    for regime in args.regimes:
        k, r2, l2, la = inputs(regime, H, T, D)
        shape = lambda x: x.reshape(H, T // C, C, *x.shape[2:])  # noqa: E731
        c64 = chunk_consts(*(shape(x) for x in (k, r2, l2, la)))  # the reference: float64 inputs
        c32 = chunk_consts(*(shape(x).float() for x in (k, r2, l2, la)))  # the fp32 prep, from fp32 inputs
        c64r = chunk_consts(*(shape(x).float().double() for x in (k, r2, l2, la)))  # float64 prep of the fp32 inputs
        P0 = torch.eye(D, dtype=F64).expand(H, D, D).clone()
        t0 = time.time()
        Pref, bref = serial(P0, c64, matmul("f64"))
        for name, (handoff, mm_c) in VARIANTS.items():
            P, b = scan(P0, c64r, c32, args.segment_chunks, handoff=handoff, mm_c=matmul(mm_c))
            row = dict(regime=regime, variant=name, beta=((b.double() - bref).abs() / bref).max().item(),
                       P_T=((P.double() - Pref).abs().max() / Pref.abs().max()).item())
            rows.append(row)
            print(f"{regime:8s} {name:34s} beta {row['beta']:.1e}   P_T {row['P_T']:.1e}", flush=True)
        print(f"  ({time.time() - t0:.0f} s)", flush=True)
    if args.out:
        from bayeslayer.experiments.common.provenance import write_record

        write_record(args.out, dict(H=H, T=T, D=D, C=C, segment_chunks=args.segment_chunks, rows=rows), seeds=[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
