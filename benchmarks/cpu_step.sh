#!/usr/bin/env bash
# The optimizer step alone on the CPU: deepmd-hybridmuon, deepmd-kit's built-in HybridMuon and AdamW, at 1 and 2
# threads, on se_e2_a and DPA-3 water and the bundled example, two rounds with the variants in opposite orders.
# Usage: bash benchmarks/cpu_step.sh [OUTDIR]   (default benchmarks/results; one JSON file per run)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
day=$(date -u +%F)
for threads in 1 2; do
  for round in 1 2; do
    variants=$([ "$round" = 1 ] && echo ours,builtin,adamw || echo adamw,builtin,ours)
    common=(--device cpu --variants "$variants" --steps 20 --warmup 3 --compile-cache)
    OMP_NUM_THREADS=$threads python benchmarks/step_time.py --configs se_e2_a_water,dpa3_water "${common[@]}" \
      --json "$out/cpu_step_water_t${threads}_r${round}_$day.json"
    OMP_NUM_THREADS=$threads python benchmarks/step_time.py --config-dir examples --configs input "${common[@]}" \
      --json "$out/cpu_step_example_t${threads}_r${round}_$day.json"
  done
done
