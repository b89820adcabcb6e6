#!/usr/bin/env bash
# weave's data-parallel training against PyTorch 1.13's DDP (gloo) on the same recipe and the
# same machine: MLP 784-256-128-10, Adam 1e-3, global batch 64, 10 epochs, 2 ranks, one compute
# thread per rank; plus one weave process on the whole batch. Runs alternate; prints each run's
# wall time (process start to exit) and accuracy, then the medians and their ratios.
#   bash bench/training/compare_torch.sh [runs=3] [epochs=10]
# Needs python3-torch and libopenblas0-pthread (Debian); weave itself never needs them.
set -euo pipefail
cd "$(dirname "$0")/../.."
# These two hold OpenBLAS to older kernels than the CPU has (set by some images, not by users'
# machines): unset for weave and PyTorch alike, so both run the kernels a user would get.
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
runs=${1:-3}
epochs=${2:-10}
exe=build/examples/fashion_mnist_ddp
[ -x "$exe" ] || { echo "build $exe first (bash scripts/test.sh)" >&2; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
recipe=(--recipe small --batch-size 64 --lr 0.001 --epochs "$epochs")

timed() {  # prints "seconds accuracy"
  local start end out
  start=$(date +%s.%N)
  out=$("$@" 2>&1 | grep -o 'test_accuracy=[0-9.]*' | tail -1)
  end=$(date +%s.%N)
  echo "$(echo "$end - $start" | bc) ${out#test_accuracy=}"
}

declare -a weave2 torch2 weave1
for ((i = 1; i <= runs; ++i)); do
  read -r t a < <(timed mpirun --oversubscribe --bind-to none -np 2 "$exe" "${recipe[@]}")
  echo "run $i weave_ddp_2_ranks wall_s=$t test_accuracy=$a"; weave2+=("$t")
  read -r t a < <(timed /usr/bin/python3 bench/training/torch_ddp_fashion_mnist.py --ranks 2 --epochs "$epochs")
  echo "run $i torch_ddp_2_ranks wall_s=$t test_accuracy=$a"; torch2+=("$t")
  read -r t a < <(timed "$exe" "${recipe[@]}" --threads 1)
  echo "run $i weave_1_process wall_s=$t test_accuracy=$a"; weave1+=("$t")
done
median() { printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
w2=$(median "${weave2[@]}"); t2=$(median "${torch2[@]}"); w1=$(median "${weave1[@]}")
echo "median wall_s: weave_ddp_2_ranks=$w2 torch_ddp_2_ranks=$t2 weave_1_process=$w1"
echo "ratio weave_ddp/torch_ddp=$(echo "scale=3; $w2 / $t2" | bc) weave_ddp/weave_1_process=$(echo "scale=3; $w2 / $w1" | bc)"
