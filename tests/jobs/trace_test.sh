#!/usr/bin/env bash
# trace_test.sh MERGE PROGRAM MPIRUN...: runs PROGRAM at 2 ranks under WEAVE_TRACE, then checks
# and merges the two per-rank traces with MERGE (weave_trace_merge --require-collectives).
set -eu
merge=$1 program=$2
shift 2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
WEAVE_TRACE="$dir/trace.json" "$@" -np 2 "$program"
"$merge" --require-collectives "$dir/trace.rank0.json" "$dir/trace.rank1.json" > "$dir/merged.json"
test -s "$dir/merged.json"
echo "merged: $(wc -c < "$dir/merged.json") bytes"
