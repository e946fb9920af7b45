"""GPU benchmark: the Bayesian Layer's Triton chunk path vs flash-linear-attention's Gated DeltaNet.

One short command on a machine with a CUDA GPU::

    python benchmarks/gpu.py                      # T ∈ {2k, 8k, 32k} × D ∈ {64, 128, 256}
    python benchmarks/gpu.py --quick              # T = 2k only, a smoke run
    python benchmarks/gpu.py --compile-only       # no GPU needed: AOT-compile the kernels for sm_90
    python benchmarks/gpu.py --profile --T 8192 --D 128   # where BL's device time goes (torch.profiler)
    python benchmarks/gpu.py --scan               # v2: the segment-scan forward vs GDN's forward (below)
    TRITON_INTERPRET=1 python benchmarks/gpu.py --scan --dry-run   # the same code on CPU, tiny shapes

``--scan`` (the device check, sized for 8 minutes; ``benchmarks/gpu_session.sh`` runs it on a bare machine): first
value checks on the device (fla's ``fwd_h`` against its PyTorch twin, the scan forward against ``bl_chunk`` in
float64, then one per head dim at the rows' own compile shapes in the rows' dtype, the bf16 hand-off to fla's mean
pass included), with fla's autotuning pinned to each kernel's first config (``--fla-autotune pin``) or run once per
head dim in that check (``warm``; its autotune keys do not include T), then the forward rows in order of
cost: latency (B = 2, H = 16) and full occupancy (``--occ-B`` × H ≥ 132) for T ∈ {2k, 8k, 32k}
× D ∈ {64, 128, 256}, each with GDN's forward and BL's forward on both covariance passes, with fla's mean pass:
the covariance chain (``bl_chain_fwd_s``) and the segment scan (``ops/bayesian_layer/scan_triton.py``,
``bl_scan_fwd_s``, with per-phase times); ``bl_path`` is the one ``covariance_path`` picks for the row (the
default path), ``bl_fwd_s`` and ``ratio_fwd`` (BL/GDN) are its, ``ratio_fwd_chain`` and ``ratio_fwd_scan`` both's;
peak memory (none started after ``--fwd-budget-s``); then the forward+backward rows (below); then a segment-count
sweep.  The JSON is rewritten after every row, and no row starts after ``--budget-s``.

Forward+backward of the same rows (``--no-bwd``: forwards only): time and peak memory
(above the inputs; the peak-memory call doubles as the warm-up, then ``--bwd-reps`` timed calls, default 2) of
BL ``bl_chunk_triton(..., path="scan")`` (``bl_scan_fwdbwd_*``: the segment scan), BL ``path="chain"``
(``bl_chain_fwdbwd_*``: the covariance chain) and fla's ``chunk_gated_delta_rule`` (``gdn_fwdbwd_*``), with
``ratio_fwdbwd`` and ``ratio_fwdbwd_mem`` (the default path, ``bl_path``, over GDN), ``ratio_fwdbwd_chain`` and
``ratio_fwdbwd_scan``,
and BL's scan forward+backward again at chunk ``--alt-chunk`` (default 32; 0: not), ``ratio_fwdbwd_alt_chunk``.
Gradients: BL's of q, k, v, r2, ell2, alpha, GDN's of q, k, v, g = log α, β — what a layer, whose projections
produce all of them, needs; the adjoint of o is a fixed N(0, 1) draw.  A measurement is not started once the
budget is spent.  The check first compares fla's GDN backward (fp32, packed, first autotune config) with autograd
through fla's naive recurrent reference and BL's segment-scan backward (float64, and fp32 with fla's mean-pass
kernels) with the PyTorch chunk path, recording the Triton and fla versions and whether fla's Hopper guard
(Triton < 3.7.1, fla issue #640) is active, was bypassed (``--gdn-bypass-hopper-guard``; it gates BL's scan
backward too, whose mean pass calls the same fla kernel) or refused a call.  In the dry run fla's naive
references stand in for its kernels.

What the backward adds (estimates, none of it measured on a GPU): the check compiles fla's GDN backward and BL's
backward kernels at one small shape (first configs only: ≈ 20–70 s); the warm-up per head dim adds fla's
autotuning of its backward kernels, GDN's and BL's mean pass's (the forward's alone took 71 s to over 100 s per
head dim on a fresh H200; ``TRITON_CACHE_DIR`` carried from a previous machine removes it) and B2–B4's compiles;
per row 3 × (1 + ``--bwd-reps``) calls: block-wise took 79–642 ms per forward+backward at B = 2, T <= 8k on the
H200 (2026-11-30), so <= 2 s per latency row and, by tokens, <= 9 s per full-occupancy row; GDN's are a few
ms; BL scan's are unknown.  Within the same budget the run keeps fewer rows (cheapest first); ``--no-bwd``
restores the forward-only run, ``--bwd-reps 1`` shortens each row.  The CPU dry run takes ≈ 1 minute (35 s
without the backward).

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
import contextlib
import json
import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

# the checkout this script lives in, not whichever bayeslayer happens to be installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# and its sibling scripts (kernel_sass: the SASS census and the launch recorder)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_sass as ks  # noqa: E402

from bayeslayer.ops.bayesian_layer.mean_pass_fla import fla_hopper_guard  # noqa: E402


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
    from bayeslayer.ops.bayesian_layer.chunk_triton import bl_chunk_triton

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
        guard = fla_hopper_guard(bypass=True)
        if guard["active"]:
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
    from bayeslayer.ops.bayesian_layer import chain_triton as tchain
    from bayeslayer.ops.bayesian_layer import chunk_triton as tchunk
    from bayeslayer.ops.bayesian_layer.chunk_triton import bl_chunk_triton

    set_value_checks(False)
    T = args.T[0]
    print(f"# variants: T={T} B={args.B} H={args.H} fp32 inputs | forward ms, max|o-o64|/max|o64|, "
          f"max|P-P64|/max|P64|")
    saved = tchain.FP32_PRECISION, tchunk.CHAIN_CHUNK_SIZE
    for D in args.D:
        x = _make_inputs(args.B, T, args.H, D, torch.float32, "cuda")
        x64 = {n: t.double() for n, t in x.items()}
        t0 = time.time()
        ref, (_, P64) = bl_chunk(x64["q"], x64["k"], x64["v"], x64["r2"], x64["ell2"], x64["alpha"],
                                 output_final_state=True, backend="torch")
        print(f"D={D}: fp64 reference {time.time() - t0:.1f} s", flush=True)
        for C in (16, 32, 64):
            for prec in tchain.PRECISIONS:
                tchain.FP32_PRECISION, tchunk.CHAIN_CHUNK_SIZE = prec, C  # fp32 inputs
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
        tchain.FP32_PRECISION, tchunk.CHAIN_CHUNK_SIZE = saved
        del x, x64, ref, P64
        torch.cuda.empty_cache()


def _sync(device) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_any(fn, reps: int, warmup: int, device: str) -> float:
    """Median seconds per call: CUDA events on a GPU, wall clock elsewhere (the dry run)."""
    if device == "cuda":
        return _time(fn, reps, warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _peak_any(fn, device: str) -> int:
    return _peak_bytes(fn) if device == "cuda" else 0


def _scan_fwd(x, chunk_size, n_segments=None, timings=None, mean="fla", prep=True):
    """The scan forward; ``mean="fla"`` (the design's mean pass) or ``"triton"`` (ours: the wired default);
    ``prep=False``: without the prep kernel (the covariance kernel forms the P-free terms in its chunk loop)."""
    from bayeslayer.ops.bayesian_layer import mean_pass_fla
    from bayeslayer.ops.bayesian_layer.scan_triton import forward_scan_triton

    if mean == "fla" and not torch.cuda.is_available():  # dry run: fla's fwd_h does not run in the interpreter
        def mean(*a):
            with mean_pass_fla.one_autotune_config():
                return mean_pass_fla.mean_pass_fla(*a, fwd_h=mean_pass_fla.fwd_h_reference)

    def fwd():
        return forward_scan_triton(x["q"], x["k"], x["v"], x["r2"], x["ell2"], x["alpha"], 1.0, None, None, None,
                                   chunk_size, False, n_segments=n_segments, timings=timings, mean=mean, prep=prep)

    return fwd


def _gdn_inputs(x: dict) -> dict:
    """GDN's own inputs for a row's ``x``: q, k, v, its decay ``g = log α`` and step β (in q's dtype)."""
    return {"q": x["q"], "k": x["k"], "v": x["v"], "g": torch.log(x["alpha"]), "beta": x["beta"].to(x["q"].dtype)}


def _gdn_fwd(x):
    """fla's GDN forward without autograd (:func:`_gdn_call`: its kernels on CUDA, its naive reference in the dry
    run)."""
    base = _gdn_inputs(x)

    def fwd():
        with torch.no_grad():
            return _gdn_call(*(base[n] for n in GDN_LEAVES))

    return fwd


# the leaves of the forward+backward rows: what a layer differentiates (its projections produce all of them)
BL_LEAVES = ("q", "k", "v", "r2", "ell2", "alpha")
GDN_LEAVES = ("q", "k", "v", "g", "beta")  # GDN's own parametrisation of decay (g = log α) and step (β)


def _fla_first_config():
    """Every autotuned fla kernel loaded (GDN's too) pinned to its first config: the value checks use it (one
    compile per kernel instead of fla's autotuning, for minutes on a fresh machine, at a shape no row times), and
    so does the interpreter, which cannot benchmark configs."""
    from bayeslayer.ops.bayesian_layer import mean_pass_fla

    return mean_pass_fla.one_autotune_config(("fla.ops.gated_delta_rule", *mean_pass_fla.FLA_MODULES))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b| in float64 (b = the reference)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


def _cotangent(x: dict, seed: int = 2) -> torch.Tensor:
    """The adjoint of o (``[B, T, H, m]``, like v): a fixed N(0, 1) draw, so that nothing cancels."""
    v = x["v"]
    gen = torch.Generator(device=v.device).manual_seed(seed)
    return torch.randn(v.shape, device=v.device, generator=gen).to(v.dtype)


def _bl_fwdbwd(x, chunk_size, path: str, do):
    """Forward+backward of ``bl_chunk_triton(..., path=)`` (``"scan"``: the segment scan and its backward;
    ``"chain"``: the covariance chain, the default) with the gradients of :data:`BL_LEAVES`."""
    from bayeslayer.ops.bayesian_layer.chunk_triton import PATHS, bl_chunk_triton

    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    # the interpreter cannot benchmark fla's configs (the scan backward's mean pass runs fla's kernels)
    pin = _fla_first_config if x["q"].device.type == "cpu" else contextlib.nullcontext

    def fn():
        leaves = {n: x[n].detach().requires_grad_(True) for n in BL_LEAVES}
        with pin():
            o, _ = bl_chunk_triton(*(leaves[n] for n in BL_LEAVES), chunk_size=chunk_size, path=path)
            o.backward(do)
        return leaves

    return fn


def _bl_fwd(x, path: str | None = None):
    """BL's forward without autograd, ``bl_chunk_triton(..., path=)`` (None: the default path, what
    ``covariance_path`` picks for the shape; ``"chain"`` or ``"scan"`` forces one), fla's mean pass after it."""
    from bayeslayer.ops.bayesian_layer.chunk_triton import bl_chunk_triton

    pin = _fla_first_config if x["q"].device.type == "cpu" else contextlib.nullcontext

    def fwd():
        with torch.no_grad(), pin():
            return bl_chunk_triton(*(x[n] for n in BL_LEAVES), path=path)

    return fwd


def _bl_path(x) -> str:
    """The covariance pass the dispatch runs for the inputs ``x`` (``chunk_triton.covariance_path``)."""
    from bayeslayer.ops.bayesian_layer import chunk_triton

    B, T, H, D = x["q"].shape
    return chunk_triton.covariance_path(B * H, T, D, sms=chunk_triton._sms(x["q"].device))


def _gdn_call(q, k, v, g, beta, naive: str | None = None):
    """fla's GDN on CUDA (``chunk_gated_delta_rule``); ``naive`` ("recurrent" or "chunk"): fla's PyTorch references
    (differentiable; the dry run's stand-in, and the check's reference)."""
    if naive is None and q.device.type != "cuda":
        naive = "recurrent"  # the dry run: fla's kernels do not run in the interpreter (fwd_h)
    if naive == "recurrent":
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

        return naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale=1.0)[0]
    if naive == "chunk":
        from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule

        return naive_chunk_gated_delta_rule(q, k, v, g, beta, scale=1.0)[0]
    if naive is not None:
        raise ValueError(f"naive must be None, 'recurrent' or 'chunk', got {naive!r}")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(q, k, v, g, beta, scale=1.0)[0]


def _gdn_fwdbwd(x, do):
    """Forward+backward of fla's GDN (:func:`_gdn_call`) with the gradients of :data:`GDN_LEAVES`."""
    base = _gdn_inputs(x)

    def fn():
        leaves = {n: base[n].detach().requires_grad_(True) for n in GDN_LEAVES}
        o = _gdn_call(*(leaves[n] for n in GDN_LEAVES))
        o.backward(do.to(o.dtype))
        return leaves

    return fn


def _measure_fwdbwd(fn, reps: int, device: str) -> tuple[float, int]:
    """``(median seconds, peak bytes above the inputs)`` of a forward+backward: the peak-memory call is also the
    warm-up (every kernel was compiled in the per-D warm-up), then ``reps`` timed calls."""
    peak = _peak_any(fn, device)
    return _time_any(fn, reps, 0, device), peak


def _grads_of(fn, leaves: dict, seed: int) -> dict:
    """Gradients of a fixed random linear functional of ``fn(**leaves)`` (a tensor or a tuple of tensors)."""
    outs = fn(**leaves)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((y * torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y)).sum() for y in outs)
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True))


