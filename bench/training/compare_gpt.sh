#!/usr/bin/env bash
# weave's GPT (examples/gpt) against the same GPT in PyTorch 1.13 (bench/training/gpt_torch.py): 6 layers,
# dim 384, 6 heads, context 256, batch 4, the fortunes characters, AdamW, clipping, one thread,
# both pinned to the same core. Runs alternate; each reports its median step time (the steps
# after the first two) and its peak resident memory (/usr/bin/time). Also prints the limit: the
# step's GEMMs alone through OpenBLAS, the fastest GEMM library here (bench/kernels/compare_gemm.sh).
#   bash bench/training/compare_gpt.sh [runs=3] [steps=12] [core=1] [autocast=bf16]
# With `bf16` both run forward under autocast (weave's AutocastGuard, torch.autocast("cpu")),
# and the limit is the same GEMMs in bfloat16 through oneDNN (bench_reduced_gemm --gpt; weave's
# bfloat16 matmul, which runs at PyTorch's rate on these shapes: compare_reduced_gemm.sh).
# Needs python3-torch and libopenblas0-pthread (Debian); weave itself never needs them.
set -euo pipefail
cd "$(dirname "$0")/../.."
# These two hold OpenBLAS to older kernels than the CPU has (set by some images, not by users'
# machines): unset for weave and PyTorch alike, so both run the kernels a user would get.
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
runs=${1:-3}
steps=${2:-12}
core=${3:-1}
autocast=()
limit_exe=build/bench/bench_gemm_openblas
if [ -n "${4:-}" ]; then
  autocast=(--autocast "$4")
  [ "$4" = bf16 ] && limit_exe=build/bench/bench_reduced_gemm
fi
gpt=build/examples/gpt
for exe in "$gpt" "$limit_exe"; do
  [ -x "$exe" ] || { echo "build $exe first (bash scripts/test.sh)" >&2; exit 1; }
done
model=(--layers 6 --dim 384 --heads 6 --context 256 --batch 4 --steps "$steps" --log-every 1
       --eval-every 1000000 "${autocast[@]}")
tokens=$((4 * 256))

median() { printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
measure() {  # a command -> "median_step_ms peak_rss_mb"
  local out
  out=$(taskset -c "$core" /usr/bin/time -f "maxrss_kb=%M" "$@" 2>&1)
  local ms
  ms=$(echo "$out" | awk -v tok="$tokens" '/^step [0-9]+\/[0-9]+ loss/ {
         split($2, s, "/"); if (s[1] > 2) print 1000 * tok / $NF }' | sort -g |
       awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}')
  local kb
  kb=$(echo "$out" | grep -o 'maxrss_kb=[0-9]*' | cut -d= -f2)
  echo "$ms $((kb / 1024))"
}

declare -a weave_ms torch_ms weave_mb torch_mb limit_ms
for ((i = 1; i <= runs; ++i)); do
  read -r ms mb < <(measure "$gpt" "${model[@]}" --samples 0 --threads 1)
  echo "run $i weave step_ms=$ms peak_rss_mb=$mb"; weave_ms+=("$ms"); weave_mb+=("$mb")
  read -r ms mb < <(measure /usr/bin/python3 bench/training/gpt_torch.py "${model[@]}" --threads 1)
  echo "run $i torch step_ms=$ms peak_rss_mb=$mb"; torch_ms+=("$ms"); torch_mb+=("$mb")
  us=$(taskset -c "$core" "$limit_exe" --gpt 6 384 6 256 4 120 | grep -o ' us=[0-9]*' | cut -d= -f2)
  ms=$(echo "scale=1; $us / 1000" | bc)
  echo "run $i gemm_limit step_ms=$ms"; limit_ms+=("$ms")
done
w=$(median "${weave_ms[@]}"); t=$(median "${torch_ms[@]}"); l=$(median "${limit_ms[@]}")
wm=$(median "${weave_mb[@]}"); tm=$(median "${torch_mb[@]}")
echo "median step_ms: weave=$w torch=$t gemm_limit=$l; peak_rss_mb: weave=$wm torch=$tm"
echo "ratio weave/torch=$(echo "scale=3; $w / $t" | bc) weave/gemm_limit=$(echo "scale=3; $w / $l" | bc)" \
     "torch/gemm_limit=$(echo "scale=3; $t / $l" | bc) gemm_limit/torch=$(echo "scale=3; $l / $t" | bc)" \
     "rss weave/torch=$(echo "scale=3; $wm / $tm" | bc)"
