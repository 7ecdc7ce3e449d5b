#!/bin/bash
# The optimizer step of several versions of the package, alternating, in one call on one machine.
#
#   bash benchmarks/versions_ab.sh ROUNDS NAME=DIR [NAME=DIR ...] [-- step_time.py options]
#
# DIR is a folder holding the deepmd_hybridmuon/ of another commit (`git archive <commit> deepmd_hybridmuon |
# tar -x -C DIR`): step_time.py runs from there with it first on PYTHONPATH. DIR "." is this checkout (the
# installed package). Each version has a Triton cache of its own, cold at its first round. For each round and
# version: $OUT/step_<NAME>_r<ROUND>.json and .log (OUT defaults to the current folder), and the tables printed.
set -u
rounds=$1; shift
versions=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do versions+=("$1"); shift; done
[ $# -gt 0 ] && shift
options=(--variants ours,adamw --steps 100 --warmup 10 "$@")
repo=$PWD
out=${OUT:-$PWD}
declare -A cache
for v in "${versions[@]}"; do cache[${v%%=*}]=$(mktemp -d); done
for r in $(seq 1 "$rounds"); do
  for v in "${versions[@]}"; do
    name=${v%%=*} dir=${v#*=}
    json=$out/step_${name}_r$r.json log=$out/step_${name}_r$r.log
    if [ "$dir" = . ]; then
      TRITON_CACHE_DIR=${cache[$name]} python benchmarks/step_time.py "${options[@]}" --json "$json" > "$log" 2>&1
    else
      (cd "$dir" && TRITON_CACHE_DIR=${cache[$name]} PYTHONPATH=$PWD \
        python "$repo/benchmarks/step_time.py" "${options[@]}" --json "$json" > "$log" 2>&1)
    fi
    grep -E "^(##|\| ours|\| adamw)" "$log"
    echo "== $name round $r done $(date -u +%T)"
  done
done