def _guard_hit(err: Exception) -> bool:
    """True when ``err`` is fla's Hopper/Triton refusal (:func:`fla_hopper_guard`)."""
    return isinstance(err, RuntimeError) and "#640" in str(err)


def _check_gdn_backward(device: str, dry_run: bool) -> dict:
    """fla's GDN gradients (fp32, packed ragged sequences) against autograd through fla's naive recurrent
    reference: max relative error of o and of each of :data:`GDN_LEAVES`' gradients.

    On CUDA the kernels are ``chunk_gated_delta_rule`` (autotuning pinned to each kernel's first config: the
    check must not cost fla's autotuning); in the dry run fla's naive *chunk* reference stands in for them."""
    gen = torch.Generator(device=device).manual_seed(3)
    T, H, D, cu = (40, 2, 16, [0, 17, 40]) if dry_run else (200, 2, 64, [0, 90, 200])
    f32 = dict(dtype=torch.float32, device=device)
    x = {"q": torch.randn(1, T, H, D, generator=gen, **f32) / math.sqrt(D),
         "k": torch.nn.functional.normalize(torch.randn(1, T, H, D, generator=gen, **f32), dim=-1),
         "v": torch.randn(1, T, H, D, generator=gen, **f32),
         "g": torch.log(0.9 + 0.1 * torch.rand(1, T, H, generator=gen, **f32)),
         "beta": torch.sigmoid(torch.randn(1, T, H, generator=gen, **f32))}
    leaves = {n: x[n].clone().requires_grad_(True) for n in GDN_LEAVES}
    out: dict = {"gdn_check_impl": "naive_chunk_gated_delta_rule (dry run)" if dry_run else
                 "chunk_gated_delta_rule (first autotune config)", "gdn_check_shape": f"T={T} H={H} D={D} cu={cu}"}

    def packed(naive):
        def fn(q, k, v, g, beta):  # fla's references have no cu_seqlens: one call per sequence
            return torch.cat([_gdn_call(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], naive=naive)
                              for a, b in zip(cu[:-1], cu[1:], strict=True)], dim=1)
        return fn

    def kernels(q, k, v, g, beta):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return chunk_gated_delta_rule(q, k, v, g, beta, scale=1.0, cu_seqlens=torch.tensor(cu, device=device))[0]

    ref_o = packed("recurrent")(**leaves)
    ref = _grads_of(packed("recurrent"), leaves, seed=4)
    try:
        with _fla_first_config():
            fn = packed("chunk") if dry_run else kernels
            got_o = fn(**leaves)
            got = _grads_of(fn, leaves, seed=4)
        errs = {"o": _rel(got_o.detach(), ref_o.detach()), **{n: _rel(got[n], ref[n]) for n in GDN_LEAVES}}
        out["gdn_bwd_rel_err"] = errs
        out["gdn_bwd_max_rel_err"] = max(errs.values())
        out["gdn_bwd_guard_hit"] = False
    except Exception as err:  # fla's guard (or anything else) must not stop the run: recorded
        out["gdn_bwd_guard_hit"] = _guard_hit(err)
        out["gdn_bwd_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    return out


def _check_bl_backward(device: str, dry_run: bool) -> dict:
    """BL's gradients (of o and the final M, P) on both covariance passes — the covariance chain's reverse chain
    (the default path, ``bl_chain_bwd_*``) and the segment scan's backward (``bl_scan_bwd_*``) — against the
    PyTorch chunk path's autograd in float64, on packed ragged sequences with segment boundaries inside them: max
    relative error per input of :data:`BL_LEAVES`, in float64 (fla's mean-pass kernels are twins in float64) and
    in fp32 (the same against the float64 reference, with fla's mean-pass backward kernels on CUDA — pinned to
    their first config — which fla's Hopper guard may refuse)."""
    from bayeslayer.ops import bl_chunk
    from bayeslayer.ops.bayesian_layer.chunk_triton import bl_chunk_triton

    gen = torch.Generator(device=device).manual_seed(5)
    T, H, D, cu, n_seg = (40, 1, 16, [0, 17, 40], 2) if dry_run else (200, 2, 32, [0, 90, 200], 3)
    f64 = dict(dtype=torch.float64, device=device)
    x = {"q": torch.randn(1, T, H, D, generator=gen, **f64),
         "k": torch.nn.functional.normalize(torch.randn(1, T, H, D, generator=gen, **f64), dim=-1),
         "v": torch.randn(1, T, H, D, generator=gen, **f64),
         "r2": 0.1 + torch.rand(1, T, H, generator=gen, **f64),
         "ell2": 1e-4 + 1e-4 * torch.rand(1, T, H, generator=gen, **f64),
         "alpha": 0.998 + 0.002 * torch.rand(1, T, H, generator=gen, **f64)}  # long memory: segments matter
    cu_t = torch.tensor(cu, device=device)
    out: dict = {"bl_bwd_check_shape": f"T={T} H={H} D={D} C=16 cu={cu} n_segments={n_seg}"}

    def torch_path(**kw):
        o, (M, P) = bl_chunk(*(kw[n] for n in BL_LEAVES), chunk_size=16, cu_seqlens=cu_t, output_final_state=True,
                             backend="torch")
        return o, M, P

    def triton_path(path):
        extra = dict(n_segments=n_seg) if path == "scan" else dict(path="chain")

        def call(**kw):
            o, (M, P) = bl_chunk_triton(*(kw[n] for n in BL_LEAVES), chunk_size=16, cu_seqlens=cu_t,
                                        output_final_state=True, **extra)
            return o, M, P

        return call

    ref = _grads_of(torch_path, {n: x[n].clone().requires_grad_(True) for n in BL_LEAVES}, seed=6)
    for path in ("chain", "scan"):
        for dtype, tag in ((torch.float64, "fp64"), (torch.float32, "fp32")):
            key = f"bl_{path}_bwd_{tag}"
            try:
                with _fla_first_config():
                    leaves = {n: x[n].detach().to(dtype).clone().requires_grad_(True) for n in BL_LEAVES}
                    got = _grads_of(triton_path(path), leaves, seed=6)
                errs = {n: _rel(got[n], ref[n]) for n in BL_LEAVES}
                out[f"{key}_rel_err"] = errs
                out[f"{key}_max_rel_err"] = max(errs.values())
            except Exception as err:
                out[f"{key}_guard_hit"] = _guard_hit(err)
                out[f"{key}_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    return out


def scan_check(args, device: str, guard: dict | None = None) -> dict:
    """Values on the device before any timing: fla's fwd_h vs its twin, the scan forward vs ``bl_chunk``, fla's
    GDN backward vs its naive reference (:func:`_check_gdn_backward`), BL's segment-scan backward vs the PyTorch
    chunk path (:func:`_check_bl_backward`; both skipped with ``args.no_bwd``).  ``guard``: what
    :func:`fla_hopper_guard` returned for this run, recorded with the Triton and fla versions the values were
    checked under."""
    from bayeslayer.ops import bl_chunk
    from bayeslayer.ops.bayesian_layer import mean_pass_fla
    from bayeslayer.ops.bayesian_layer.scan_triton import forward_scan_triton

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if guard is not None and not isinstance(guard, dict):
        raise TypeError(f"guard must be None or the dict fla_hopper_guard returns, got {type(guard).__name__}")
    guard = fla_hopper_guard(bypass=False) if guard is None else guard
    out = {"triton": guard["triton"], "fla": guard["fla"], "hopper_guard_active": guard["active"],
           "hopper_guard_bypassed": guard["bypassed"]}
    gen = torch.Generator(device=device).manual_seed(1)
    B, T, H, D = 1, 200, 2, 32
    f64 = dict(dtype=torch.float64, device=device)
    q = torch.randn(B, T, H, D, generator=gen, **f64)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=gen, **f64), dim=-1)
    v = torch.randn(B, T, H, D, generator=gen, **f64)
    r2 = 0.1 + torch.rand(B, T, H, generator=gen, **f64)
    ell2 = 1e-4 + 1e-4 * torch.rand(B, T, H, generator=gen, **f64)
    alpha = 0.998 + 0.002 * torch.rand(B, T, H, generator=gen, **f64)  # long memory: segments matter
    cu = torch.tensor([0, 90, 200], device=device)
    ref = bl_chunk(q, k, v, r2, ell2, alpha, chunk_size=16, cu_seqlens=cu, output_final_state=True,
                   return_variance=True, backend="torch")
    o, var, M, P = forward_scan_triton(q, k, v, r2, ell2, alpha, 1.0, None, None, cu, 16, True, segment_chunks=2)
    out["scan_fp64_rel_err"] = max(((a - b).abs().max() / b.abs().max()).item()
                                   for a, b in ((o, ref[0]), (var, ref[1]), (M, ref[2][0]), (P, ref[2][1])))
    from bayeslayer.ops.bayesian_layer.chunk_triton import bl_chunk_triton

    o, var, (M, P) = bl_chunk_triton(q, k, v, r2, ell2, alpha, cu_seqlens=cu, output_final_state=True,
                                     return_variance=True, path="chain")  # the default path's covariance chain
    out["chain_fp64_rel_err"] = max(((a - b).abs().max() / b.abs().max()).item()
                                    for a, b in ((o, ref[0]), (var, ref[1]), (M, ref[2][0]), (P, ref[2][1])))
    if device == "cuda":
        Kf, Vf = 64, 64
        kk = torch.randn(1, T, H, Kf, device=device) * 0.1
        ww = torch.randn(1, T, H, Kf, device=device) * 0.1
        uu = torch.randn(1, T, H, Vf, device=device)
        gg = -0.02 * torch.rand(1, T, H, device=device)
        from fla.ops.utils import chunk_local_cumsum

        gg = chunk_local_cumsum(gg, 64, cu_seqlens=cu)
        h0 = torch.randn(2, H, Kf, Vf, device=device)
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

        kw = dict(g=gg, initial_state=h0, output_final_state=True, chunk_size=64, cu_seqlens=cu)
        h1, v1, f1 = chunk_gated_delta_rule_fwd_h(kk, ww, uu, **kw)
        h2, v2, f2 = mean_pass_fla.fwd_h_reference(kk, ww, uu, **kw)
        out["fla_fwd_h_vs_twin_rel_err"] = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                                               for a, b in ((h1, h2), (v1, v2), (f1, f2)))
    if not args.no_bwd:
        t0 = time.time()
        out.update(_check_gdn_backward(device, args.dry_run))
        out.update(_check_bl_backward(device, args.dry_run))
        out["bwd_check_s"] = round(time.time() - t0, 1)
    print(f"# check: {json.dumps(out)}", flush=True)
    return out


