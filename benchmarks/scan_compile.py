"""The segment scan's covariance kernel as the forward launches it, compiled for sm_90 without a GPU.

For each variant: registers and local-memory stack per thread (``cuobjdump -res-usage``), and an instruction census
of the PTX (``mma.sync`` / ``wgmma`` tensor-core instructions, ``fma.rn.f32``) and of the SASS (``HMMA``, ``HGMMA``
(Hopper's warpgroup MMA), ``DMMA``, ``FFMA``, ``DFMA``; ``cuobjdump -sass``, Triton's bundled copy).  Variants:

* ``phase_a``: Phase A's kernel — state (P, the Y/U and LDLᵀ scratch) float64, its per-token outputs (W, the
  ``L⁻¹`` rows) and the prep it reads in fp32, as ``ops/bayesian_layer/scan_triton.py::phase_a_triton`` launches it for
  fp32 / 16-bit inputs;
* ``phase_c-<prec>``: Phase C's kernel (all fp32, reading the prep), with its ``tl.dot`` products in
  ``input_precision`` ``ieee`` (what ships), ``tf32x3`` (split precision: three TF32 tensor-core products) or
  ``tf32``.

    python benchmarks/scan_compile.py --D 64 --out results/gpu/scan_compile_sm90.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NAMES = ["q", "k", "r2", "ell2", "la", "cu_seqlens", "P", "W", "LINV", "Yscr", "Uscr", "VAR", "LDLscr", "FAIL",
         "PG", "PB", "PBASE", "PQN", "chunk_first"]


def census(ptx: str, sass: str) -> dict:
    count = lambda pat, text: len(re.findall(pat, text))  # noqa: E731
    return dict(ptx_mma=count(r"\bmma\.sync", ptx), ptx_wgmma=count(r"\bwgmma\.mma_async", ptx),
                ptx_fma_f32=count(r"\bfma\.rn\.f32", ptx), sass_HMMA=count(r"\bHMMA\b", sass),
                sass_HGMMA=count(r"\bHGMMA\b", sass),
                sass_DMMA=count(r"\bDMMA\b", sass), sass_FFMA=count(r"\bFFMA\b", sass),
                sass_DFMA=count(r"\bDFMA\b", sass))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--D", type=int, nargs="+", default=[64])
    p.add_argument("--C", type=int, default=64)
    p.add_argument("--variants", nargs="+",
                   default=["phase_a", "phase_a-diag", "phase_c-ieee", "phase_c-tf32x3", "phase_c-tf32",
                            "phase_c-ieee-diag", "phase_c-tf32x3-diag"])
    p.add_argument("--out", help="JSON output")
    args = p.parse_args(argv)

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bayeslayer.ops.bayesian_layer.kernels_triton import bl_chunk_cov_kernel
    from bayeslayer.ops.bayesian_layer.triton_support import tile_sizes

    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    rows = []
    for D in args.D:
        for variant in args.variants:
            diag = variant.endswith("-diag")
            prec = variant.split("-")[1] if variant.startswith("phase_c") else "ieee"
            BD = tile_sizes(D, D)[0]
            consts = dict(H=16, D=D, C=args.C, BD=BD, BK=16, DIAG=diag, HAS_ALPHA=True, RETURN_VAR=False,
                          PREC=prec, PREP=True)
            fp64 = ("P", "Yscr", "Uscr", "LDLscr") if variant.startswith("phase_a") else ()
            sig = {n: ("*i64" if n in ("cu_seqlens", "chunk_first") else "*i32" if n == "FAIL" else
                       "*fp64" if n in fp64 else "*fp32") for n in NAMES}
            sig.update({n: "constexpr" for n in consts})
            rec = dict(kernel="bl_chunk_cov_kernel", variant=variant, D=D, C=args.C, diagonal=diag, precision=prec,
                       num_warps=8)
            t0 = time.time()
            try:
                compiled = triton.compile(ASTSource(fn=bl_chunk_cov_kernel, signature=sig, constexprs=consts),
                                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
                cubin = Path("/tmp") / f"scan_compile_{variant}_{D}.cubin"
                cubin.write_bytes(compiled.asm["cubin"])
                res = subprocess.run([str(bindir / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True,
                                     text=True).stdout
                sass = subprocess.run([str(bindir / "cuobjdump"), "-sass", str(cubin)], capture_output=True,
                                      text=True).stdout
                m = re.search(r"REG:(\d+) STACK:(\d+)", res)
                rec.update(registers=int(m.group(1)), stack_bytes=int(m.group(2)),
                           shared_bytes=compiled.metadata.shared, **census(compiled.asm["ptx"], sass))
            except Exception as err:  # noqa: BLE001 - a kernel that does not compile is a result
                rec["error"] = f"{type(err).__name__}: {str(err)[:500]}"
            rec["compile_s"] = round(time.time() - t0, 1)
            print(json.dumps(rec), flush=True)
            rows.append(rec)
    if args.out:
        from bayeslayer.experiments.common.provenance import write_record

        write_record(args.out, dict(triton=triton.__version__, target="sm_90", rows=rows), device="cpu (compile only)")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
