"""GPU benchmark: the Bayesian Layer's Triton chunk path vs flash-linear-attention's Gated DeltaNet.

One short command on a machine with a CUDA GPU::

    python benchmarks/gpu.py                      # T ∈ {2k, 8k, 32k} × D ∈ {64, 128, 256}
    python benchmarks/gpu.py --quick              # T = 2k only, a smoke run
    python benchmarks/gpu.py --compile-only       # no GPU needed: AOT-compile the kernels for sm_90
    python benchmarks/gpu.py --profile --T 8192 --D 128   # where BL's device time goes (torch.profiler)

For each (T, D) at the same B, H (value dim m = D, bf16 inputs, scalar decay):
forward time, forward+backward time, tokens/s and peak memory (above the inputs)
of ``bl_chunk_triton`` and of ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``,
and the ratio BL/GDN per row.  Times are medians over ``--reps`` CUDA-event-timed
runs after warm-up (the first call compiles).  Value checks (a host sync per
input) are switched off while timing, as in production training.  BL is measured
for every row first, then GDN (fla autotunes on its first call per head dim, for
minutes on a fresh machine); the JSON file (``--out``) is rewritten after every
measurement, so a run cut short by a time limit keeps what it measured.  Asserts
nothing.

Without CUDA it prints a message and exits 0; ``--compile-only`` still works
there (Triton compiles to PTX/cubin without a device) and reports registers,
spills (``STACK``) and shared memory per kernel configuration.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def _make_inputs(B, T, H, D, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, T, H, D, device=device, generator=gen) / math.sqrt(D)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=device, generator=gen), dim=-1)
    v = torch.randn(B, T, H, D, device=device, generator=gen)
    alpha = 0.9 + 0.1 * torch.rand(B, T, H, device=device, generator=gen)  # decay close to 1
    r2 = 0.1 + torch.rand(B, T, H, device=device, generator=gen)
    ell2 = 0.01 + 0.05 * torch.rand(B, T, H, device=device, generator=gen)
    beta = torch.sigmoid(torch.randn(B, T, H, device=device, generator=gen))
    return dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), alpha=alpha, r2=r2, ell2=ell2, beta=beta)


def _time(fn, reps: int, warmup: int) -> float:
    """Median seconds per call (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _peak_bytes(fn) -> int:
    """Peak allocated memory during ``fn`` above what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _bl_fns(x, chunk_size):
    from bayeslayer.ops.triton import bl_chunk_triton

    def fwd():
        with torch.no_grad():
            bl_chunk_triton(x["q"], x["k"], x["v"], x["r2"], x["ell2"], x["alpha"], chunk_size=chunk_size)

    def fwd_bwd():
        leaves = [x[n].detach().requires_grad_(True) for n in ("q", "k", "v")]
        o, _ = bl_chunk_triton(*leaves, x["r2"], x["ell2"], x["alpha"], chunk_size=chunk_size)
        o.backward(torch.ones_like(o))

    return fwd, fwd_bwd


def _gdn_fns(x):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    g = torch.log(x["alpha"])
    beta = x["beta"].to(x["q"].dtype)

    def fwd():
        with torch.no_grad():
            chunk_gated_delta_rule(x["q"], x["k"], x["v"], g, beta, scale=1.0)

    def fwd_bwd():
        leaves = [x[n].detach().requires_grad_(True) for n in ("q", "k", "v")]
        o, _ = chunk_gated_delta_rule(*leaves, g, beta, scale=1.0)
        o.backward(torch.ones_like(o))

    return fwd, fwd_bwd


def _measure(fns, tokens, reps, warmup, do_bwd):
    fwd, fwd_bwd = fns
    row = {"fwd_s": _time(fwd, reps, warmup), "fwd_mem": _peak_bytes(fwd)}
    row["fwd_tok_s"] = tokens / row["fwd_s"]
    if do_bwd:
        row["fwdbwd_s"] = _time(fwd_bwd, reps, warmup)
        row["fwdbwd_mem"] = _peak_bytes(fwd_bwd)
        row["fwdbwd_tok_s"] = tokens / row["fwdbwd_s"]
    return row


def run_benchmark(args, save) -> list[dict]:
    from bayeslayer.ops import set_value_checks

    set_value_checks(False)
    if args.gdn_bypass_hopper_guard:
        # fla refuses its gated backward on Hopper with Triton 3.4 <= v < 3.7.1 (its issue #640: wrong
        # gradient values); the time of the kernels it would run is still what we compare against
        import fla.ops.common.chunk_o as fla_chunk_o

        fla_chunk_o.TRITON_ABOVE_3_7_1 = True
        print("# fla's Hopper/Triton guard on chunk_bwd_dqkwg bypassed: GDN backward values unchecked, "
              "times only")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    print(f"# {torch.cuda.get_device_name()} | B={args.B} H={args.H} m=D dtype={args.dtype} "
          f"chunk={args.chunk_size} | {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    rows = [{"T": T, "D": D, "B": args.B, "H": args.H, "dtype": args.dtype} for T in args.T for D in args.D]
    # BL first for every row, then GDN: fla autotunes on its first call per head dim (minutes on a
    # fresh machine), which must not keep BL's rows from being measured within a time limit.  The
    # JSON is rewritten after every measurement, so a run cut short keeps what it measured.
    for which, fns in (("bl", lambda x: _bl_fns(x, args.chunk_size)), ("gdn", _gdn_fns)):
        if which == "gdn" and args.bl_only:
            break
        for rec in rows:
            T, D = rec["T"], rec["D"]
            try:
                x = _make_inputs(args.B, T, args.H, D, dtype, "cuda")
                t0 = time.time()
                rec[which] = _measure(fns(x), args.B * T, args.reps, args.warmup, not args.no_bwd)
                print(f"{T:>6} {D:>4} | {which.upper()} ({time.time() - t0:.0f} s): "
                      f"{json.dumps({n: round(v, 5) for n, v in rec[which].items()})}", flush=True)
            except Exception as err:  # one failing row (OOM, compile error) must not hide the others
                rec[f"{which}_error"] = f"{type(err).__name__}: {err}"
                print(f"{T:>6} {D:>4} | {which.upper()} failed: {rec[f'{which}_error'][:200]}", flush=True)
            save(rows)
            torch.cuda.empty_cache()
    _print_table(rows, args.no_bwd)
    return rows


def _print_table(rows: list[dict], no_bwd: bool) -> None:
    """The comparison table (rows with both BL and GDN; ratios BL/GDN)."""
    header = (f"{'T':>6} {'D':>4} | {'BL fwd ms':>9} {'GDN fwd ms':>10} {'ratio':>6} | {'BL f+b ms':>9} "
              f"{'GDN f+b ms':>10} {'ratio':>6} | {'BL Mtok/s':>9} {'GDN Mtok/s':>10} | "
              f"{'BL GiB':>7} {'GDN GiB':>7} {'ratio':>6}")
    print(header)
    print("-" * len(header))
    nan = float("nan")
    for rec in rows:
        bl, gdn = rec.get("bl"), rec.get("gdn", {})
        if bl is None:
            continue
        fb = not no_bwd
        mem = "fwdbwd_mem" if fb else "fwd_mem"

        def val(d, key, scale=1.0):
            return d[key] * scale if key in d else nan

        def ratio(key):
            return bl[key] / gdn[key] if key in gdn and gdn[key] else nan

        print(f"{rec['T']:>6} {rec['D']:>4} | {val(bl, 'fwd_s', 1e3):>9.2f} {val(gdn, 'fwd_s', 1e3):>10.2f} "
              f"{ratio('fwd_s'):>6.2f} | {val(bl, 'fwdbwd_s', 1e3):>9.2f} {val(gdn, 'fwdbwd_s', 1e3):>10.2f} "
              f"{ratio('fwdbwd_s'):>6.2f} | {val(bl, 'fwd_tok_s', 1e-6):>9.2f} {val(gdn, 'fwd_tok_s', 1e-6):>10.2f} | "
              f"{val(bl, mem, 2**-30):>7.2f} {val(gdn, mem, 2**-30):>7.2f} {ratio(mem):>6.2f}", flush=True)


def profile(args) -> None:
    """Where the time goes: one forward and one forward+backward of ``bl_chunk_triton`` under
    ``torch.profiler`` at the first (T, D), top kernels by device time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from bayeslayer.ops import set_value_checks

    set_value_checks(False)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    x = _make_inputs(args.B, args.T[0], args.H, args.D[0], dtype, "cuda")
    for name, fn in zip(("forward", "forward+backward"), _bl_fns(x, args.chunk_size), strict=True):
        fn()  # compile
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        print(f"# profile: BL {name}, T={args.T[0]} D={args.D[0]} B={args.B} H={args.H}")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))