def _fwdbwd_cols(rec: dict, key: str) -> str:
    """One forward+backward measurement of a row, readable: ``x ms y GiB``, ``skipped (...)`` or ``failed``."""
    if f"{key}_fwdbwd_s" in rec:
        return f"{rec[f'{key}_fwdbwd_s'] * 1e3:.2f} ms {rec[f'{key}_fwdbwd_mem'] / 2**30:.3f} GiB"
    if f"{key}_fwdbwd_error" in rec:
        return "failed" + (" (fla's Hopper guard)" if rec.get(f"{key}_fwdbwd_guard_hit") else "")
    return str(rec.get(f"{key}_fwdbwd", "—"))


def _fwdbwd_variants(x, do, args) -> list:
    """The forward+backward measurements of a row, in order: GDN, BL's segment scan (``path="scan"``), BL's
    covariance chain (``path="chain"``, the default) and, with ``--alt-chunk``, BL's scan at that chunk size
    (compiled for sm_90, B2/B4 spill 1.2–3 KB per thread at C = 64 and ≤ 272 bytes at C = 32: which costs more,
    the spills or twice the chunk steps, only a GPU says)."""
    out = [("gdn", lambda: _gdn_fwdbwd(x, do)),
           ("bl_scan", lambda: _bl_fwdbwd(x, args.chunk_size, "scan", do)),
           ("bl_chain", lambda: _bl_fwdbwd(x, args.chunk_size, "chain", do))]
    if args.alt_chunk and args.alt_chunk != args.chunk_size:
        out.append((f"bl_scan_c{args.alt_chunk}", lambda: _bl_fwdbwd(x, args.alt_chunk, "scan", do)))
    return out


