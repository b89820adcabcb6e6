#!/usr/bin/env bash
# float32 GEMM: Eigen, OpenBLAS and BLIS on the MLP step's shapes and on squares, 1 and 2
# threads (bench_gemm_*; the OpenBLAS and BLIS binaries exist where libopenblas-pthread-dev and
# libblis-dev are installed). Prints each library's lines, then a summary per case.
#   bash bench/kernels/compare_gemm.sh [repetitions=21]
set -euo pipefail
cd "$(dirname "$0")/../.."
# These two hold OpenBLAS to older kernels than the CPU has (set by some images, not by users'
# machines): unset for every library alike.
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
reps=${1:-21}
out=$(for lib in eigen openblas blis; do
  [ -x "build/bench/bench_gemm_$lib" ] && "build/bench/bench_gemm_$lib" "$reps"
done)
echo "$out"
echo "summary (us; lower is faster):"
for case in "mlp_step batch=64" "mlp_step batch=1024" "shape=square256 " "shape=square512 " \
            "shape=square1024 " "shape=square2048 "; do
  for threads in 1 2; do
    line="  $case threads=$threads:"
    for lib in eigen openblas blis; do
      us=$(echo "$out" | grep "lib=$lib threads=$threads $case" | grep -o 'us=[0-9.]*' | cut -d= -f2)
      [ -n "$us" ] && line="$line $lib=$us"
    done
    echo "$line"
  done
done