def variants(args) -> None:
    """Forward time and error of ``bl_chunk_triton`` per chunk size and fp32 product precision
    (``tl.dot`` input_precision), at each D and the first T; error vs the PyTorch path in fp64."""
    from bayeslayer.ops import bl_chunk, set_value_checks
    from bayeslayer.ops.triton import bl_chunk_triton
    from bayeslayer.ops.triton import chunk as tchunk

    set_value_checks(False)
    T = args.T[0]
    print(f"# variants: T={T} B={args.B} H={args.H} fp32 inputs | forward ms, max|o-o64|/max|o64|, "
          f"max|P-P64|/max|P64|")
    for D in args.D:
        x = _make_inputs(args.B, T, args.H, D, torch.float32, "cuda")
        x64 = {n: t.double() for n, t in x.items()}
        t0 = time.time()
        ref, (_, P64) = bl_chunk(x64["q"], x64["k"], x64["v"], x64["r2"], x64["ell2"], x64["alpha"],
                                 output_final_state=True, backend="torch")
        print(f"D={D}: fp64 reference {time.time() - t0:.1f} s", flush=True)
        for C in (16, 32, 64):
            for prec in ("ieee", "tf32x3", "tf32"):
                tchunk.FP32_PRECISION = prec
                t0 = time.time()

                def fwd(x=x, C=C):
                    with torch.no_grad():
                        return bl_chunk_triton(x["q"], x["k"], x["v"], x["r2"], x["ell2"], x["alpha"],
                                               chunk_size=C, output_final_state=True)
                try:
                    o, (_, P) = fwd()
                    first = time.time() - t0
                    ms = _time(fwd, 3, 1) * 1e3
                    eo = ((o.double() - ref).abs().max() / ref.abs().max()).item()
                    eP = ((P.double() - P64).abs().max() / P64.abs().max()).item()
                    print(f"  C={C:>2} {prec:>6}: {ms:8.2f} ms  o {eo:.1e}  P {eP:.1e}  (first call {first:.1f} s)",
                          flush=True)
                except Exception as err:
                    print(f"  C={C:>2} {prec:>6}: failed {type(err).__name__}: {str(err)[:150]}", flush=True)
        tchunk.FP32_PRECISION = "ieee"
        del x, x64, ref, P64
        torch.cuda.empty_cache()


