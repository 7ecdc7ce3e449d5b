#!/usr/bin/env bash
# `dp --pt train` end to end on the CPU: deepmd-hybridmuon, deepmd-kit's built-in HybridMuon and AdamW, two rounds
# with the variants in opposite orders, on se_e2_a water, DPA-3 water (9–12 s a batch at 2 threads: 24 steps) and
# the bundled example (its data made by examples/make_data.py).
# Usage: bash benchmarks/cpu_train.sh [THREADS] [OUTDIR] [MODELS]
#   (default 2 threads, benchmarks/results, se_e2_a_water,dpa3_water,example)
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
out=${2:-benchmarks/results}
models=${3:-se_e2_a_water,dpa3_water,example}
day=$(date -u +%F)
[ -d examples/data ] || (cd examples && python make_data.py)
export OMP_NUM_THREADS=$threads DP_INTRA_OP_PARALLELISM_THREADS=$threads DP_INTER_OP_PARALLELISM_THREADS=1
declare -A input=([se_e2_a_water]=se_e2_a_water [dpa3_water]=dpa3_water [example]=examples/input.json)
declare -A length=([se_e2_a_water]="--steps 150 --disp-freq 50" [dpa3_water]="--steps 24 --disp-freq 8"
  [example]="--steps 300 --disp-freq 100")
for round in 1 2; do
  variants=$([ "$round" = 1 ] && echo ours,builtin,adamw || echo adamw,builtin,ours)
  for model in ${models//,/ }; do
    # shellcheck disable=SC2086
    python benchmarks/train_speed.py "${input[$model]}" ${length[$model]} --variants "$variants" \
      --json "$out/cpu_train_${model}_t${threads}_r${round}_$day.json"
  done
done
