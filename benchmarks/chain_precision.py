"""Error of the covariance chain against float64, next to the segment scan's, for fp32 and bf16 inputs.

Runs ``bl_chunk_triton`` under Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, set here) on the same inputs
through both Triton paths — ``path="chain"`` (the default: the covariance chain, fla's mean pass) and
``path="scan"`` (the segment scan with its own mean kernel, the forward that was the default before the chain) —
and compares each with the float64 oracle ``bl_recurrent`` on the same (rounded) inputs: the output, the
predictive variance, the final state ``(M, P)`` and the gradient of every input (q, k, v, r², ℓ², α, the initial
``M0``, ``P0`` by its symmetric part) of a fixed random loss.  Error: ``max|x − ref| / max|ref|``.

The ``--prec`` variants are the chain's arithmetic (``chain_triton.PRECISIONS``): ``float64`` (the default for
fp32 inputs: the kernels compute in float64 and hand fp32 on), ``tf32x3`` (the default for bf16 inputs), ``bf16x3``
and ``ieee`` (fp32 work).  The split-precision products are written out in the kernel (``chain_triton._dot``), so
the interpreter computes the rounded operands a GPU multiplies: every variant is measured, not assumed.  What the
interpreter cannot show: fla's own kernels multiply fp32 operands in TF32 on a GPU unless
``TRITON_F32_DEFAULT=ieee`` (the mean pass here is exact fp32).

Every configuration runs on ``--seeds`` draws of the inputs (one row per seed): a comparison of two precisions of
the same order can go either way on one draw.

Regimes (docs/theory.md §6.6): long-memory (α ∈ [0.998, 1], ℓ² ≈ 1e-4) and stress (α ∈ [0.999, 1], ℓ² ≈ 1e-6,
r² ≈ 1e-3, keys in a 16-dim subspace); scalar and diagonal decay.

    python benchmarks/chain_precision.py --T 128 --H 1 --out results/gpu/chain_precision.json   # the record
    python benchmarks/chain_precision.py --T 128 --regimes longmem --decays scalar
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported

import torch  # noqa: E402

QUANTITIES = ("o", "variance", "M", "P", "dq", "dk", "dv", "dr2", "dell2", "dalpha", "dM0", "dP0")


def _inputs(regime: str, T: int, H: int, D: int, m: int, diagonal: bool, seed: int):
    """``(q, k, v, r2, ell2, alpha, M0, P0)`` in float64 (docs/theory.md §6.6's regimes; an initial state)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tests.ops.scan_inputs import regime_inputs

    q, k, v, r2, ell2, alpha = regime_inputs(regime, 1, T, H, D, m, diagonal=diagonal, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    M0 = 0.1 * torch.randn(1, H, D, m, generator=g, dtype=torch.float64)
    X = torch.randn(1, H, D, D, generator=g, dtype=torch.float64) / D ** 0.5
    P0 = X @ X.mT + 0.5 * torch.eye(D, dtype=torch.float64)
    return q, k, v, r2, ell2, alpha, M0, P0


def _run(fn, xs, weights):
    """Outputs ``(o, variance, M, P)`` of ``fn`` and the gradients of ``Σ ⟨w, output⟩`` w.r.t. every input."""
    leaves = [x.detach().clone().requires_grad_(True) for x in xs]
    q, k, v, r2, ell2, alpha, M0, P0 = leaves
    o, var, (M, P) = fn(q, k, v, r2, ell2, alpha, initial_state=(M0, P0), output_final_state=True,
                        return_variance=True)
    outs = (o, var, M, P)
    loss = sum((x.double() * w).sum() for x, w in zip(outs, weights, strict=True))
    grads = list(torch.autograd.grad(loss, leaves))
    grads[-1] = 0.5 * (grads[-1] + grads[-1].mT)  # a covariance's gradient: its symmetric part
    return [x.detach().double() for x in (*outs, *grads)]


def _errors(got, ref) -> dict:
    return {n: ((a - b).abs().max() / b.abs().max()).item() for n, a, b in zip(QUANTITIES, got, ref, strict=True)}


def measure(regime: str, decay: str, dtype: torch.dtype, args, seed: int) -> list[dict]:
    from bayeslayer.ops import bl_recurrent, set_value_checks
    from bayeslayer.ops.bayesian_layer import chain_triton, mean_pass_fla
    from bayeslayer.ops.bayesian_layer.chunk_triton import bl_chunk_triton

    set_value_checks(False)
    xs = _inputs(regime, args.T, args.H, args.D, args.m, decay == "diagonal", seed)
    xs = [x.to(dtype) if i < 6 else x.float() for i, x in enumerate(xs)]  # inputs in the dtype; the state fp32
    g = torch.Generator().manual_seed(seed + 2)
    shapes = [(1, args.T, args.H, args.m), (1, args.T, args.H, 1), (1, args.H, args.D, args.m),
              (1, args.H, args.D, args.D)]
    weights = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    weights[1] = weights[1][..., 0]

    def oracle(q, k, v, r2, ell2, alpha, initial_state, output_final_state, return_variance):
        return bl_recurrent(q, k, v, r2, ell2, alpha, initial_state=initial_state,
                            output_final_state=output_final_state, return_variance=return_variance)

    ref = _run(oracle, [x.double() for x in xs], weights)  # float64 on the same rounded inputs
    rows = []
    variants = [("scan", None)] + [("chain", p) for p in args.prec]
    for path, prec in variants:
        t0 = time.time()
        saved = chain_triton.FP32_PRECISION, chain_triton.HALF_PRECISION
        if prec is not None:  # the arithmetic of this variant, whatever the inputs' dtype
            chain_triton.FP32_PRECISION = chain_triton.HALF_PRECISION = prec

        def fn(*a, _path=path, **kw):
            return bl_chunk_triton(*a, chunk_size=args.C, path=_path, **kw)
        try:
            with mean_pass_fla.one_autotune_config():  # the interpreter cannot benchmark fla's autotune configs
                got = _run(fn, xs, weights)
        finally:
            chain_triton.FP32_PRECISION, chain_triton.HALF_PRECISION = saved
        row = dict(regime=regime, decay=decay, dtype=str(dtype).replace("torch.", ""), seed=seed, path=path,
                   prec="ieee" if path == "scan" else prec,
                   default=path == "chain" and prec == chain_triton.default_precision(dtype, args.D),
                   **_errors(got, ref))
        rows.append(row)
        print(f"{regime:8s} {decay:8s} {row['dtype']:8s} s{seed} {path:5s} {row['prec']:7s} | "
              + " ".join(f"{n} {row[n]:.1e}" for n in QUANTITIES) + f"  ({time.time() - t0:.0f} s)", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--regimes", nargs="+", default=["longmem", "stress"], choices=["longmem", "stress"])
    p.add_argument("--decays", nargs="+", default=["scalar", "diagonal"], choices=["scalar", "diagonal"])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--prec", nargs="+", default=["float64", "tf32x3", "bf16x3", "ieee"],
                   choices=["float64", "tf32x3", "bf16x3", "ieee"],
                   help="the chain's arithmetic variants to measure (chain_triton.PRECISIONS; the scan runs IEEE)")
    p.add_argument("--T", type=int, default=256)
    p.add_argument("--H", type=int, default=2)
    p.add_argument("--D", type=int, default=32)
    p.add_argument("--m", type=int, default=16)
    p.add_argument("--C", type=int, default=32, help="the segment scan's chunk size (the chain runs its own, 32)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="input draws, one row each")
    p.add_argument("--out", help="write the rows as a JSON record here")
    args = p.parse_args(argv)
    for name in ("T", "H", "D", "m"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.D > 128:
        p.error(f"--D must be <= 128 (the chain's key dims), got {args.D}")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    rows = []
    for regime in args.regimes:
        for decay in args.decays:
            for dt in args.dtypes:
                for seed in args.seeds:
                    rows += measure(regime, decay, dtypes[dt], args, seed)
    if args.out:
        from bayeslayer.experiments.common.provenance import write_record

        write_record(args.out, dict(T=args.T, H=args.H, D=args.D, m=args.m, C=args.C, rows=rows),
                     seeds=list(args.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
