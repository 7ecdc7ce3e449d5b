#!/usr/bin/env bash
# Run benchmarks/train_quality.py jobs in parallel on one GPU (small models leave it mostly idle).
# Usage: benchmarks/quality_gpu.sh OUTDIR CONFIG STEPS "OPT:LR:SEEDS" ...
#   e.g. benchmarks/quality_gpu.sh runs/q se_e2_a_water 1500 ours:1e-2:1,2 builtin:1e-2:1,2 adam:1e-3:1,2
# OPT is one of train_quality.py's optimizers (ours, builtin, adam; adam keeps a config's own AdamW).
# TQ_TIMEOUT: seconds per dp process (the lcurve so far is kept on timeout); TQ_ARGS: more train_quality.py run options; TQ_TEST=1: dp test the final checkpoints.
set -u
out=$1 config=$2 steps=$3
shift 3
mkdir -p "$out"
for job in "$@"; do
  IFS=: read -r opt lr seeds <<<"$job"
  for seed in ${seeds//,/ }; do
    tag="${opt}_lr${lr}_s${seed}"
    python3 benchmarks/train_quality.py run --configs "$config" --steps "$steps" --optimizers "$opt" \
      --lr "$opt=$lr" --seeds "$seed" --tag "lr$lr" $([ "${TQ_TEST:-0}" = 1 ] || echo --no-test) ${TQ_ARGS:-} --timeout "${TQ_TIMEOUT:-3600}" --workdir "$out/$tag" --json "$out/$tag.json" \
      >"$out/$tag.log" 2>&1 &
  done
done
wait
ls "$out"/*.json