def _check_row_values(args, device: str, dtype: torch.dtype, D: int) -> dict:
    """Values at a row's own compile shape before it is timed: head dim ``D``, chunk ``args.chunk_size``, the rows'
    dtype (bf16 on the device: BL's fp32 kernels hand w and the substituted tensors to fla's mean pass in bf16, as
    GDN runs its own), T = the shortest row's, H = ``args.H``, B = 1.  Max relative error of o against float64
    references on the same (rounded) inputs: BL's default forward (``bl_path``: the covariance pass
    ``covariance_path`` picks for the shape; fla's mean pass) against ``bl_chunk`` in float64,
    GDN's ``chunk_gated_delta_rule`` against fla's naive recurrent reference in float32.  Their first calls are
    fla's forward autotuning and the kernels' compiles for this D, which the rows then reuse."""
    from bayeslayer.ops import bl_chunk

    T = min(args.T)
    out: dict = {"kind": "row_check", "D": D, "T": T, "H": args.H, "B": 1, "dtype": str(dtype).split(".")[-1],
                 "chunk_size": args.chunk_size}
    t0 = time.time()
    x = _make_inputs(1, T, args.H, D, dtype, device, seed=7)
    try:
        out["bl_path"] = _bl_path(x)
        o = _bl_fwd(x)()[0]
        _sync(device)
        out["bl_first_call_s"] = round(time.time() - t0, 1)
        x64 = {n: t.double() for n, t in x.items()}
        ref = bl_chunk(*(x64[n] for n in BL_LEAVES), chunk_size=args.chunk_size, backend="torch")[0]
        out["bl_fwd_rel_err"] = _rel(o, ref)
    except Exception as err:  # recorded; the rows still run
        out["bl_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    t1 = time.time()
    try:
        base = _gdn_inputs(x)
        got = _gdn_call(*(base[n] for n in GDN_LEAVES), naive=None if device == "cuda" else "chunk")
        _sync(device)
        out["gdn_first_call_s"] = round(time.time() - t1, 1)
        f32 = [base[n].float() for n in GDN_LEAVES]
        out["gdn_fwd_rel_err"] = _rel(got, _gdn_call(*f32, naive="recurrent"))
    except Exception as err:
        out["gdn_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    if "bl_fwd_rel_err" in out and out.get("gdn_fwd_rel_err"):
        out["bl_over_gdn_err"] = out["bl_fwd_rel_err"] / out["gdn_fwd_rel_err"]
    out["seconds"] = round(time.time() - t0, 1)
    return out


def _fwd_row(rec: dict, x: dict, args, device: str) -> None:
    """A row's forwards (into ``rec``): GDN's, then BL's on the default path first (``bl_path``, what
    ``covariance_path`` picks; ``bl_fwd_s``, ``ratio_fwd``), then on the other covariance pass; the scan's per
    phase, peak memories."""
    gdn = _gdn_fwd(x)
    rec["gdn_fwd_s"] = _time_any(gdn, args.reps, args.warmup, device)
    rec["gdn_mem"] = _peak_any(gdn, device)
    rec["bl_path"] = _bl_path(x)
    for path in sorted(("chain", "scan"), key=lambda p: p != rec["bl_path"]):
        fn = _bl_fwd(x, "chain") if path == "chain" else _scan_fwd(x, args.chunk_size)
        rec[f"bl_{path}_fwd_s"] = _time_any(fn, args.reps, args.warmup, device)
        rec[f"bl_{path}_mem"] = _peak_any(fn, device)
        rec[f"ratio_fwd_{path}"] = rec[f"bl_{path}_fwd_s"] / rec["gdn_fwd_s"]
        if path == rec["bl_path"]:
            rec["bl_fwd_s"], rec["bl_mem"], rec["ratio_fwd"] = (rec[f"bl_{path}_fwd_s"], rec[f"bl_{path}_mem"],
                                                                rec[f"ratio_fwd_{path}"])
            rec["ratio_mem"] = rec["bl_mem"] / rec["gdn_mem"] if rec["gdn_mem"] else None
            rec["bl_tok_s"] = rec["B"] * rec["T"] / rec["bl_fwd_s"]
    phases: dict = {}
    _scan_fwd(x, args.chunk_size, timings=phases)()
    rec["bl_scan_phases_s"] = phases


def _fwdbwd_row(rec: dict, x: dict, args, device: str, t_start: float) -> None:
    """A row's forward+backward measurements (into ``rec``): :func:`_fwdbwd_variants`, then the ratios."""
    do = _cotangent(x)
    for key, make in _fwdbwd_variants(x, do, args):
        if time.time() - t_start > args.budget_s:
            rec[f"{key}_fwdbwd"] = f"skipped: budget of {args.budget_s:.0f} s spent"
            continue
        try:
            rec[f"{key}_fwdbwd_s"], rec[f"{key}_fwdbwd_mem"] = _measure_fwdbwd(make(), args.bwd_reps, device)
        except Exception as err:  # an OOM or a refusal of one must not hide the others
            rec[f"{key}_fwdbwd_error"] = f"{type(err).__name__}: {str(err)[:300]}"
            rec[f"{key}_fwdbwd_guard_hit"] = _guard_hit(err)
        if device == "cuda":
            torch.cuda.empty_cache()
    path = rec.setdefault("bl_path", _bl_path(x))
    if "gdn_fwdbwd_s" in rec:
        for key in ("chain", "scan"):
            if f"bl_{key}_fwdbwd_s" in rec:
                rec[f"ratio_fwdbwd_{key}"] = rec[f"bl_{key}_fwdbwd_s"] / rec["gdn_fwdbwd_s"]
        if f"bl_{path}_fwdbwd_s" in rec:  # the default path's
            rec["ratio_fwdbwd"] = rec[f"ratio_fwdbwd_{path}"]
            rec["ratio_fwdbwd_mem"] = (rec[f"bl_{path}_fwdbwd_mem"] / rec["gdn_fwdbwd_mem"]
                                       if rec["gdn_fwdbwd_mem"] else None)
            rec["bl_fwdbwd_tok_s"] = rec["B"] * rec["T"] / rec[f"bl_{path}_fwdbwd_s"]
        if f"bl_scan_c{args.alt_chunk}_fwdbwd_s" in rec:  # the same scan backward at the other chunk size
            rec["ratio_fwdbwd_alt_chunk"] = rec[f"bl_scan_c{args.alt_chunk}_fwdbwd_s"] / rec["gdn_fwdbwd_s"]


def run_scan(args, save) -> list[dict]:
    """:func:`_run_scan` with fla's autotuning as ``args.fla_autotune`` says: ``"pin"`` (every autotuned fla
    kernel, GDN's and the mean pass's alike, at its first config, :func:`_fla_first_config`: no autotuning in the
    device check, whose 8 minutes are shorter than fla's autotuning at two head dims) or ``"warm"`` (fla autotunes
    on its first call per head dim, the row check; ``TRITON_CACHE_AUTOTUNING=1`` keeps the result for a later
    machine)."""
    if not callable(save):
        raise TypeError(f"save must be a callable taking the rows, got {type(save).__name__}")
    mode = getattr(args, "fla_autotune", "warm")
    if mode not in ("pin", "warm"):
        raise ValueError(f"fla_autotune must be 'pin' or 'warm', got {mode!r}")
    with _fla_first_config() if mode == "pin" else contextlib.nullcontext():
        return _run_scan(args, save)


def _run_scan(args, save) -> list[dict]:
    """The device check (module docstring), in this order, the JSON rewritten after every row:

    1. ``check``: the small value checks of :func:`scan_check`, then one per head dim at the rows' own compile
       shapes (:func:`_check_row_values`, bf16 hand-off included; fla's forward autotuning happens here, once
       per head dim);
    2. ``fwd``: every row's forwards (GDN's, BL's with fla's mean pass, with ours, ours without the prep kernel),
       cheapest first, none started after ``args.fwd_budget_s``;
    3. ``fwdbwd`` (unless ``args.no_bwd``): the same rows' forward+backward time and peak memory of GDN, BL
       ``path="scan"``, BL ``path="chain"`` and BL scan at
       ``args.alt_chunk``, with the ratios BL scan / GDN; the first call per head dim (fla's backward
       autotuning, the B2–B4 compiles) is timed apart (``warm_bwd`` rows); none started after
       ``args.budget_s``;
    4. the segment-count sweep (forwards), while the budget lasts."""
    from bayeslayer.ops import set_value_checks

    if not callable(save):
        raise TypeError(f"save must be a callable taking the rows, got {type(save).__name__}")
    set_value_checks(False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t_start = time.time()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.dry_run:
        dtype = torch.float32
    do_bwd = not args.no_bwd
    fwd_budget = min(getattr(args, "fwd_budget_s", None) or args.budget_s, args.budget_s)
    guard = fla_hopper_guard(bypass=bool(args.gdn_bypass_hopper_guard))
    if guard["bypassed"]:
        print(f"# fla's Hopper guard (Triton {guard['triton']} < 3.7.1) bypassed: the check below measures the "
              f"values of the backward kernels the rows time", flush=True)
    elif guard["active"] is True and do_bwd:
        print("# fla's Hopper guard is active and not bypassed: GDN's and BL's backward=\"scan\" forward+backward "
              "will fail (--gdn-bypass-hopper-guard runs them)", flush=True)
    else:
        print(f"# fla's Hopper guard: {'not active here' if guard['active'] is False else guard['active']} "
              f"(Triton {guard['triton']}, fla {guard['fla']})", flush=True)
    print(f"# phase check ({time.time() - t_start:.0f} s)", flush=True)
    save([{"kind": "started", "hopper_guard": guard}])  # a run killed in its check still leaves a file
    phase = getattr(args, "phase", "all")
    if phase == "fwdbwd":  # the backward's value checks, in the process that times the backward
        check = {"kind": "check", "phase": phase, **fla_hopper_guard(bypass=False)}
        t0 = time.time()
        check.update(_check_gdn_backward(device, args.dry_run))
        check.update(_check_bl_backward(device, args.dry_run))
        check["bwd_check_s"] = round(time.time() - t0, 1)
        print(f"# check: {json.dumps(check)}", flush=True)
    else:  # forward values only: the backward's checks (and their compiles) wait for the fwdbwd phase
        saved_no_bwd = args.no_bwd
        args.no_bwd = args.no_bwd or phase != "all"
        check = {"kind": "check", "phase": phase, **scan_check(args, device, guard)}
        args.no_bwd = saved_no_bwd
    rows: list[dict] = [check]
    rows.append({"kind": "setup", "fwdbwd": do_bwd, "bl_leaves": list(BL_LEAVES), "gdn_leaves": list(GDN_LEAVES),
                 "reps": args.reps, "bwd_reps": args.bwd_reps, "blockwise_max_T": args.blockwise_max_T,
                 "budget_s": args.budget_s, "fwd_budget_s": fwd_budget, "dtype": args.dtype,
                 "chunk_size": args.chunk_size, "H": args.H, "hopper_guard": guard,
                 "fla_autotune": getattr(args, "fla_autotune", "warm")})
    save(rows)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    print(f"# {name} | scan v2 | dtype={args.dtype} chunk={args.chunk_size} | fwd+bwd "
          f"{'grads of ' + ','.join(BL_LEAVES) + ' (BL) / ' + ','.join(GDN_LEAVES) + ' (GDN)' if do_bwd else 'off'}"
          f" | {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    shapes = [("latency", args.B, T, D) for T in args.T for D in args.D]
    shapes += [("occupancy", args.occ_B, T, D) for T in args.T for D in args.D]
    shapes.sort(key=lambda r: r[1] * r[2] * r[3] ** 2)  # cheapest first: a cut-short run keeps the most rows
    for D in sorted(set(args.D), key=lambda d: min(s[1] * s[2] * d ** 2 for s in shapes if s[3] == d)):
        if phase not in ("all", "check"):
            break
        if time.time() - t_start > fwd_budget:
            rows.append({"kind": "skipped", "rows_left": f"row_check D={D} and later"})
            break
        rec = _check_row_values(args, device, dtype, D)
        rows.append(rec)
        print(f"# row check D={D}: {json.dumps(rec)}", flush=True)
        save(rows)

    print(f"# phase fwd ({time.time() - t_start:.0f} s)", flush=True)
    measured: list[dict] = []
    if phase == "check":
        _print_scan_table(rows)
        print(f"# value checks done in {time.time() - t_start:.0f} s", flush=True)
        return rows
    if phase == "fwdbwd":  # this process times forward+backward only, for the same rows
        measured = [{"kind": kind, "B": B, "H": args.H, "T": T, "D": D, "dtype": args.dtype}
                    for kind, B, T, D in shapes]
        rows += measured
    for kind, B, T, D in shapes if phase in ("all", "fwd") else []:
        if time.time() - t_start > fwd_budget:
            rows.append({"kind": "skipped", "rows_left": f"forward {kind} B={B} T={T} D={D} and later"})
            print(f"# forward budget of {fwd_budget:.0f} s spent: not starting {kind} B={B} T={T} D={D}", flush=True)
            break
        rec = {"kind": kind, "B": B, "H": args.H, "T": T, "D": D, "dtype": args.dtype}
        rows.append(rec)
        head = f"{kind:>9} B={B:<2} T={T:>6} D={D:>4} |"
        try:
            _fwd_row(rec, _make_inputs(B, T, args.H, D, dtype, device), args, device)
            measured.append(rec)
            print(f"{head} GDN {rec['gdn_fwd_s'] * 1e3:8.2f} ms | BL ({rec['bl_path']}) "
                  f"{rec['bl_fwd_s'] * 1e3:8.2f} ms (chain {rec['bl_chain_fwd_s'] * 1e3:.2f}, scan "
                  f"{rec['bl_scan_fwd_s'] * 1e3:.2f}) | ratio {rec['ratio_fwd']:6.2f} | mem ratio "
                  f"{rec['ratio_mem'] or float('nan'):5.2f} | scan phases ms "
                  f"{json.dumps({n: round(v * 1e3, 2) for n, v in rec['bl_scan_phases_s'].items()})}", flush=True)
        except Exception as err:  # one failing row (OOM, compile error) must not hide the others
            rec["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            print(f"{head} forward failed: {rec['error']}", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
        save(rows)

    do_bwd = do_bwd and phase in ("all", "fwdbwd")
    if do_bwd:
        print(f"# phase fwdbwd ({time.time() - t_start:.0f} s)", flush=True)
    warmed: set[int] = set()
    for rec in measured if do_bwd else []:
        kind, B, T, D = rec["kind"], rec["B"], rec["T"], rec["D"]
        if time.time() - t_start > args.budget_s:
            rows.append({"kind": "skipped", "rows_left": f"forward+backward {kind} B={B} T={T} D={D} and later"})
            print(f"# budget of {args.budget_s:.0f} s spent: no forward+backward from {kind} B={B} T={T} D={D}",
                  flush=True)
            break
        head = f"{kind:>9} B={B:<2} T={T:>6} D={D:>4} |"
        if D not in warmed:  # first calls per head dim: fla's backward autotuning, the B2-B4 compiles
            warmed.add(D)
            w = {"kind": "warm_bwd", "D": D}
            xw = _make_inputs(1, args.warm_T, args.H, D, dtype, device)
            for key, make in _fwdbwd_variants(xw, _cotangent(xw), args):
                t1 = time.time()
                try:
                    make()()
                    _sync(device)
                    w[f"{key}_fwdbwd_first_s"] = round(time.time() - t1, 1)
                except Exception as err:  # recorded here and again in the rows
                    w[f"{key}_fwdbwd_error"] = f"{type(err).__name__}: {str(err)[:200]}"
            rows.append(w)
            print(f"# warm D={D} forward+backward: {json.dumps(w)}", flush=True)
            save(rows)
        x = _make_inputs(B, T, args.H, D, dtype, device)
        _fwdbwd_row(rec, x, args, device, t_start)
        x = None  # this row's inputs go before the next row allocates its own
        print(f"{head} f+b GDN {_fwdbwd_cols(rec, 'gdn')} | BL scan "
              f"{_fwdbwd_cols(rec, 'bl_scan')} | chain {_fwdbwd_cols(rec, 'bl_chain')} | ratio ({rec['bl_path']}) "
              f"{rec.get('ratio_fwdbwd') or float('nan'):6.2f} | mem ratio "
              f"{rec.get('ratio_fwdbwd_mem') or float('nan'):5.2f}"
              + (f" | chunk {args.alt_chunk}: {_fwdbwd_cols(rec, f'bl_scan_c{args.alt_chunk}')}, ratio "
                 f"{rec.get('ratio_fwdbwd_alt_chunk') or float('nan'):6.2f}" if args.alt_chunk else ""), flush=True)
        for key in ("gdn", "bl_scan", "bl_chain", f"bl_scan_c{args.alt_chunk}"):
            if f"{key}_fwdbwd_error" in rec:
                print(f"{'':>9} {key} forward+backward failed: {rec[f'{key}_fwdbwd_error'][:200]}", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
        save(rows)
    # segment-count sweep at the longest latency row that fits the budget (forwards only)
    for D in args.sweep_D if phase == "all" else []:
        T = max(args.T)
        for n_seg in args.sweep:
            if time.time() - t_start > args.budget_s:
                break
            rec = {"kind": "sweep", "B": args.B, "H": args.H, "T": T, "D": D, "n_segments": n_seg}
            rows.append(rec)
            try:
                x = _make_inputs(args.B, T, args.H, D, dtype, device)
                phases = {}
                _scan_fwd(x, args.chunk_size, n_segments=n_seg, timings=phases)()
                rec["bl_fwd_s"] = _time_any(_scan_fwd(x, args.chunk_size, n_segments=n_seg), args.reps, 1, device)
                rec["bl_phases_s"] = phases
                print(f"    sweep T={T} D={D} segments={n_seg:>3}: {rec['bl_fwd_s'] * 1e3:8.2f} ms "
                      f"{json.dumps({n: round(v * 1e3, 2) for n, v in phases.items()})}", flush=True)
            except Exception as err:
                rec["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                print(f"    sweep T={T} D={D} segments={n_seg}: failed: {rec['error']}", flush=True)
            save(rows)
    _print_scan_table(rows)
    print(f"# scan check done in {time.time() - t_start:.0f} s", flush=True)
    return rows


def _print_scan_table(rows: list[dict]) -> None:
    """The rows of :func:`run_scan`, one line each: forward and forward+backward ms, ratios, peak GiB."""
    header = (f"{'kind':>9} {'B':>2} {'T':>6} {'D':>4} | {'GDN fwd':>8} {'BL fwd':>8} {'ratio':>6} | {'GDN f+b':>8} "
              f"{'BL scan':>8} {'chain':>8} {'ratio':>6} | {'GDN GiB':>7} {'BL GiB':>7} {'ratio':>6} | path")
    print("# ms (median), peak GiB above the inputs of forward+backward; ratios BL (its default path, fla's mean "
          "pass) / GDN")
    print(header)
    print("-" * len(header))
    nan = float("nan")

    def ms(rec, key):
        return rec[key] * 1e3 if isinstance(rec.get(key), (int, float)) else nan

    def gib(rec, key):
        return rec[key] / 2**30 if isinstance(rec.get(key), (int, float)) else nan

    for rec in rows:
        if rec.get("kind") not in ("latency", "occupancy"):
            continue
        print(f"{rec['kind']:>9} {rec['B']:>2} {rec['T']:>6} {rec['D']:>4} | {ms(rec, 'gdn_fwd_s'):>8.2f} "
              f"{ms(rec, 'bl_fwd_s'):>8.2f} {rec.get('ratio_fwd') or nan:>6.2f} | {ms(rec, 'gdn_fwdbwd_s'):>8.2f} "
              f"{ms(rec, 'bl_scan_fwdbwd_s'):>8.2f} {ms(rec, 'bl_chain_fwdbwd_s'):>8.2f} "
              f"{rec.get('ratio_fwdbwd') or nan:>6.2f} | {gib(rec, 'gdn_fwdbwd_mem'):>7.3f} "
              f"{gib(rec, 'bl_' + str(rec.get('bl_path')) + '_fwdbwd_mem'):>7.3f} "
              f"{rec.get('ratio_fwdbwd_mem') or nan:>6.2f} | {rec.get('bl_path')}", flush=True)


_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def sass_census(sass: str, resources: str = "") -> dict:
    """Instruction counts of one kernel's SASS (``cuobjdump -sass`` output) by ``kernel_sass.SASS_FAMILIES``, the
    tensor-core opcodes one by one, and registers / local-memory stack (spills, bytes) from ``cuobjdump
    -res-usage``'s line (``kernel_sass.opcode_census``). Unlike ``kernel_sass.sass_census`` it counts every
    instruction line without its control word and takes empty text (a kernel that did not compile).

    Static counts (instructions in the binary, not executed ones): a loop body counts once."""
    if not isinstance(sass, str) or not isinstance(resources, str):
        raise TypeError("sass and resources must be str (cuobjdump's output)")
    ops: dict[str, int] = {}
    for line in sass.splitlines():
        m = _SASS_LINE.match(line)
        if m:
            ops[m.group(1)] = ops.get(m.group(1), 0) + 1
    return ks.opcode_census(ops, resources)


def print_census(rows: list[dict]) -> None:
    """The SASS census of :func:`compile_only`'s rows as a table."""
    header = (f"{'kernel':>9} {'D':>4} {'decay':>5} {'warps':>5} | {'regs':>4} {'spill B':>7} | {'tensor core':>11} "
              f"{'FFMA':>6} {'DFMA':>6} {'FMUL+FADD':>9} {'DMUL+DADD':>9} {'total':>6} | tensor-core opcodes")
    print("# SASS census (static instruction counts in each compiled kernel)")
    print(header)
    print("-" * len(header))
    for r in rows:
        decay = "diag" if r.get("diagonal") else "scal"
        if "error" in r or "sass_total" not in r:
            print(f"{r['kernel']:>9} {r['D']:>4} {decay:>5} {r.get('num_warps', ''):>5} | failed: "
                  f"{str(r.get('error', 'no SASS'))[:80]}")
            continue
        print(f"{r['kernel']:>9} {r['D']:>4} {decay:>5} {r['num_warps']:>5} | {r['registers'] or '?':>4} "
              f"{r['spill_bytes'] if r['spill_bytes'] is not None else '?':>7} | {r['sass_tensor_core']:>11} "
              f"{r['sass_FFMA']:>6} {r['sass_DFMA']:>6} {r['sass_FMUL_FADD']:>9} {r['sass_DMUL_DADD']:>9} "
              f"{r['sass_total']:>6} | {json.dumps(r['sass_tensor_core_ops'])}", flush=True)


def _role(kernel: str, phases: set, module: str = "") -> str:
    """What a default-path kernel does, from its name, its module and when it launches (fla's forward kernels are
    the mean pass)."""
    name = kernel.lower()
    if "bwd" in phases and "fwd" not in phases:
        return "backward"
    if module.startswith("fla."):
        return "mean"
    for key, role in (("prep", "prep"), ("mean", "mean"), ("cov", "covariance"), ("chain", "covariance"),
                      ("phase_b", "segment"), ("track", "segment"), ("adj", "backward"), ("rev", "backward")):
        if key in name:
            return role
    return "other"


def default_path_census(D_list, out_path: Path | None = None, T: int = 128, H: int = 2) -> list[dict]:
    """Every kernel BL's default bf16 forward and backward launch (``bl_chunk(..., backend="triton")`` and
    ``.backward()``; found by running the dispatch in Triton's interpreter with the launches recorded, not from a
    list), compiled for sm_90 as the JIT would compile it: rows ``kernel``, ``role``, ``D``, ``triton``,
    ``sass_tensor_core``, ``spill_bytes``, ``shared_bytes`` (and registers, warps, which phase launched it, the
    opcode census).  Also a call on the segment scan, the other covariance pass ``covariance_path`` picks (for
    key dims above 128 and, by the cost model's crossover, a few long chains), long enough for several segments
    (T = 8k at one head on 33 SMs), so that its kernels are found whatever the crossover's figures say."""
    import triton

    rows = []
    for D in D_list:
        seen: dict = {}
        jobs = [dict(which="bl", B=1, T=T, H=H, D=D, dtype="bf16", backward=True),
                dict(which="bl", B=1, T=8192, H=1, D=D, dtype="bf16", backward=True, sms=33, path="scan")]
        for rec in ks.record_many(jobs):
            for x in rec["launches"]:
                key = ks.launch_key(x)
                seen.setdefault(key, [x, set()])[1].add(x["phase"])
        for x, phases in seen.values():
            row = {"kernel": x["kernel"], "role": _role(x["kernel"], phases, x["module"]), "D": D,
                   "triton": triton.__version__,
                   "phases": sorted(phases), "num_warps": x["options"].get("num_warps"),
                   "num_stages": x["options"].get("num_stages"), "module": x["module"]}
            t0 = time.time()
            try:
                c = ks.compile_launch(x)
                census = ks.sass_census(c["sass"], c["resources"])
                row.update(sass_tensor_core=census["sass_tensor_core"], spill_bytes=census["spill_bytes"],
                           shared_bytes=c["shared_bytes"], registers=census["registers"],
                           sass_tensor_core_ops=census["sass_tensor_core_ops"], sass_FFMA=census["sass_FFMA"],
                           sass_DFMA=census["sass_DFMA"], sass_total=census["sass_total"],
                           fits_h200_shared=c["shared_bytes"] <= 227 * 1024)
            except Exception as err:  # recorded: a kernel that does not compile is a finding
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            row["compile_s"] = round(time.time() - t0, 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
            if out_path is not None:
                _save(out_path, rows)
    return rows


def compile_only(args, save=None) -> list[dict]:
    """AOT-compile the kernels for ``--arch`` (no GPU needed); report registers, spills and shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bayeslayer.ops.bayesian_layer.kernels_triton import bl_chunk_cov_kernel, bl_chunk_mean_kernel, bl_step_kernel
    from bayeslayer.ops.bayesian_layer.step_triton import step_tiles
    from bayeslayer.ops.bayesian_layer.triton_support import tile_sizes

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    C = args.chunk_size
    out = []
    from bayeslayer.ops.bayesian_layer.kernels_triton import bl_chunk_prep_kernel
    from bayeslayer.ops.bayesian_layer.scan_backward_triton import (
        scan_reverse_kernel,
        scan_segment_adjoint_kernel,
        segment_adjoint_tiles,
    )
    from bayeslayer.ops.bayesian_layer.scan_triton import scan_phase_b_kernel, scan_track_kernel

    configs = [(k, D, g, False) for k in ("cov", "mean", "step") for D in args.D for g in (False, True)]
    # the segment scan's kernels: Phase A runs the covariance kernel in float64, then the tracking kernel;
    # the prep kernel (float64 for Phase A, fp32 for Phase C, which reads qᵀBq too) and the covariance
    # kernel reading its buffers (covp: Phase C, fp32; covp64: Phase A, float64)
    configs += [(k, D, g, False) for k in ("cov64", "track64", "prep", "prep64", "covp", "covp64") for D in args.D
                for g in (False, True)]
    # Phase B as one kernel (float64, no decay variants)
    configs += [("phaseb64", D, False, False) for D in args.D]
    # the backward through the scan: B2 (segadj: replay + adjoint), B4 (segadj4; segadj4v with a variance adjoint),
    # fp32 as the backward of fp32/16-bit inputs runs them; B3 (rev64: float64, no decay variants)
    configs += [(k, D, g, False) for k in ("segadj", "segadj4", "segadj4v") for D in args.D for g in (False, True)]
    configs += [("rev64", D, False, False) for D in args.D]
    # the default path: the covariance chain's forward and backward as bf16 inputs launch them (q, k, v bf16, the
    # mean pass's operands and the state fp32, the variance on, the backward's checkpoints kept)
    configs += [(k, D, g, False) for k in ("chain", "chainb") for D in args.D for g in (False, True)]
    # and in float64 arithmetic, as fp32 inputs launch them up to chain_triton.FLOAT64_MAX_HEAD_DIM
    configs += [(k, D, g, False) for k in ("chain64", "chainb64") for D in args.D for g in (False, True)]
    configs = [c for c in configs if not args.kernels or c[0] in args.kernels]
    prep_names = ["PG", "PB", "PBASE", "PQN", "chunk_first"]
    for kernel, D, diag, save_ck in configs:
        BD, BK, BV = tile_sizes(D, D)
        common = dict(H=16, D=D, BD=BD, BK=BK, DIAG=diag, HAS_ALPHA=True)
        nw = 8 if C >= 64 else 4
        stages = None
        fp64 = bf16 = ()
        if kernel in ("cov", "cov64", "covp", "covp64"):
            fn = bl_chunk_cov_kernel
            names = ["q", "k", "r2", "ell2", "la", "cu_seqlens", "P", "W", "LINV", "Yscr", "Uscr", "VAR", "LDLscr",
                     "FAIL"]
            # without the variance, as the cov/cov64 rows, so that the registers and spills compare
            consts = dict(common, C=C, RETURN_VAR=False, PREC="ieee")
            if kernel in ("covp", "covp64"):
                names += prep_names
                consts["PREP"] = True
            else:  # every parameter needs a type, the defaulted ones too
                consts.update({n: None for n in prep_names}, PREP=False)
            if kernel in ("cov64", "covp64"):  # as phase_a_triton launches it (per-channel decays in float64 too)
                fp64 = ("P", "W", "LINV", "Yscr", "Uscr", "VAR", "LDLscr", "PG", "PB", "PBASE", "PQN") + (
                    ("la",) if diag else ())
        elif kernel in ("prep", "prep64"):
            fn, nw = bl_chunk_prep_kernel, 4
            names = ["q", "k", "r2", "ell2", "la", "chunk_bos", "chunk_eos", "PG", "PB", "PBASE", "PQN"]
            consts = dict(H=16, D=D, C=C, BD=BD, BK=16, DIAG=diag, RETURN_VAR=kernel == "prep", PREC="ieee")
            fp64 = ("PG", "PB", "PBASE", "PQN") if kernel == "prep64" else ()
        elif kernel == "track64":
            fn, nw = scan_track_kernel, 4
            names = ["W", "KW", "BETA", "la", "cu_seg", "segs", "A", "J", "Hscr"]
            consts = dict(H=16, D=D, C=C, BD=BD, BK=16, DIAG=diag, PREC="ieee")
            fp64 = ("W", "KW", "BETA", "A", "J", "Hscr")
        elif kernel == "phaseb64":
            fn, nw = scan_phase_b_kernel, 4
            names = ["PS", "A", "CM", "J", "elem_of_seg", "seq_first", "seq_nseg", "SCR", "FAIL"]
            consts = dict(H=16, D=D, NB=BD // 16, PREC="ieee")
            fp64 = ("PS", "A", "CM", "J", "SCR")
        elif kernel in ("segadj", "segadj4", "segadj4v"):
            fn = scan_segment_adjoint_kernel
            names = ["Q", "K", "V", "R2", "ELL2", "LA", "PG", "PB", "PBASE", "chunk_first", "DW", "DBETA", "DLINV",
                     "DVAR", "DKW", "DVU", "DG", "cu_seg", "PST", "PEND", "PSCR", "WS", "LDLSCR", "DPST", "FAIL", "GQ",
                     "GK", "GV", "GR2", "GELL2", "GLA"]
            tiles = segment_adjoint_tiles(D, D, C)
            nw = tiles.pop("num_warps")
            consts = dict(H=16, D=D, MV=D, C=C, NS=16, DIAG=diag, VAR=kernel == "segadj4v",
                          INPUTS=kernel != "segadj", REPLAY=kernel == "segadj", PREC="ieee", **tiles)
        elif kernel == "rev64":
            fn, nw = scan_reverse_kernel, 4
            names = ["PB", "PS", "A", "J", "elem_of_seg", "seq_first", "seq_nseg", "SCR", "FAIL"]
            consts = dict(H=16, D=D, NB=BD // 16, PREC="ieee")
            fp64 = ("PB", "PS", "A", "J", "SCR")
        elif kernel in ("chain", "chainb", "chain64", "chainb64"):
            from bayeslayer.ops.bayesian_layer import chain_triton as tchain
            from bayeslayer.ops.bayesian_layer.chunk_triton import CHAIN_CHUNK_SIZE

            tiles = tchain.launch_options(D, D, CHAIN_CHUNK_SIZE)
            nw, stages = tiles.pop("num_warps"), tiles.pop("num_stages")
            # chain/chainb: as bf16 inputs launch them; chain64/chainb64: as fp32 inputs do up to
            # chain_triton.FLOAT64_MAX_HEAD_DIM ("float64": the state and the checkpoints float64, IEEE products; the
            # mean pass's operands and the outputs fp32)
            if kernel.endswith("64"):
                _, prec = tchain.kernel_arithmetic(torch.float32, "float64", torch.float32, D)
            else:
                _, prec = tchain.kernel_arithmetic(torch.float32, None, torch.bfloat16, D)
            consts = dict(H=16, D=D, MV=D, C=CHAIN_CHUNK_SIZE, DIAG=diag, WANT_VAR=True,
                          KX=not kernel.endswith("64"), PREC=prec, INTERP=False, **tiles)
            bf16 = () if kernel.endswith("64") else ("Q", "K", "V")
            fp64 = ("P0", "PCK", "FCK") if kernel.endswith("64") else ()
            if kernel in ("chain", "chain64"):
                fn = tchain.chain_forward_kernel
                names = ["Q", "K", "V", "R2", "ELL2", "LA", "CU", "CKO", "P0", "W", "KW", "VU", "GOUT", "VAR", "PT",
                         "PCK", "FCK", "FAIL"]
                consts["SAVE_P"] = True
            else:
                fn = tchain.chain_backward_kernel
                names = ["Q", "K", "V", "R2", "ELL2", "LA", "CU", "CKO", "PCK", "FCK", "W", "KW", "DW", "DKW", "DVU",
                         "DVAR", "DPT", "DQ", "DK", "DV", "DR2", "DELL2", "DLA", "DP0", "FAIL"]
                # the forward's W and kw (fp32) are read where the kernels compute in fp32, formed again in float64
                consts.update(HAS_DPT=True, READ_WKW=not kernel.endswith("64"))
        elif kernel == "mean":
            fn = bl_chunk_mean_kernel
            names = ["q", "k", "v", "W", "LINV", "la", "cu_seqlens", "M", "O"]
            consts = dict(common, MV=D, C=C, BV=BV, PREC="ieee")
        else:
            fn, nw = bl_step_kernel, 4
            names = ["q", "k", "v", "r2", "ell2", "la", "P_in", "M_in", "P_out", "M_out", "Uscr", "O", "VAR"]
            BK_step, BV_step = step_tiles(D, D)[1:]
            consts = dict(common, BK=BK_step, MV=D, BMV=BD, BV=BV_step)
        sig = {n: ("*i64" if n in ("cu_seqlens", "cu_seg", "segs", "elem_of_seg", "seq_first",
                                   "seq_nseg", "chunk_bos", "chunk_eos", "chunk_first", "CU", "CKO") else
                   "*i32" if n == "FAIL" else "*fp64" if n in fp64 else "*bf16" if n in bf16 else "*fp32")
               for n in names}
        sig.update({n: "constexpr" for n in consts})
        t0 = time.time()
        rec = {"kernel": kernel, "D": D, "diagonal": diag, "checkpoints": save_ck, "chunk_size": consts.get("C", C),
               "num_warps": nw}
        try:
            opts = {"num_warps": nw} if stages is None else {"num_warps": nw, "num_stages": stages}
            compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                                      target=GPUTarget("cuda", args.arch, 32), options=opts)
            rec["shared_bytes"] = compiled.metadata.shared
            cubin = Path("/tmp") / f"bl_{kernel}_{D}_{int(diag)}_{int(save_ck)}.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True)
            rec["resources"] = next((ln.strip() for ln in usage.stdout.splitlines() if "REG" in ln), "")
            sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True)
            rec.update(sass_census(sass.stdout, rec["resources"]))
        except Exception as err:
            rec["error"] = f"{type(err).__name__}: {err}"
        rec["compile_s"] = round(time.time() - t0, 1)
        print(json.dumps(rec), flush=True)
        out.append(rec)
        if save is not None:
            save(out)
    print_census(out)
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
    p.add_argument("--no-bwd", action="store_true",
                   help="forward only (--scan: no forward+backward measurements, no backward value checks)")
    p.add_argument("--bwd-reps", type=int, default=2,
                   help="--scan: timed forward+backward calls per measurement (after one that measures memory)")
    p.add_argument("--alt-chunk", type=int, default=32, choices=[0, 16, 32, 64],
                   help="--scan: also time BL's scan forward+backward at this chunk size (0: not)")
    p.add_argument("--blockwise-max-T", type=int, default=8192,
                   help="--scan: no longer used (the block-wise backward it limited is gone); kept so that older "
                        "command lines still parse")
    p.add_argument("--quick", action="store_true", help="T = 2048 only")
    p.add_argument("--compile-only", action="store_true", help="AOT-compile for --arch, no GPU needed")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler kernel table of BL forward and forward+backward at the first T, D")
    p.add_argument("--variants", action="store_true",
                   help="forward time and error per chunk size and fp32 product precision, first T, each D")
    p.add_argument("--bl-only", action="store_true", help="measure BL only (no flash-linear-attention needed)")
    p.add_argument("--gdn-bypass-hopper-guard", action="store_true",
                   help="time fla's GDN backward even where fla refuses it (Hopper, Triton < 3.7.1); with --scan "
                        "also BL's backward=\"scan\" (its mean pass calls the same fla kernel), values checked first")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability for --compile-only")
    p.add_argument("--kernels", nargs="*", choices=["cov", "mean", "step", "cov64", "track64", "phaseb64", "prep",
                                                    "prep64", "covp", "covp64", "segadj", "segadj4", "segadj4v",
                                                    "rev64", "chain", "chainb", "chain64", "chainb64"],
                   help="--compile-only: these kernels only (default all)")
    p.add_argument("--scan", action="store_true", help="v2: segment-scan forward vs GDN forward (module docstring)")
    p.add_argument("--fla-autotune", choices=["pin", "warm"], default="warm",
                   help="--scan: pin every fla autotuner to its first config, or let fla autotune once per head dim")
    p.add_argument("--phase", choices=["all", "check", "fwd", "fwdbwd"], default="all",
                   help="--scan: one phase of the device check per process (benchmarks/gpu_session.sh): forward value "
                        "checks and row checks, forward rows, or the backward's value checks then forward+backward "
                        "rows; all: everything in one process")
    p.add_argument("--dry-run", action="store_true",
                   help="with --scan on a CPU (TRITON_INTERPRET=1): tiny shapes, the same code path")
    p.add_argument("--occ-B", type=int, default=9, help="--scan: batch of the full-occupancy rows (B·H ≥ 132)")
    p.add_argument("--warm-T", type=int, default=1024, help="--scan: sequence length of fla's autotune warm-up")
    p.add_argument("--budget-s", type=float, default=420.0, help="--scan: start no row after this many seconds")
    p.add_argument("--fwd-budget-s", type=float, default=None,
                   help="--scan: start no forward row after this many seconds (default --budget-s); the "
                        "forward+backward rows follow until --budget-s")
    p.add_argument("--sweep", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="--scan: segment counts")
    p.add_argument("--sweep-D", type=int, nargs="*", default=[64, 128], help="--scan: head dims of the sweep")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu.json"))
    p.add_argument("--default-path", action="store_true",
                   help="--compile-only: every kernel the default bf16 forward and backward launch (found from the "
                        "dispatch), D = 64 and 128 unless --D is given")
    p.add_argument("--json", type=Path, default=None, help="--compile-only --default-path: where the rows go")
    args = p.parse_args(argv)
    args.D_given = argv is not None and "--D" in argv or argv is None and "--D" in sys.argv[1:]
    for name in ("reps", "bwd_reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.blockwise_max_T < 0:
        p.error(f"--blockwise-max-T must be >= 0, got {args.blockwise_max_T}")
    if args.quick:
        args.T = [2048]
    if args.scan and args.dry_run:
        # the interpreter runs every kernel in NumPy: tiny shapes, same code path
        args.T, args.D, args.B, args.occ_B, args.H, args.chunk_size, args.dtype = [96], [16], 1, 2, 2, 16, "fp32"
        args.warm_T, args.reps, args.warmup, args.sweep, args.sweep_D = 32, 1, 0, [1, 3], [16]
        args.bwd_reps = 1
    if args.compile_only and args.default_path:
        out = args.json or args.out
        # rows so far go to a file beside the record until the last one: the record is written once, so that its
        # provenance sees the checkout as it was (not the record half-written)
        partial = out.with_name(out.stem + ".partial.json")
        rows = default_path_census([d for d in args.D if d <= 256] if args.D_given else [64, 128], partial)
        _save(out, rows)
        partial.unlink(missing_ok=True)
        print(f"wrote {out}")
        bad = [r for r in rows if "error" in r]
        return 1 if bad else 0
    if args.compile_only:
        rows = compile_only(args, lambda rows: _save(args.out, rows))
    elif args.scan and (args.dry_run or torch.cuda.is_available()):
        rows = run_scan(args, lambda rows: _save(args.out, rows))
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
    # the command line is the record's provenance.command (named relative to the checkout), not repeated here
    meta = {"torch": torch.__version__,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        meta["device"] = torch.cuda.get_device_name()
    from bayeslayer.experiments.common.provenance import write_record

    write_record(path, {"meta": meta, "rows": rows}, device=meta.get("device", "cpu"))


if __name__ == "__main__":
    sys.exit(main())
