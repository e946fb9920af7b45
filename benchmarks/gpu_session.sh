#!/usr/bin/env bash
# The whole device check in one command, for a lent GPU machine (see docs/kernels.md):
#   tests     the Triton kernel tests on the GPU (full grid, compiled kernels, not the interpreter)
#   bench     the benchmark table (benchmarks/gpu.py; BENCH_ARGS adds arguments)
#   variants  forward time and error per chunk size and fp32 product precision (VAR_ARGS)
#   profile   a torch.profiler kernel table of one point
#   scantest  the segment-scan tests compiled on the GPU (tests/ops/test_scan_ldl.py, test_scan_triton.py,
#             test_scan_fla.py)
#   bwdtest   the backward="scan" tests compiled on the GPU (tests/ops/test_scan_backward_triton.py,
#             test_scan_grad.py; 51 tests, 8 xdist workers when pytest-xdist is there), limit BWDTEST_S
#   scan      the v2 device check: benchmarks/gpu.py --scan with forward+backward rows and fla's Hopper guard
#             bypassed (the check measures the bypassed kernels' values first; see gpu.py's docstring); its
#             --budget-s, SCAN_S - 60, stops starting rows and measurements a minute before the phase's limit;
#             SCAN_ARGS adds arguments (--no-bwd: forwards only; --budget-s overrides).  Sized for 8 minutes of
#             device time:
#             PHASES="scantest bwdtest scan" TEST_S=60 BWDTEST_S=90 SCAN_S=330
# PHASES picks and orders them (default "tests bench profile"); each has a time limit in seconds
# (TEST_S, BWDTEST_S, BENCH_S, VAR_S, PROF_S, SCAN_S).  Results go to $OUT (default /tmp/bl_gpu).
# Triton's cache (compiled kernels and fla's autotuning results, FLA_CACHE_RESULTS=1) lives in
# benchmarks/results/triton_cache: carry that folder to the next lent machine and fla does not
# autotune again; it is also packed into $OUT/triton_cache.tgz when under 40 MB.
# Wheels of packages the machine lacks (flash-linear-attention, the comparison) are installed
# from .whl/ when present.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bl_gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if ! python3 -c "import fla" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/benchmarks/results/triton_cache}
export FLA_CACHE_RESULTS=1
mkdir -p "$TRITON_CACHE_DIR"
if [ -f triton_cache.tgz ]; then tar xzf triton_cache.tgz -C "$TRITON_CACHE_DIR"; fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for phase in ${PHASES:-tests bench profile}; do
  echo "== $phase $(date -u +%H:%M:%S)"
  case $phase in
    tests)
      TRITON_INTERPRET=0 timeout "${TEST_S:-150}" python3 -m pytest -q -rf --maxfail=25 -p no:cacheprovider \
        -m "slow or not slow" $(python3 -c "import xdist" 2>/dev/null && echo "-n 8") \
        tests/ops/test_triton.py tests/ops/test_varlen_backend.py 2>&1 | tail -45 | tee "$OUT/tests.log" ;;
    bench)
      timeout "${BENCH_S:-240}" python3 benchmarks/gpu.py --out "$OUT/gpu.json" ${BENCH_ARGS:-} 2>&1 \
        | tee "$OUT/bench.log" ;;
    variants)
      timeout "${VAR_S:-150}" python3 benchmarks/gpu.py --variants ${VAR_ARGS:---T 8192 --D 64 128 256} 2>&1 \
        | tee "$OUT/variants.log" ;;
    profile)
      timeout "${PROF_S:-60}" python3 benchmarks/gpu.py --profile --T 8192 --D 128 2>&1 | tee "$OUT/profile.log" ;;
    scantest)
      TRITON_INTERPRET=0 timeout "${TEST_S:-60}" python3 -m pytest -q -rf -p no:cacheprovider \
        tests/ops/test_scan_ldl.py tests/ops/test_scan_triton.py tests/ops/test_scan_fla.py 2>&1 | tail -25 | tee "$OUT/scantest.log" ;;
    bwdtest)
      TRITON_INTERPRET=0 timeout "${BWDTEST_S:-90}" python3 -m pytest -q -rf -p no:cacheprovider \
        $(python3 -c "import xdist" 2>/dev/null && echo "-n 8") \
        tests/ops/test_scan_backward_triton.py tests/ops/test_scan_grad.py 2>&1 | tail -30 | tee "$OUT/bwdtest.log" ;;
    scan)
      scan_s=${SCAN_S:-450}
      timeout "$scan_s" python3 benchmarks/gpu.py --scan --gdn-bypass-hopper-guard --budget-s $((scan_s - 60)) \
        --out "$OUT/scan.json" ${SCAN_ARGS:-} 2>&1 | tee "$OUT/scan.log" ;;
  esac
done
size=$(du -sm "$TRITON_CACHE_DIR" 2>/dev/null | cut -f1)
if [ -n "$size" ] && [ "$size" -lt 40 ]; then tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" .; fi
echo "== done $(date -u +%H:%M:%S)"
