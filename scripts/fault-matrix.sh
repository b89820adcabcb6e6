#!/usr/bin/env bash
# The fault matrix: rank 1 of a 2-rank job fails in one of five ways while rank 0 waits inside
# a collective, or a training fault (#16 items 1, 2 and 7: a backward that throws, one batch
# fewer, a parameter without gradient on one rank, pipeline stages that disagree; #33: FSDP's
# forward or backward raising, a rank killed in a reduce_scatter, a background save whose write
# fails and whose commit finalize() runs); each run must
# end with a non-zero mpirun exit within WEAVE_TIMEOUT_S + 5 s, except uneven-join (one batch
# fewer inside parallel::join()), which must train to the end and exit 0.
#   scripts/fault-matrix.sh [runs per fault = 100] [WEAVE_TIMEOUT_S = 3] [build dir = build]
# (FAULTS="uneven uneven-join" runs only those.)
# Prints one line per fault (passes, exit codes seen, slowest run) and exits non-zero if any
# run failed. The program is tests/jobs/mpi_timeout.cpp (built as weave_mpi_timeout).
set -u
runs=${1:-100} timeout_s=${2:-3} build=${3:-build}
program=$build/tests/weave_mpi_timeout
[ -x "$program" ] || { echo "no $program; build the tests first" >&2; exit 2; }
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_btl_vader_single_copy_mechanism=none \
  WEAVE_TIMEOUT_S=$timeout_s
limit_ms=$(( (timeout_s + 5) * 1000 ))
failed=0
printf '%-19s %9s %-18s %s\n' fault passed "exit codes" "slowest"
faults=${FAULTS:-exception kill exit skip return-early backward-exception uneven ddp-unused \
  pipeline-options fsdp-forward fsdp-backward fsdp-kill async-save-fails uneven-join}
for fault in $faults; do
  passed=0 slowest=0
  declare -A codes=()
  for ((i = 0; i < runs; i++)); do
    start=$(date +%s%N)
    timeout --kill-after=5 $((timeout_s + 60)) mpirun --oversubscribe --bind-to none -np 2 \
      "$program" "$fault" >/dev/null 2>&1
    code=$?
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    codes[$code]=$(( ${codes[$code]:-0} + 1 ))
    (( ms > slowest )) && slowest=$ms
    if [ "$fault" = uneven-join ]; then
      [ "$code" -eq 0 ] && (( ms <= limit_ms )) && passed=$((passed + 1))
    elif [ "$code" -ne 0 ] && [ "$code" -ne 124 ] &&
       [ "$code" -ne 137 -o "$fault" = kill -o "$fault" = fsdp-kill ] &&
       (( ms <= limit_ms )); then
      passed=$((passed + 1))
    fi
  done
  seen=""
  for c in "${!codes[@]}"; do seen+="$c:${codes[$c]} "; done
  printf '%-19s %5d/%-3d %-18s %.1f s (limit %d s)\n' "$fault" "$passed" "$runs" "$seen" \
    "$(echo "$slowest / 1000" | bc -l)" $((timeout_s + 5))
  [ "$passed" -eq "$runs" ] || failed=1
  unset codes
done
exit $failed
