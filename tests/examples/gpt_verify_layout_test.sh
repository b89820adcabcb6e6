#!/usr/bin/env bash
# examples/gpt --verify-layout: every layout the example trains (data, fsdp, HSDP, ZeRO-1, tensor with
# and without sequence parallelism, context parallelism both ways, experts, pipelines, and their
# combinations), for GPT-2 and Llama (grouped-query attention), passes parallel::verify_layout
# against one process in float64 at 1-4 ranks; and the check's own line says how long it took.
# usage: gpt_verify_layout_test.sh GPT MPIRUN...
set -euo pipefail
gpt=$1
shift
mpirun=("$@")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
checked=0
check() {  # ranks, then the layout's flags
  local n=$1
  shift
  "${mpirun[@]}" -np "$n" "$gpt" --verify-layout --batch 24 "$@" > "$work/out" 2>&1 || true
  grep -q "layout passed" "$work/out" || { cat "$work/out"; echo "FAIL: $n ranks: $*"; exit 1; }
  grep -o "verify-layout: .*" "$work/out" | sed 's/; rank 0:.*: layout/: layout/' | cut -c1-160
  checked=$((checked + 1))
}
llama=(--arch llama --kv-heads 2)
check 1
check 1 "${llama[@]}" --strategy fsdp
check 2 --strategy fsdp
check 2 --strategy tp
check 2 --strategy tp --no-sequence-parallel
check 2 "${llama[@]}" --context-parallel 2 --cp-mode all-to-all
check 2 "${llama[@]}" --pipeline 2
check 3 "${llama[@]}" --strategy fsdp
check 3 --no-shard-vocabulary
check 3 "${llama[@]}" --strategy zero
check 4 --strategy fsdp --replicate 2
check 4 --strategy zero
check 4 --strategy fsdp --tp 2
check 4 --strategy hybrid --pipeline 2
check 4 "${llama[@]}" --context-parallel 2
check 4 "${llama[@]}" --strategy fsdp --pipeline 2
check 4 "${llama[@]}" --experts 4 --expert-parallel 2
check 4 --experts 4 --expert-parallel 4 --context-parallel 2 --strategy fsdp
echo "PASS: $checked layouts equal one process (verify_layout)"
