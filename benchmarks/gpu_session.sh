#!/usr/bin/env bash
# The device check in one command, for a GPU machine with a bare image (see docs/kernels.md, "Device check"):
#
#   bash benchmarks/build_wheels.sh          # here, once: .whl/ (flash-linear-attention, fla-core), ignored by git
#   bash benchmarks/gpu_session.sh           # there, with `.whl` carried: the line below, 8 minutes
#
# First it installs .whl/ offline (pip --no-index --no-deps --find-links .whl, into $SITE) unless fla is already
# importable, and stops with one line if `import fla.ops.gated_delta_rule` still fails.  Then the phases, in order,
# each in its own process (a CUDA fault in one cannot poison the next) with its own time limit:
#   check     benchmarks/gpu.py --scan --phase check: the forward value checks (small, the scan's and the chain's
#             in float64, then the default path's once per head dim at the rows' own compile shapes with the bf16
#             hand-off to fla's mean pass; fla's forward autotuning and the forward compiles happen here)
#             -> scan_check.json
#   fwd       --phase fwd: the forward BL-vs-GDN rows (the default path first, then the other covariance pass),
#             cheapest first, none started after SCAN_FWD_S - 15 s -> scan_fwd.json
#   fwdbwd    --phase fwdbwd: the backward's value checks (fla's GDN backward against its naive reference, BL's
#             backward against the PyTorch path), then the forward+backward rows, none started after FWDBWD_S - 20 s
#             -> scan_fwdbwd.json.  fla's Hopper guard (fla #640: Triton < 3.7.1 refuses its gated backward on
#             Hopper) is recorded and bypassed (--gdn-bypass-hopper-guard); the check measures the bypassed kernels'
#             values before any row times them.  SCAN_ARGS adds arguments to all three.
#   gputests  the covariance chain's, the segment scan's and the backward's tests, compiled on the GPU, fla's fp32 tl.dot pinned to IEEE
#             (TRITON_F32_DEFAULT=ieee, in a Triton cache of its own: the default is not part of Triton's cache
#             key) and, where it is active, fla's Hopper guard bypassed (BL_TEST_BYPASS_FLA_HOPPER_GUARD=1; the
#             tests then check those kernels' values)
#   census    benchmarks/gpu.py --compile-only --default-path: every kernel the default path launches, compiled on
#             the device's Triton: tensor-core instructions, spills, shared memory (CENSUS_ARGS; sm_90 compiles need
#             no GPU, so the dry run compiles too)
# Older phases, by name in PHASES: scan (check, fwd and fwdbwd in one process), tests, bench, variants, profile,
# scantest, bwdtest (their commands below).
# PHASES picks and orders them (default "check fwd fwdbwd gputests census"); each has a time limit in seconds
# (CHECK_S, SCAN_FWD_S, FWDBWD_S, GPUTEST_S, CENSUS_S; SCAN_S, TEST_S, BWDTEST_S, BENCH_S, VAR_S, PROF_S) and the
# plan is printed first.
# Results: $OUT or /tmp/bl_gpu: line.log (everything printed), line.json (each phase's
# exit code and seconds, rewritten after each phase), scan_*.json and census.json (rewritten after each row).
# fla's autotuning (71 s to over 100 s per head dim on a fresh H200) is pinned: every fla autotuner at its first
# config, GDN's and BL's mean pass alike (FLA_AUTOTUNE=pin, the default).  FLA_AUTOTUNE=warm lets fla autotune once
# per head dim instead, kept by TRITON_CACHE_AUTOTUNING=1 (Triton's on-disk autotune cache, with the compiled
# kernels, in benchmarks/results/triton_cache; packed into $OUT/triton_cache.tgz when under 40 MB and unpacked from
# ./triton_cache.tgz when carried, so that a later machine autotunes nothing).
# PLAN_ONLY=1: print the plan and stop.  DRY_RUN=1: the same line on a CPU (TRITON_INTERPRET=1, gpu.py --dry-run, tests collected and one run);
# benchmarks/simulate_bare_machine.sh runs it in a venv that holds only the image's packages.
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bl_gpu}
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
DRY_RUN=${DRY_RUN:-0}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/line.log") 2>&1
PHASES=${PHASES:-check fwd fwdbwd gputests census}
CHECK_S=${CHECK_S:-60}
SCAN_FWD_S=${SCAN_FWD_S:-120}
FWDBWD_S=${FWDBWD_S:-150}
SCAN_S=${SCAN_S:-290}
GPUTEST_S=${GPUTEST_S:-90}
CENSUS_S=${CENSUS_S:-35}
LINE_S=${LINE_S:-480}
SETUP_S=20  # install and imports (measured below)
t0=$(date +%s)
limit_of() {
  case $1 in
    check) echo "$CHECK_S" ;; fwd) echo "$SCAN_FWD_S" ;; fwdbwd) echo "$FWDBWD_S" ;;
    scan) echo "$SCAN_S" ;; gputests) echo "$GPUTEST_S" ;; census) echo "$CENSUS_S" ;; tests) echo "${TEST_S:-150}" ;;
    bench) echo "${BENCH_S:-240}" ;; variants) echo "${VAR_S:-150}" ;; profile) echo "${PROF_S:-60}" ;;
    scantest) echo "${TEST_S:-60}" ;; bwdtest) echo "${BWDTEST_S:-90}" ;; *) echo 0 ;;
  esac
}
echo "== phase plan (limits in s; budget $LINE_S s$([ "$DRY_RUN" = 1 ] && echo ', dry run on CPU'))"
printf '%-10s %7s %9s\n' phase limit "ends by"
at=$SETUP_S
printf '%-10s %7s %9s\n' setup "$SETUP_S" "$at"
for phase in $PHASES; do
  lim=$(limit_of "$phase")
  if [ "$lim" = 0 ]; then echo "gpu_session.sh: unknown phase '$phase'" >&2; exit 2; fi
  at=$((at + lim))
  printf '%-10s %7s %9s\n' "$phase" "$lim" "$at"
