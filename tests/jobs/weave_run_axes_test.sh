#!/usr/bin/env bash
# weave-run --hang-timeout against healthy jobs that print nothing: examples/gpt under every
# strategy and axis with its output silenced, and a job whose every checkpoint save takes longer
# than the timeout (fsync slowed by an LD_PRELOAD shim). Each must run to its end: weave's ranks
# beat whenever a call completes, and from the watchdog thread while a save or load runs. (That a
# job hung in a collective is still ended is weave_run_test.sh's first case.)
# usage: weave_run_axes_test.sh WEAVE_RUN GPT ELASTIC_TRAIN SLOW_FSYNC_LIB HANG_TIMEOUT MPIRUN...
set -euo pipefail
weave_run=$1 gpt=$2 train=$3 slow_fsync=$4 hang=$5
shift 5
mpirun=("$@")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
supervised() {  # name, ranks, then the program and its arguments; stdout silenced
  local name=$1 ranks=$2 start=$SECONDS status=0
  shift 2
  "$weave_run" --mpirun "${mpirun[0]}" --np "$ranks" --hang-timeout "$hang" "${mpirun[@]:1}" \
    -- "$@" > /dev/null 2> "$work/log" || status=$?
  if [ "$status" -ne 0 ] || grep -q "looks hung" "$work/log"; then
    cat "$work/log"
    fail "$name: status $status under --hang-timeout $hang"
  fi
  echo "$name: ran $((SECONDS - start)) s silently under --hang-timeout $hang"
}
if [ -d /usr/share/games/fortunes ]; then
  # Each runs silently for about twice a 5 s hang timeout on a 2-core machine.
  gpt_args=(--layers 2 --dim 64 --heads 4 --context 32 --batch 8 --warmup 5 --samples 0
            --eval-every 100000 --log-every 100000 --eval-windows 16)
  supervised "gpt ddp" 2 "$gpt" "${gpt_args[@]}" --steps 2000 --strategy ddp
  supervised "gpt fsdp" 2 "$gpt" "${gpt_args[@]}" --steps 1300 --strategy fsdp
  supervised "gpt tp" 2 "$gpt" "${gpt_args[@]}" --steps 1100 --strategy tp
  supervised "gpt context-parallel" 2 "$gpt" "${gpt_args[@]}" --steps 1000 --context-parallel 2
  supervised "gpt experts" 2 "$gpt" "${gpt_args[@]}" --steps 1000 --experts 4 --expert-parallel 2
else
  echo "no /usr/share/games/fortunes: the gpt runs are skipped"
fi
# Every save of this job sleeps in fsync (each rank's file, its directory, the index): a save
# lasts longer than the hang timeout.
slow_ms=$(awk -v h="$hang" 'BEGIN { printf "%d", h * 1000 / 2 }')
supervised "a job whose saves take $((slow_ms * 3 / 1000))+ s" 2 env LD_PRELOAD="$slow_fsync" \
  SLOW_FSYNC_MS="$slow_ms" "$train" --steps 2 --checkpoint "$work/ckpt"
echo "PASS: silent healthy jobs live on"
