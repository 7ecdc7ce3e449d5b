#!/usr/bin/env bash
# The scaling runs of BENCHMARKS.md ("How training scales from 1 to 4 GPUs") on one host with 4 GPUs, as they were
# made: 1 GPU (GPU 0) and 2 GPUs (GPUs 1 and 2) side by side, then 4 GPUs alone; each set alternates ours, AdamW and
# the built-in (benchmarks/multi_gpu.py). One JSON per number of GPUs lands in OUTDIR; list them in
# benchmarks_doc.SCALING and run benchmarks/scaling_plot.py.
#
#   benchmarks/scaling.sh dpa3_water 0,1 out               # stages 0 and 1 (about 10 minutes on 4 x H200)
#   benchmarks/scaling.sh dpa4_water 2,3 out --no-ema      # FSDP2 stages (deepmd refuses EMA there)
set -euo pipefail
config=$1 stages=$2 out=$3
shift 3
mkdir -p "$out"
work=$(mktemp -d)
run() {  # GPUs, their CUDA_VISIBLE_DEVICES, stages, then multi_gpu.py's other options
    local gpus=$1 devices=$2 at=$3
    shift 3
    CUDA_VISIBLE_DEVICES=$devices python benchmarks/multi_gpu.py "$config" --gpus "$gpus" --steps 80 --stages "$at" \
        --variants ours,adamw,builtin --workdir "$work/g$gpus" --json "$out/scaling_${config}_g$gpus.json" "$@" \
        >"$out/scaling_${config}_g$gpus.log" 2>&1
}
run 1 0 0,0 "$@" &
run 2 1,2 "$stages" "$@" &
wait
run 4 0,1,2,3 "$stages" "$@"
tail -n 12 "$out"/scaling_"${config}"_g*.log
