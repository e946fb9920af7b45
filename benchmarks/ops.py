"""CPU throughput of the core ops (prints a table; asserts nothing).

Measures, in one run on this machine:

* tokens/s of ``bl_recurrent`` (the exact oracle), ``bl_chunk`` (the chunked Bayesian
  Layer) and the reset-family Gated DeltaNet chunk path (``GATED_DELTANET.chunk``, the
  same mean-pass machinery without the covariance pass), forward only, fp32,
  B = 1, H = 4, over T ∈ {512, 2048, 8192} and D = m ∈ {32, 64, 128};
* the achieved GFLOP/s of ``bl_chunk`` (nominal flop count of the chunked algorithm,
  see :func:`bl_chunk_flops`) next to this machine's measured ``torch.matmul`` GFLOP/s;
* the target point B=1, H=4, D=m=64, T=4096: bl_chunk vs bl_recurrent and vs
  the GDN chunk path, how the time scales from T=4096 to T=8192, and the forward+backward
  (training step) time of bl_chunk and the GDN chunk path.

Usage: ``python benchmarks/ops.py [--quick] [--threads N] [--markdown]``.
Each timing is the minimum wall time over repeats (after one warm-up call).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from bayeslayer.design import GATED_DELTANET
from bayeslayer.ops import bl_chunk, bl_recurrent, value_checks


def _time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _inputs(T: int, D: int, m: int, H: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, D, generator=g)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, D, generator=g), dim=-1)
    v = torch.randn(1, T, H, m, generator=g)
    r2 = 0.1 + torch.rand(1, T, H, generator=g)
    ell2 = 1e-3 + 0.01 * torch.rand(1, T, H, generator=g)
    alpha = 0.9 + 0.1 * torch.rand(1, T, H, generator=g)
    beta = torch.rand(1, T, H, generator=g).clamp_min(1e-3)
    return q, k, v, r2, ell2, alpha, beta


def bl_chunk_flops(T: int, H: int, D: int, m: int, C: int) -> float:
    """Nominal flops (2 per multiply-add) of the chunked Bayesian Layer, scalar decay, no variance.

    Per chunk and head: covariance pass ``K̃P`` (C·D²), ``S`` (C²·D), noise scores (C²·D),
    ``L⁻¹Y`` and the noise mix (2·C²·D), the ``P`` update (C·D²), Cholesky (C³/3) and the
    triangular inverse (C³/3); mean pass: two C×C score matrices (2·C²·D), the UT transform
    ``(I+T)⁻¹[V, K̃]`` (C²·(m+D)) and its inverse (C³/3), the state reads ``[Q̃; K̃']M`` (2·C·D·m),
    ``A·E`` (C²·m) and the state write (C·D·m).
    """
    n = -(-T // C)
    cov = 2 * C * D * D + 4 * C * C * D + 2 * C**3 / 3
    mean = 2 * C * C * D + C * C * (m + D) + C**3 / 3 + 3 * C * D * m + C * C * m
    return 2.0 * n * H * (cov + mean)


def matmul_gflops(repeats: int) -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    return 2 * 1024**3 / _time(lambda: a @ b, repeats) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats (a smoke run)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--markdown", action="store_true", help="print markdown tables")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 2 if args.quick else 5
    Ts = [512, 2048] if args.quick else [512, 2048, 8192]
    Ds = [32, 64] if args.quick else [32, 64, 128]
    C = args.chunk_size
    sep = " | " if args.markdown else "  "
    mm = matmul_gflops(repeats)
    print(f"# bayeslayer ops benchmark — {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 forward, B=1, H=4, chunk {C}")
    print(f"# torch.matmul 1024x1024 fp32: {mm:.1f} GFLOP/s")
    head = ["T", "D=m", "recurrent tok/s", "bl_chunk tok/s", "GDN chunk tok/s", "chunk/recurrent",
            "BL/GDN time", "bl_chunk GFLOP/s", "% of matmul"]
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    else:
        print(sep.join(f"{h:>16}" for h in head))
    with torch.no_grad(), value_checks(False):
        for D in Ds:
            for T in Ts:
                q, k, v, r2, ell2, alpha, beta = _inputs(T, D, D)
                # the oracle is linear in T: time a prefix of at most 1024 tokens and scale
                Tr = min(T, 1024)
                t_rec = _time(lambda: bl_recurrent(q[:, :Tr], k[:, :Tr], v[:, :Tr], r2[:, :Tr], ell2[:, :Tr],
                                                   alpha[:, :Tr]), 1 if Tr >= 1024 else repeats) * T / Tr
                t_bl = _time(lambda: bl_chunk(q, k, v, r2, ell2, alpha, chunk_size=C), repeats)
                t_gdn = _time(lambda: GATED_DELTANET.chunk(q, k, v, gain=beta, alpha=alpha, chunk_size=C), repeats)
                gf = bl_chunk_flops(T, 4, D, D, C) / t_bl / 1e9
                row = [T, D, f"{T / t_rec:,.0f}", f"{T / t_bl:,.0f}", f"{T / t_gdn:,.0f}", f"{t_rec / t_bl:.1f}x",
                       f"{t_bl / t_gdn:.2f}x", f"{gf:.1f}", f"{100 * gf / mm:.0f}%"]
                if args.markdown:
                    print("| " + " | ".join(str(x) for x in row) + " |")
                else:
                    print(sep.join(f"{x!s:>16}" for x in row))
        # the target point
        q, k, v, r2, ell2, alpha, beta = _inputs(4096, 64, 64)
        q2, k2, v2, r22, ell22, alpha2, _ = _inputs(8192, 64, 64)
        t_rec = _time(lambda: bl_recurrent(q, k, v, r2, ell2, alpha), 1)
        t_bl = _time(lambda: bl_chunk(q, k, v, r2, ell2, alpha, chunk_size=C), repeats)
        t_gdn = _time(lambda: GATED_DELTANET.chunk(q, k, v, gain=beta, alpha=alpha, chunk_size=C), repeats)
        t_bl2 = _time(lambda: bl_chunk(q2, k2, v2, r22, ell22, alpha2, chunk_size=C), repeats)
    # training step cost: forward + backward (gradients of every input), same point
    with value_checks(False):
        leaves = [x.requires_grad_(True) for x in (q, k, v, r2, ell2, alpha, beta)]

        def fwd_bwd(fn):
            def run():
                for x in leaves:
                    x.grad = None
                fn().sum().backward()
            return run

        t_bl_fb = _time(fwd_bwd(lambda: bl_chunk(q, k, v, r2, ell2, alpha, chunk_size=C)[0]), repeats)
        t_gdn_fb = _time(fwd_bwd(lambda: GATED_DELTANET.chunk(q, k, v, gain=beta, alpha=alpha, chunk_size=C).o),
                         repeats)
    print()
    print("# target point B=1, H=4, D=m=64, T=4096, fp32 forward (full-length recurrent run)")
    print(f"bl_recurrent {t_rec * 1e3:.1f} ms | bl_chunk {t_bl * 1e3:.1f} ms | GDN chunk {t_gdn * 1e3:.1f} ms")
    print(f"bl_chunk speed-up over bl_recurrent: {t_rec / t_bl:.1f}x (target >= 20x)")
    print(f"bl_chunk / GDN chunk time: {t_bl / t_gdn:.2f}x (target <= 2.5x)")
    print(f"bl_chunk T=8192 / T=4096 time: {t_bl2 / t_bl:.2f}x (linear scaling = 2.00x)")
    print(f"forward+backward: bl_chunk {t_bl_fb * 1e3:.1f} ms | GDN chunk {t_gdn_fb * 1e3:.1f} ms | "
          f"BL/GDN {t_bl_fb / t_gdn_fb:.2f}x")


if __name__ == "__main__":
    main()