def compile_only(args) -> list[dict]:
    """AOT-compile the kernels for ``--arch`` (no GPU needed); report registers, spills and shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bayeslayer.ops.triton.chunk import BACKWARD_BLOCK, default_num_warps, tile_sizes
    from bayeslayer.ops.triton.kernels import bl_chunk_cov_kernel, bl_chunk_mean_kernel, bl_step_kernel
    from bayeslayer.ops.triton.step import step_tiles

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    C = args.chunk_size
    out = []
    configs = [(k, D, g, ck) for k in ("cov", "mean", "step") for D in args.D for g in (False, True)
               for ck in ((False, True) if k != "step" else (False,))]
    for kernel, D, diag, save_ck in configs:
        BD, BK, BV = tile_sizes(D, D)
        common = dict(H=16, D=D, BD=BD, BK=BK, DIAG=diag, HAS_ALPHA=True)
        ck_every = BACKWARD_BLOCK if save_ck else 1
        nw = default_num_warps(C)
        if kernel == "cov":
            fn = bl_chunk_cov_kernel
            names = ["q", "k", "r2", "ell2", "la", "cu_seqlens", "P", "W", "LINV", "Yscr", "Uscr", "VAR", "CKP",
                     "ck_offsets"]
            consts = dict(common, C=C, RETURN_VAR=False, SAVE_CK=save_ck, PREC="ieee", CK_EVERY=ck_every)
        elif kernel == "mean":
            fn = bl_chunk_mean_kernel
            names = ["q", "k", "v", "W", "LINV", "la", "cu_seqlens", "M", "O", "CKM", "ck_offsets"]
            consts = dict(common, MV=D, C=C, BV=BV, SAVE_CK=save_ck, PREC="ieee", CK_EVERY=ck_every)
        else:
            fn, nw = bl_step_kernel, 4
            names = ["q", "k", "v", "r2", "ell2", "la", "P_in", "M_in", "P_out", "M_out", "Uscr", "O", "VAR"]
            BK_step, BV_step = step_tiles(D, D)[1:]
            consts = dict(common, BK=BK_step, MV=D, BMV=BD, BV=BV_step)
        sig = {n: ("*i64" if n in ("cu_seqlens", "ck_offsets") else "*fp32") for n in names}
        sig.update({n: "constexpr" for n in consts})
        t0 = time.time()
        rec = {"kernel": kernel, "D": D, "diagonal": diag, "checkpoints": save_ck, "chunk_size": C, "num_warps": nw}
        try:
            compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                                      target=GPUTarget("cuda", args.arch, 32), options={"num_warps": nw})
            rec["shared_bytes"] = compiled.metadata.shared
            cubin = Path("/tmp") / f"bl_{kernel}_{D}_{int(diag)}_{int(save_ck)}.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True)
            rec["resources"] = next((ln.strip() for ln in usage.stdout.splitlines() if "REG" in ln), "")
        except Exception as err:
            rec["error"] = f"{type(err).__name__}: {err}"
        rec["compile_s"] = round(time.time() - t0, 1)
        print(json.dumps(rec), flush=True)
        out.append(rec)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--D", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-bwd", action="store_true", help="forward only")
    p.add_argument("--quick", action="store_true", help="T = 2048 only")
    p.add_argument("--compile-only", action="store_true", help="AOT-compile for --arch, no GPU needed")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler kernel table of BL forward and forward+backward at the first T, D")
    p.add_argument("--variants", action="store_true",
                   help="forward time and error per chunk size and fp32 product precision, first T, each D")
    p.add_argument("--bl-only", action="store_true", help="measure BL only (no flash-linear-attention needed)")
    p.add_argument("--gdn-bypass-hopper-guard", action="store_true",
                   help="time fla's GDN backward even where fla refuses it (Hopper, Triton < 3.7.1)")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability for --compile-only")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.T = [2048]
    if args.compile_only:
        rows = compile_only(args)
    elif args.variants and torch.cuda.is_available():
        variants(args)
        return 0
    elif args.profile and torch.cuda.is_available():
        profile(args)
        return 0
    elif not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here; nothing measured. Run it on a machine with a GPU "
              "(or use --compile-only to check that the kernels compile).")
        return 0
    else:
        rows = run_benchmark(args, lambda rows: _save(args.out, rows))
    _save(args.out, rows)
    print(f"wrote {args.out}")
    return 0


def _save(path: Path, rows: list[dict]) -> None:
    """Write the rows with the run's metadata (atomically: a run killed mid-write keeps the last file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"argv": sys.argv[1:], "torch": torch.__version__,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        meta["device"] = torch.cuda.get_device_name()
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
