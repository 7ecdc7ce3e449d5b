#!/usr/bin/env bash
# `dp --pt train` end to end on the CPU: deepmd-hybridmuon, deepmd-kit's built-in HybridMuon and AdamW, on se_e2_a
# water and the bundled example (its data made by examples/make_data.py), two rounds with the variants in opposite
# orders. Usage: bash benchmarks/cpu_train.sh [THREADS] [OUTDIR]   (default 2 threads, benchmarks/results)
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
out=${2:-benchmarks/results}
day=$(date -u +%F)
[ -d examples/data ] || (cd examples && python make_data.py)
export OMP_NUM_THREADS=$threads DP_INTRA_OP_PARALLELISM_THREADS=$threads DP_INTER_OP_PARALLELISM_THREADS=1
for round in 1 2; do
  variants=$([ "$round" = 1 ] && echo ours,builtin,adamw || echo adamw,builtin,ours)
  python benchmarks/train_speed.py se_e2_a_water --steps 150 --disp-freq 50 --variants "$variants" \
    --json "$out/cpu_train_se_e2_a_water_t${threads}_r${round}_$day.json"
  python benchmarks/train_speed.py examples/input.json --steps 300 --disp-freq 100 --variants "$variants" \
    --json "$out/cpu_train_example_t${threads}_r${round}_$day.json"
done
