"""Context parallelism on the CPU: 1 vs 2 vs 4 ranks on one long sequence (prints a table; asserts nothing).

Every rank is a process of a gloo group started here (``torch.multiprocessing.spawn``); it times one
forward + backward of ``bl_chunk(..., cp_context=ctx)`` on its slice (minimum over repeats, after a
warm-up, behind a barrier) and counts the bytes it handed to collectives (``ctx.comm_bytes``).  One
rank is the plain one-process ``bl_chunk`` on the whole sequence.  The ranks share this machine's
cores: with fewer free cores than ranks the times measure contention, not the speed-up a machine per
rank would give (the table prints the core count).

Usage: ``python benchmarks/cp.py [--T 8192] [--H 2] [--D 32] [--ranks 1 2 4] [--json results/cp/cp_cpu.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _inputs(T: int, H: int, D: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, D, generator=g) * D**-0.5
    k = torch.nn.functional.normalize(torch.randn(1, T, H, D, generator=g), dim=-1)
    v = torch.randn(1, T, H, D, generator=g)
    r2 = 0.1 + torch.rand(1, T, H, generator=g)
    ell2 = 1e-3 + 0.01 * torch.rand(1, T, H, generator=g)
    alpha = 0.9 + 0.1 * torch.rand(1, T, H, generator=g)
    return dict(q=q, k=k, v=v, r2=r2, ell2=ell2, alpha=alpha)


def _step(x: dict, a: int, b: int, ctx, chunk_size: int) -> None:
    from bayeslayer.ops import bl_chunk

    loc = {n: t[:, a:b].clone().requires_grad_() for n, t in x.items()}
    o, _ = bl_chunk(
        loc["q"],
        loc["k"],
        loc["v"],
        loc["r2"],
        loc["ell2"],
        alpha=loc["alpha"],
        chunk_size=chunk_size,
        cp_context=ctx,
        backend="torch",
    )
    o.square().mean().backward()


def _worker(rank: int, world: int, init_file: str, out_dir: str, args: dict) -> None:
    from bayeslayer.ops import build_cp_context

    torch.set_num_threads(args["threads"])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        T = args["T"]
        x = _inputs(T, args["H"], args["D"])
        ctx = build_cp_context(total_len=T)
        a, b = ctx.bounds[rank], ctx.bounds[rank + 1]
        _step(x, a, b, ctx, args["C"])
        best = float("inf")
        for _ in range(args["repeats"]):
            dist.barrier()
            ctx.reset_comm()
            t0 = time.perf_counter()
            _step(x, a, b, ctx, args["C"])
            best = min(best, time.perf_counter() - t0)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"seconds": best, "bytes": dict(ctx.comm_bytes)}))
    finally:
        dist.destroy_process_group()


def _one_process(args: dict) -> float:
    torch.set_num_threads(args["threads"])
    x = _inputs(args["T"], args["H"], args["D"])
    _step(x, 0, args["T"], None, args["C"])
    best = float("inf")
    for _ in range(args["repeats"]):
        t0 = time.perf_counter()
        _step(x, 0, args["T"], None, args["C"])
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--H", type=int, default=2)
    p.add_argument("--D", type=int, default=32, help="key dim = value dim")
    p.add_argument("--C", type=int, default=64, help="chunk size")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", type=Path, default=None, help="write the numbers here")
    a = p.parse_args()
    args = dict(T=a.T, H=a.H, D=a.D, C=a.C, repeats=a.repeats, threads=a.threads)
    from bayeslayer.ops.bayesian_layer.cp import comm_bytes_per_call

    rows = []
    for R in a.ranks:
        if R == 1:
            rows.append(
                dict(
                    ranks=1, seconds_per_rank=[_one_process(args)], bytes_forward=0, bytes_received=0, bytes_backward=0
                )
            )
            continue
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(R, str(Path(tmp, "init")), tmp, args), nprocs=R, join=True)
            got = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(R)]
        b = got[0]["bytes"]
        rows.append(
            dict(
                ranks=R,
                seconds_per_rank=[g["seconds"] for g in got],
                bytes_forward=b["forward"],
                bytes_received=b["forward_received"],
                bytes_backward=b["backward"],
                bytes_formula=comm_bytes_per_call(a.H, a.D, a.D, 1, R),
            )
        )
    print(
        f"# bl_chunk forward+backward, context parallel on gloo/CPU: T={a.T}, H={a.H}, D=m={a.D}, C={a.C}, "
        f"fp32, scalar decay, {a.threads} thread(s) per rank, {os.cpu_count()} cores, {platform.processor()}"
    )
    print(
        "| ranks | tokens/rank | time/rank, slowest (s) | time/rank, fastest (s) | sent/rank fwd (B) "
        "| received/rank fwd (B) | all-reduced/rank bwd (B) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["seconds_per_rank"]
        print(
            f"| {r['ranks']} | {a.T // r['ranks']} | {max(s):.3f} | {min(s):.3f} | {r['bytes_forward']} | "
            f"{r['bytes_received']} | {r['bytes_backward']} |"
        )
    if a.json is not None:
        from bayeslayer.experiments.common.provenance import write_record

        record = dict(config=dict(vars(a), json=str(a.json)), cores=os.cpu_count(), torch=torch.__version__, rows=rows)
        write_record(a.json, record)


if __name__ == "__main__":
    main()
