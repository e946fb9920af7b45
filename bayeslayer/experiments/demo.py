"""``bayeslayer demo``: a seconds-long check that the chunked layer equals the exact filter.

Runs the Bayesian Layer on random inputs with the token-by-token oracle and the
chunked path, prints their agreement, the throughput of each and the predictive
variance range.  No downloads, no training.  Python: ``run(DemoConfig(T=64)) -> record``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from ..ops import bl_chunk, bl_recurrent
from ..training.distributed import resolve_device
from .common.options import DEVICE_HELP, check_int, check_memory, device_arg, positive_int_arg
from .common.threads import SMALL, add_threads_option

DESCRIPTION = (
    "Run the Bayesian Layer on random float64 inputs twice, token by token (the "
    "exact Kalman filter) and with the chunked path, and print their largest "
    "difference in outputs and final state, the time of each and the range of the "
    "predictive variance. No downloads, no training, no files written."
)


@dataclass(frozen=True)
class DemoConfig:
    """Sizes of the demo: sequence length ``T``, key dim ``D``, value dim ``m``, heads ``H``; ``seed`` of the
    random inputs; ``device`` where both paths run (``cpu``, ``cuda``, ``cuda:N``, ``auto``).  Every field
    is checked here, with its name in the error."""

    T: int = 512
    D: int = 32
    m: int = 32
    H: int = 2
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self):
        for name in ("T", "D", "m", "H"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("seed", self.seed, minimum=0)
        object.__setattr__(self, "device", str(resolve_device(self.device, option="device")))


def run(config: DemoConfig) -> dict:
    """Both paths on the same random float64 inputs: their largest output and state differences, their
    times and the predictive variance range (the record the command prints)."""
    if not isinstance(config, DemoConfig):
        raise TypeError(f"config must be a DemoConfig, got {type(config).__name__}")
    T, D, m, H = config.T, config.D, config.m, config.H
    # float64 inputs (q, k, v, r2, ell2, alpha) and both paths' outputs and variances, at the least
    check_memory(8 * T * H * (2 * D + m + 3 + 2 * (m + 1)), what=f"the demo at T={T}, H={H}, D={D}, m={m}")
    g = torch.Generator().manual_seed(config.seed)
    q = torch.randn(1, T, H, D, generator=g, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, D, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, H, m, generator=g, dtype=torch.float64)
    r2 = 0.05 + torch.rand(1, T, H, generator=g, dtype=torch.float64)
    ell2 = 0.01 * torch.rand(1, T, H, generator=g, dtype=torch.float64) + 1e-3
    alpha = 0.9 + 0.1 * torch.rand(1, T, H, generator=g, dtype=torch.float64)
    q, k, v, r2, ell2, alpha = (x.to(config.device) for x in (q, k, v, r2, ell2, alpha))
    sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)  # GPU work is timed when it has finished
    t0 = time.perf_counter()
    o_r, var_r, (M_r, P_r) = bl_recurrent(q, k, v, r2, ell2, alpha, output_final_state=True, return_variance=True)
    sync()
    t1 = time.perf_counter()
    o_c, var_c, (M_c, P_c) = bl_chunk(q, k, v, r2, ell2, alpha, output_final_state=True, return_variance=True)
    sync()
    t2 = time.perf_counter()
    return {
        "T": T, "D": D, "m": m, "H": H,
        "max_abs_diff_output": (o_r - o_c).abs().max().item(),
        "max_abs_diff_state": max((M_r - M_c).abs().max().item(), (P_r - P_c).abs().max().item()),
        "recurrent_s": t1 - t0, "chunk_s": t2 - t1,
        "variance_min": var_c.min().item(), "variance_max": var_c.max().item(),
    }


def config_from_args(args) -> DemoConfig:
    """The :class:`DemoConfig` that ``bayeslayer demo`` arguments name."""
    return DemoConfig(T=args.length, device=args.device)


def _main(args) -> int:
    r = run(config_from_args(args))
    print(f"Bayesian Layer, T={r['T']}, H={r['H']}, D={r['D']}, m={r['m']} (float64)")
    print(f"  chunked vs exact filter: max |Δo| = {r['max_abs_diff_output']:.2e}, "
          f"max |Δstate| = {r['max_abs_diff_state']:.2e}")
    print(f"  time: recurrent {r['recurrent_s']:.3f}s, chunked {r['chunk_s']:.3f}s "
          f"({r['recurrent_s'] / max(r['chunk_s'], 1e-9):.1f}x)")
    print(f"  predictive variance 1 + qᵀPq in [{r['variance_min']:.3f}, {r['variance_max']:.3f}]")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="seconds-long check: chunked Bayesian Layer == exact Kalman filter",
                       description=DESCRIPTION)
    p.add_argument("--length", type=positive_int_arg, default=512, metavar="T", help="sequence length T")
    p.add_argument("--T", dest="length", type=positive_int_arg, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--device", type=device_arg, default="cpu", help=DEVICE_HELP)
    add_threads_option(p, SMALL)
    p.set_defaults(func=_main)
