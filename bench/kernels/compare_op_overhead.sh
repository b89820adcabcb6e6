#!/usr/bin/env bash
# The host cost of small ops, weave against PyTorch on the CPU (Debian's 1.13): each on one core
# (core 0, one thread), OpenBLAS's variables unset for both, alternating ROUNDS times; prints every
# run's lines, then each op's medians and their ratio (weave / PyTorch; below 1: weave's is
# shorter). On a GPU, scripts/gpu-check.sh's overhead section runs the two with --device cuda.
#   bash bench/kernels/compare_op_overhead.sh [BUILD_DIR=build] [ROUNDS=3]
set -euo pipefail
cd "$(dirname "$0")/../.."
build="${1:-build}"
rounds="${2:-3}"
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
export WEAVE_NUM_THREADS=1 OMP_NUM_THREADS=1
out=$(for ((round = 1; round <= rounds; ++round)); do
  taskset -c 0 "$build/bench/bench_op_overhead" | sed 's/^/weave /'
  taskset -c 0 /usr/bin/python3 bench/kernels/torch_op_overhead.py | sed 's/^/torch /'
done)
echo "$out"
median() { sort -g | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
echo "medians (us a call):"
for op in $(grep '^weave' <<<"$out" | grep -o 'op=[a-z_]*' | sort -u | cut -d= -f2); do
  w=$(grep "^weave op=$op " <<<"$out" | grep -o 'us=[0-9.]*' | cut -d= -f2 | median)
  t=$(grep "^torch op=$op " <<<"$out" | grep -o 'us=[0-9.]*' | cut -d= -f2 | median)
  echo "  $op: weave $w, torch $t, ratio $(awk -v a="$w" -v b="$t" 'BEGIN { printf "%.2f", a / b }')"
done
