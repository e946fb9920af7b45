#!/usr/bin/env bash
# The whole device check in one command, for a lent GPU machine (see docs/kernels.md):
#   tests     the Triton kernel tests on the GPU (full grid, compiled kernels, not the interpreter)
#   bench     the benchmark table (benchmarks/gpu.py; BENCH_ARGS adds arguments)
#   variants  forward time and error per chunk size and fp32 product precision (VAR_ARGS)
#   profile   a torch.profiler kernel table of one point
# PHASES picks and orders them (default "tests bench profile"); each has a time limit in seconds
# (TEST_S, BENCH_S, VAR_S, PROF_S).  Results go to $OUT (the device tool's folder) or /tmp/bl_gpu.
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
  esac
done
echo "== done $(date -u +%H:%M:%S)"
