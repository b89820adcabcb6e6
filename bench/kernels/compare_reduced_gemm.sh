#!/usr/bin/env bash
# bfloat16 vs float32 GEMM: weave (bench_reduced_gemm) against PyTorch's torch.matmul
# (bench/kernels/torch_gemm.py), on one pinned core, runs alternating weave / PyTorch; reports the
# median GFLOP/s of each over the runs and the ratios the README quotes.
#   bash bench/kernels/compare_reduced_gemm.sh [runs=3] [core=1]
set -euo pipefail
cd "$(dirname "$0")/../.."
# These two hold OpenBLAS to older kernels than the CPU has (set by some images, not by users'
# machines): unset for both sides alike.
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
export OMP_NUM_THREADS=1
runs=${1:-3}
core=${2:-1}
log=$(mktemp)
for ((r = 0; r < runs; ++r)); do
  taskset -c "$core" build/bench/bench_reduced_gemm 3 | sed 's/^/weave /' >>"$log"
  taskset -c "$core" /usr/bin/python3 bench/kernels/torch_gemm.py 3 | sed 's/^/torch /' >>"$log"
done
median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
gflops() {  # side name dtype
  grep "^$1 name=$2 " "$log" | grep " dtype=$3 " | grep -o 'gflops=[0-9.]*' | cut -d= -f2 | median
}
printf '%-13s %9s %9s %9s %9s %9s %9s | %8s %9s\n' shape w_f32 w_bf16 w_f16 w_widen t_f32 t_bf16 \
  w_bf16/f32 w/t_bf16
for shape in $(grep '^weave ' "$log" | grep -o 'name=[a-z0-9_]*' | cut -d= -f2 | awk '!seen[$0]++'); do
  wf=$(gflops weave "$shape" float32) wb=$(gflops weave "$shape" bfloat16)
  wh=$(gflops weave "$shape" float16) ww=$(gflops weave "$shape" bfloat16_widened)
  tf=$(gflops torch "$shape" float32) tb=$(gflops torch "$shape" bfloat16)
  printf '%-13s %9s %9s %9s %9s %9s %9s | %8.2f %9.2f\n' "$shape" "$wf" "$wb" "$wh" "$ww" "$tf" \
    "$tb" "$(echo "$wb / $wf" | bc -l)" "$(echo "$wb / $tb" | bc -l)"
done
rm -f "$log"
