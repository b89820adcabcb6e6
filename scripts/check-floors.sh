#!/usr/bin/env bash
# Checks weave's layering: a source under weave/<floor>/ may include only headers of its own
# floor or of floors below it. The floors, lowest first (the one place they are listed):
floors=(tensor kernels autograd ops "nn optim data" distributed parallel)
# The communication backends (distributed/mpi, distributed/nccl) stand on tensor/ alone, plus
# the backend interface they implement.
backend_allowed='^weave/(tensor/|distributed/(communicator|types)\.h)'
set -euo pipefail
cd "$(dirname "$0")/.."

declare -A level
for i in "${!floors[@]}"; do
  for name in ${floors[$i]}; do level[$name]=$i; done
done

bad=0
while IFS= read -r file; do
  floor=${file#weave/}
  floor=${floor%%/*}
  [[ -n ${level[$floor]+x} ]] || { echo "$file: folder '$floor' is not a floor in scripts/check-floors.sh"; bad=1; continue; }
  while IFS=: read -r line target; do
    target_floor=${target#weave/}
    target_floor=${target_floor%%/*}
    if [[ -z ${level[$target_floor]+x} ]]; then
      echo "$file:$line includes $target, which is in no floor"; bad=1
    elif ((level[$target_floor] > level[$floor])); then
      echo "$file:$line includes $target: $target_floor/ is above $floor/"; bad=1
    elif [[ $file =~ ^weave/distributed/(mpi|nccl)/ && ! $target =~ $backend_allowed ]]; then
      echo "$file:$line includes $target: backends may include only tensor/ and the backend interface"; bad=1
    fi
  done < <(grep -noE '^#include "weave/[^"]+"' "$file" | sed -E 's/#include "([^"]+)"/\1/')
done < <(git ls-files 'weave/*/*' | grep -E '\.(h|cpp|cu|cuh)$')

if ((bad)); then
  echo "floor check: FAILED (floors, lowest first: ${floors[*]})"
  exit 1
fi
echo "floor check: every include points down (${floors[*]})"
