#!/usr/bin/env bash
# weave against PyTorch 1.13 on the standard small recipe (bench_recipe / torch_recipe.py),
# both pinned to the same single core (taskset -c 0; OpenBLAS, which PyTorch's GEMMs use, would
# otherwise start a thread per core whatever torch.set_num_threads says). Runs alternate;
# prints each run's figures, then medians and ratios (weave / torch; below 1: weave faster).
#   bash bench/training/compare_recipe.sh [runs=3] [epochs=10]
# Needs python3-torch and libopenblas0-pthread (Debian); weave itself never needs them.
set -euo pipefail
cd "$(dirname "$0")/../.."
# These two hold OpenBLAS to older kernels than the CPU has (set by some images, not by users'
# machines): unset for weave and PyTorch alike, so both run the kernels a user would get.
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
# One compute thread for both sides alike (each reads the variable its library honours).
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
runs=${1:-3}
epochs=${2:-10}
exe=build/bench/bench_recipe
[ -x "$exe" ] || { echo "build $exe first (bash scripts/test.sh)" >&2; exit 1; }
field() { { grep "$1" || true; } | grep -o "$2=[0-9.]*" | head -1 | cut -d= -f2 || true; }
declare -a w64 t64 w1024 t1024 wwall twall
for ((i = 1; i <= runs; ++i)); do
  w=$(taskset -c 0 "$exe" "$epochs")
  t=$(taskset -c 0 /usr/bin/python3 bench/training/torch_recipe.py --epochs "$epochs")
  w64+=("$(echo "$w" | field 'batch=64 ' step_us)"); t64+=("$(echo "$t" | field 'batch=64 ' step_us)")
  w1024+=("$(echo "$w" | field 'batch=1024' step_us)"); t1024+=("$(echo "$t" | field 'batch=1024' step_us)")
  wwall+=("$(echo "$w" | field epochs= wall_s)"); twall+=("$(echo "$t" | field epochs= wall_s)")
  echo "run $i"; echo "$w" | sed 's/^/  /'; echo "$t" | sed 's/^/  /'
done
median() { printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
ratio() { echo "scale=3; $1 / $2" | bc; }
a=$(median "${w64[@]}"); b=$(median "${t64[@]}")
echo "median step_us batch=64: weave=$a torch=$b ratio=$(ratio "$a" "$b")"
a=$(median "${w1024[@]}"); b=$(median "${t1024[@]}")
echo "median step_us batch=1024: weave=$a torch=$b ratio=$(ratio "$a" "$b")"
if [ "$epochs" -gt 0 ]; then
  a=$(median "${wwall[@]}"); b=$(median "${twall[@]}")
  echo "median wall_s epochs=$epochs: weave=$a torch=$b ratio=$(ratio "$a" "$b")"
fi