done
if [ "$at" -gt "$LINE_S" ]; then echo "# the plan takes $at s, over the budget of $LINE_S s"; else
  echo "# the plan fits the budget: $at of $LINE_S s"; fi
if [ "${PLAN_ONLY:-0}" = 1 ]; then exit 0; fi
if [ "$DRY_RUN" = 1 ]; then
  export TRITON_INTERPRET=1
else
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
fi
if ! "$PY" -c "import fla" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --find-links .whl --target "$SITE" \
    .whl/*.whl && export PYTHONPATH="$SITE"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! err=$("$PY" -c "import sys, torch, triton, fla, fla.ops.gated_delta_rule; print('python', sys.version.split()[0],
'torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)" 2>&1); then
  echo "gpu_session.sh: flash-linear-attention is not importable ($(echo "$err" | tail -1)); build .whl/ with" \
       "benchmarks/build_wheels.sh and carry it with the checkout"
  exit 3
fi
echo "$err" | tail -1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/benchmarks/results/triton_cache}
export TRITON_CACHE_AUTOTUNING=1
mkdir -p "$TRITON_CACHE_DIR"
if [ -f triton_cache.tgz ]; then tar xzf triton_cache.tgz -C "$TRITON_CACHE_DIR"; fi
echo "# setup took $(( $(date +%s) - t0 )) s"
dry=$([ "$DRY_RUN" = 1 ] && echo "--dry-run")
xdist=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8")
phases_json=""
failed=""
for phase in $PHASES; do
  echo "== $phase $(date -u +%H:%M:%S) (limit $(limit_of "$phase") s)"
  ts=$(date +%s)
  case $phase in
    check|fwd|fwdbwd)
      lim=$(limit_of "$phase")
      timeout "$lim" "$PY" benchmarks/gpu.py --scan --phase "$phase" $dry --D 64 128 --gdn-bypass-hopper-guard \
        --fla-autotune "${FLA_AUTOTUNE:-pin}" --sweep-D --fwd-budget-s $((lim - 15)) --budget-s $((lim - 20)) \
        --out "$OUT/scan_$phase.json" ${SCAN_ARGS:-} ;;
    scan)
      timeout "$SCAN_S" "$PY" benchmarks/gpu.py --scan $dry --D 64 128 --gdn-bypass-hopper-guard \
        --fla-autotune "${FLA_AUTOTUNE:-pin}" \
        --fwd-budget-s "$SCAN_FWD_S" --budget-s $((SCAN_S - 30)) --out "$OUT/scan.json" ${SCAN_ARGS:-} ;;
    gputests)
      if [ "$DRY_RUN" = 1 ]; then  # the interpreter runs the kernels in NumPy: collect all, run one
        tests="--collect-only -q tests/ops/test_chain.py tests/ops/test_scan_fla.py tests/ops/test_scan_grad.py
               tests/ops/test_scan_triton.py tests/ops/test_scan_backward_triton.py tests/ops/test_scan_ldl.py"
        timeout "$GPUTEST_S" "$PY" -m pytest -p no:cacheprovider $tests | tail -3 \
          && timeout "$GPUTEST_S" "$PY" -m pytest -q -p no:cacheprovider \
            "tests/ops/test_scan_fla.py::test_mean_pass_fla_equals_twin[False]"
      else
        TRITON_INTERPRET=0 TRITON_F32_DEFAULT=ieee TRITON_CACHE_DIR="$TRITON_CACHE_DIR-f32ieee" \
          BL_TEST_BYPASS_FLA_HOPPER_GUARD=1 timeout "$GPUTEST_S" "$PY" -m pytest -q -rf -p no:cacheprovider $xdist \
          tests/ops/test_chain.py tests/ops/test_scan_fla.py tests/ops/test_scan_grad.py tests/ops/test_scan_triton.py \
          tests/ops/test_scan_backward_triton.py tests/ops/test_scan_ldl.py
      fi ;;
    census)
      TRITON_INTERPRET=0 timeout "$CENSUS_S" "$PY" benchmarks/gpu.py --compile-only --default-path \
        --json "$OUT/census.json" ${CENSUS_ARGS:---D 64} ;;
    tests)
      TRITON_INTERPRET=0 timeout "${TEST_S:-150}" "$PY" -m pytest -q -rf --maxfail=25 -p no:cacheprovider \
        -m "slow or not slow" $xdist \
        tests/ops/test_triton.py tests/ops/test_varlen_backend.py 2>&1 | tail -45 | tee "$OUT/tests.log" ;;
    bench)
      timeout "${BENCH_S:-240}" "$PY" benchmarks/gpu.py --out "$OUT/gpu.json" ${BENCH_ARGS:-} 2>&1 \
        | tee "$OUT/bench.log" ;;
    variants)
      timeout "${VAR_S:-150}" "$PY" benchmarks/gpu.py --variants ${VAR_ARGS:---T 8192 --D 64 128 256} 2>&1 \
        | tee "$OUT/variants.log" ;;
    profile)
      timeout "${PROF_S:-60}" "$PY" benchmarks/gpu.py --profile --T 8192 --D 128 2>&1 | tee "$OUT/profile.log" ;;
    scantest)
      TRITON_INTERPRET=0 timeout "${TEST_S:-60}" "$PY" -m pytest -q -rf -p no:cacheprovider \
        tests/ops/test_scan_ldl.py tests/ops/test_scan_triton.py tests/ops/test_scan_fla.py 2>&1 | tail -25 | tee "$OUT/scantest.log" ;;
    bwdtest)
      TRITON_INTERPRET=0 timeout "${BWDTEST_S:-90}" "$PY" -m pytest -q -rf -p no:cacheprovider \
        $xdist \
        tests/ops/test_scan_backward_triton.py tests/ops/test_scan_grad.py 2>&1 | tail -30 | tee "$OUT/bwdtest.log" ;;
  esac
  rc=$?
  [ "$rc" = 0 ] || failed="$failed $phase"
  echo "== $phase: exit $rc in $(( $(date +%s) - ts )) s$([ $rc = 124 ] && echo ' (its time limit)')"
  phases_json="$phases_json${phases_json:+, }{\"phase\": \"$phase\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - ts ))}"
  echo "{\"dry_run\": $DRY_RUN, \"budget_s\": $LINE_S, \"phases\": [$phases_json]}" > "$OUT/line.json.tmp" \
    && mv "$OUT/line.json.tmp" "$OUT/line.json"
done
size=$(du -sm "$TRITON_CACHE_DIR" 2>/dev/null | cut -f1)
if [ -n "$size" ] && [ "$size" -lt 40 ]; then tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" .; fi
echo "== done $(date -u +%H:%M:%S), $(( $(date +%s) - t0 )) s in all${failed:+; failed:$failed}"
[ -z "$failed" ]
