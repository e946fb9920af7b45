"""``torch.compile`` against eager mode on the CPU: what the first compile costs and what it buys after.

    python benchmarks/compile.py                                  # the default workloads, table only
    python benchmarks/compile.py --out results/compile/cpu.json   # also the JSON record the docs' table reads
    python benchmarks/compile.py --quick                          # tiny sizes, a smoke run

For every workload (a mixer or the language model at a CPU size, forward or forward + backward) the script
times, in one process:

* **eager**: the call as written, value checks on (the default: CPU tensors are checked in eager mode);
* **eager, checks off**: the same under ``bayeslayer.ops.value_checks(False)``;
* **first compiled call**: ``torch.compile(fullgraph=True)`` (Inductor) from cold: Dynamo's trace, AOTAutograd,
  Inductor's code generation and the C++ compiler, with an empty Inductor cache (a fresh
  ``TORCHINDUCTOR_CACHE_DIR``), then the call itself;
* **compiled**: later calls of the compiled function (no value checks inside a compiled graph).

Every time is taken twice: wall-clock, and CPU seconds (this process's, and those of the processes it
waited for, such as the C++ compiler; Inductor compiles in this process, ``compile_threads = 1``).  With
one thread, CPU seconds hardly move when other jobs share the machine, wall seconds do; the table shows CPU
seconds and the record keeps both.  Steady times are the median of ``--repeats`` calls after ``--warmup``
calls.  The record also keeps the 1-minute load average at the start and end of each workload.
A compiled function is specialised to its shapes: another sequence length compiles again (the chunk loop
is unrolled, so a longer sequence is a larger graph).  Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def workloads(quick: bool) -> dict:
    """name -> (builder, batch, length, backward); the builder returns ``(module, make_inputs, run)``."""
    import torch

    from bayeslayer.layers import build_mixer
    from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM

    hidden, heads, head_dim, T, B = (32, 2, 16, 32, 1) if quick else (256, 4, 64, 256, 2)
    vocab = 256 if quick else 4096

    def mixer(name):
        def build():
            torch.manual_seed(0)
            m = build_mixer(name, hidden, num_heads=heads, head_dim=head_dim)
            return m, lambda: (torch.randn(B, T, hidden),), lambda x: m(x).o
        return build

    def model():
        torch.manual_seed(0)
        config = BayesLayerConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, num_heads=heads,
                                  head_dim=head_dim, mixers=["bayesian", "gated_deltanet"])
        m = BayesLayerForCausalLM(config).train()
        g = torch.Generator().manual_seed(0)
        return m, lambda: (torch.randint(0, vocab, (B, T), generator=g),), lambda ids: m(input_ids=ids, labels=ids).loss

    return {
        "bayesian layer, forward": (mixer("bayesian"), B, T, False),
        "bayesian layer, forward + backward": (mixer("bayesian"), B, T, True),
        "gated_deltanet layer, forward": (mixer("gated_deltanet"), B, T, False),
        "gated_deltanet layer, forward + backward": (mixer("gated_deltanet"), B, T, True),
        "model (BL + GDN layers), forward + backward": (model, B, T, True),
    }, {"hidden": hidden, "num_heads": heads, "head_dim": head_dim, "batch": B, "length": T, "vocab": vocab}


def cpu_seconds() -> float:
    """CPU seconds of this process (``time.process_time``: every thread, fine-grained) and of the children it
    waited for (``os.times``, counted in clock ticks: only the compiler runs there)."""
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


def timed(fn, args, backward: bool) -> tuple[float, float]:
    """``(wall, CPU)`` seconds of one call (and its backward)."""
    import torch

    c0, t0 = cpu_seconds(), time.perf_counter()
    out = fn(*args)
    if backward:
        out.float().sum().backward() if out.dim() else out.backward()
    else:
        torch.utils._pytree.tree_map(lambda t: t.sum().item() if isinstance(t, torch.Tensor) else t, out)
    return time.perf_counter() - t0, cpu_seconds() - c0


def measure(name, spec, repeats: int, warmup: int) -> dict:
    import torch
    import torch._dynamo

    from bayeslayer.ops import value_checks

    build, B, T, backward = spec
    module, inputs, run = build()
    load_start = os.getloadavg()[0]
    grad = torch.enable_grad() if backward else torch.no_grad()
    with grad:
        def steady(fn, checks) -> tuple[float, float]:
            with value_checks(checks):
                for _ in range(warmup):
                    module.zero_grad(set_to_none=True)
                    timed(fn, inputs(), backward)
                times = []
                for _ in range(repeats):
                    module.zero_grad(set_to_none=True)
                    times.append(timed(fn, inputs(), backward))
            return statistics.median(w for w, _ in times), statistics.median(c for _, c in times)

        eager = steady(run, "auto")
        eager_off = steady(run, False)
        torch._dynamo.reset()
        compiled = torch.compile(run, fullgraph=True, dynamic=False)
        module.zero_grad(set_to_none=True)
        first = timed(compiled, inputs(), backward)
        done = steady(compiled, "auto")
    row = {"workload": name, "backward": backward, "tokens": B * T, "load_start": load_start,
           "load_end": os.getloadavg()[0]}
    for key, (wall, cpu) in (("eager", eager), ("eager_checks_off", eager_off), ("first_compiled_call", first),
                             ("compiled", done)):
        row[f"{key}_s"], row[f"{key}_cpu_s"] = wall, cpu
    row["speedup_cpu"] = eager[1] / done[1]
    row["speedup_vs_checks_off_cpu"] = eager_off[1] / done[1]
    print(f"{name}: CPU time eager {eager[1] * 1e3:.1f} ms, checks off {eager_off[1] * 1e3:.1f} ms, compiled "
          f"{done[1] * 1e3:.1f} ms; first compiled call {first[1]:.0f} s CPU ({first[0]:.0f} s wall)",
          file=sys.stderr, flush=True)
    return row


def table(rows) -> str:
    """CPU seconds (see the module docstring); the first compiled call also in wall seconds."""
    lines = ["| workload | eager (ms) | eager, checks off (ms) | compiled (ms) | speed-up | first compiled call (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['eager_cpu_s'] * 1e3:.1f} | {r['eager_checks_off_cpu_s'] * 1e3:.1f} | "
                     f"{r['compiled_cpu_s'] * 1e3:.1f} | {r['speedup_cpu']:.2f} | "
                     f"{r['first_compiled_call_cpu_s']:.0f} ({r['first_compiled_call_s']:.0f} wall) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="also write the rows as a JSON results record here")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per setting (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls before them")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--only", nargs="+", default=None, help="run only the workloads whose name starts so")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--repeats and --threads must be >= 1, --warmup >= 0")
    # a cold compile: Inductor's on-disk caches start empty (set before torch is imported), removed at the end
    with tempfile.TemporaryDirectory(prefix="bench-compile-inductor-") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        run(args, parser)


def run(args, parser) -> None:
    sys.path.insert(0, str(ROOT))
    import torch
    import torch._inductor.config

    torch.set_num_threads(args.threads)
    torch._inductor.config.compile_threads = 1  # compile in this process, so its CPU time is counted
    specs, sizes = workloads(args.quick)
    if args.only:
        specs = {k: v for k, v in specs.items() if any(k.startswith(p) for p in args.only)}
        if not specs:
            parser.error(f"--only matches none of {list(workloads(args.quick)[0])}")
    t_start = time.perf_counter()
    rows = [measure(name, spec, args.repeats, args.warmup) for name, spec in specs.items()]
    print(table(rows))
    if args.out:
        from bayeslayer.experiments.common.provenance import write_record

        record = {"benchmark": "compile", "sizes": sizes, "threads": args.threads, "repeats": args.repeats,
                  "warmup": args.warmup, "quick": args.quick, "rows": rows}
        write_record(args.out, record, device="cpu", wall_seconds=time.perf_counter() - t_start)
        print(f"# record: {args.out}")


if __name__ == "__main__":
    main()
