#!/usr/bin/env bash
# Paper-scale MQAR Update and Block (docs/theory.md §8.4: vocabulary 8,192 with random fillers, pools 160k/120k,
# width 128, state 8,192 floats per layer, batch 256) on one GPU, for the paper's claims
#   Update at 16 updates: BL ≈ 88%, conv GDN ≈ 60%, conv-free GDN ≈ 98%
#   Block at 16 pairs:    conv-free GDN ≈ 100%, BL ≈ 75%
# Three mixers (conv-free GDN, BL, conv GDN), ONE learning rate of the paper's grid, ONE seed, and a
# training-step cap instead of the paper's 40 epochs, so that the six runs fit in about 8 minutes of
# one H200.  Each run is its own command (mixers of the same settings merge into one JSON), has its
# own time limit, and prints its train seconds: a run that is cut off leaves the others' results.
#
# Layout: hybrid (Zoology's standard MQAR model: a short-conv block, then the mixer block; gate off),
# because it is the layout in which conv-free GDN learns MQAR at all in an independent check (0.73 at
# 1,000 steps and rising, vs 0.13-0.17 in the stacked layout with the gate on) — and the paper's
# pattern needs conv-free GDN near 100%.  LAYOUT=stacked runs the other one.
#
#   bash benchmarks/mqar_gpu.sh             # on the GPU machine, from the repository root
#   bash benchmarks/mqar_gpu.sh --dry-run   # seconds, on CPU: the same commands with the tiny preset
#
# Settings (environment): LAYOUT (hybrid), LR (2.1544347e-3, from np.logspace(-4, -2, 4)), MAX_STEPS
# (600 per run), RUN_S (time limit per run, 75 s), TASKS ("update block"), MIXERS
# ("gated_deltanet_noconv bayesian gated_deltanet"), OUT (results/mqar/gpu/<date>_<layout>).
# Sizing: MAX_STEPS × (seconds per step) + data and test time must stay under RUN_S; the JSON's
# train_seconds per run gives the step time to resize with.  Every run regenerates
# its pool and test sets on the CPU: measured 40 + 38 s (Update) and 30 + 17 s (Block) on
# a 2-core CPU at load ≈ 22, so expect a few seconds to ~15 s of each RUN_S for it.
set -u
export PYTHONUNBUFFERED=1
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; fi
LAYOUT=${LAYOUT:-hybrid}
LR=${LR:-2.1544347e-3}
TASKS=${TASKS:-update block}
MIXERS=${MIXERS:-gated_deltanet_noconv bayesian gated_deltanet}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DRY" = 1 ]; then
  PRESET=tiny; DEVICE=cpu; MAX_STEPS=${MAX_STEPS:-3}; RUN_S=${RUN_S:-170}
  OUT=${OUT:-$(mktemp -d /tmp/mqar_gpu_dry.XXXX)}
else
  PRESET=paper; DEVICE=cuda; MAX_STEPS=${MAX_STEPS:-600}; RUN_S=${RUN_S:-75}
  OUT=${OUT:-results/mqar/gpu/$(date -u +%F)_$LAYOUT}
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || exit 1
fi
mkdir -p "$OUT"
echo "mqar_gpu: preset $PRESET, layout $LAYOUT, lr $LR, ≤ $MAX_STEPS steps/run, $RUN_S s/run, device $DEVICE -> $OUT"
status=0
for task in $TASKS; do
  for mixer in $MIXERS; do
    start=$(date +%s)
    timeout "$RUN_S" "$PY" -m bayeslayer.cli mqar "$task" --preset "$PRESET" --layout "$LAYOUT" \
      --mixers "$mixer" --lr "$LR" --seeds 1 --max-steps "$MAX_STEPS" --device "$DEVICE" \
      --out "$OUT" --no-progress > "$OUT/${task}_${mixer}.log" 2>&1
    rc=$?
    echo "$(date -u +%H:%M:%S) $task $mixer: rc $rc, $(( $(date +%s) - start )) s; $(grep -E 'test accuracy' "$OUT/${task}_${mixer}.log" | tail -1)"
    if [ "$rc" != 0 ]; then status=1; tail -5 "$OUT/${task}_${mixer}.log"; fi
  done
done
ls -l "$OUT"/*.json 2>/dev/null
exit $status
