#!/usr/bin/env bash
# On a machine with a GPU, one command for every GPU path: the GPU-marked tests, then the GPU bench rows
# (the default MLP and ResNet18 in bf16-mixed, step capture on and off, against the plain loop).
# Usage: bash scripts/gpu_verify.sh [OUT]   (default bench_results/gpu-<UTC time>; `make gpu-verify` runs it)
# Knobs: PYTHON, TESTS (pytest paths, default: all), ROUNDS (default 3), EPOCHS (default 3, the first warm-up),
# STEPS (steps per epoch, default 150), JOBS (pytest-xdist workers sharing the GPU, default 1: no xdist),
# TEST_LIMIT / BENCH_LIMIT (seconds the tests / each bench workload may run, default 0: no limit; a bench cut
# off writes no report), PROFILE (0: skip the profiled runs, one per contender after the rounds), COMMIT (the
# commit to record where the copy has no .git).
set -uo pipefail
PYTHON=${PYTHON:-python}
limited() { local seconds=$1; shift; if [ "$seconds" -gt 0 ]; then timeout -k 10 "$seconds" "$@"; else "$@"; fi; }
OUT=${1:-bench_results/gpu-$(date -u +%Y-%m-%dT%H%M%S)}
mkdir -p "$OUT"
status=0
{ date -u +%FT%TZ; echo "commit ${COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"; nvidia-smi -L; "$PYTHON" -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"; } > "$OUT/machine.txt" 2>&1
jobs=(); [ "${JOBS:-1}" -gt 1 ] && jobs=(-n "$JOBS")
profile=(); [ "${PROFILE:-1}" = 0 ] && profile=(--no-profile)
# shellcheck disable=SC2086  # TESTS is a list of paths
limited "${TEST_LIMIT:-0}" "$PYTHON" -m pytest -m gpu -rs -p no:cacheprovider "${jobs[@]}" --junitxml="$OUT/gpu-tests.xml" \
  ${TESTS:-} > "$OUT/gpu-tests.log" 2>&1 || status=1
tail -n 25 "$OUT/gpu-tests.log"
for workload in mlp resnet18; do
  limited "${BENCH_LIMIT:-0}" "$PYTHON" -m scripts.bench --suite throughput --workload "$workload" --accelerator gpu --precision bf16-mixed \
    --rounds "${ROUNDS:-3}" --epochs "${EPOCHS:-3}" --limit-train-batches "${STEPS:-150}" --workers '' --no-paired "${profile[@]}" \
    --quiet-wait 0 --variant eager=model.step_capture=false --out "$OUT/bench-$workload" > "$OUT/bench-$workload.log" 2>&1 \
    || status=1
  tail -n 40 "$OUT/bench-$workload.log"
done
echo "results in $OUT (exit $status)"
exit $status
