#!/usr/bin/env bash
# dist::exit_with_error at 4 ranks: each distinct error is printed once for the whole job, with
# the ranks that raised it, and the job ends within seconds (well before WEAVE_TIMEOUT_S).
#   error_report_test.sh WEAVE_MPI_TIMEOUT MPIRUN...
set -u
program=$1
shift
fail() { echo "FAIL: $*"; exit 1; }
run() {  # mode: runs the job, sets $out, checks a non-zero exit within 30 s
  local start=$(date +%s)
  out=$(WEAVE_TIMEOUT_S=120 timeout 100 "$@" -np 4 "$program" "$mode" 2>&1)
  local code=$? elapsed=$(($(date +%s) - start))
  printf '%s\n' "$out" | grep '^\[weave\]'
  [ $code -ne 0 ] || fail "$mode: exit code 0"
  [ $elapsed -le 30 ] || fail "$mode: took ${elapsed} s"
}
once() {  # pattern: exactly one line of $out matches it
  local n
  n=$(printf '%s\n' "$out" | grep -cE -- "$1")
  [ "$n" -eq 1 ] || fail "$mode: $n lines match '$1', expected 1"
}
common='expected a batch of 8 rows, found 7; hint: drop_last'
mode=same-error run "$@"
once "$common"
once "^\[weave\] ranks 0-3 \(every rank\): \[train\] $common\$"
mode=distinct-error run "$@"
once "$common"
once "^\[weave\] ranks 0, 1, 3 \(3 of 4\): \[train\] $common\$"
once "^\[weave\] rank 2: \[train\] rank 2 has no shard of the data\$"
mode=one-rank-error run "$@"
once "$common"
once "^\[weave\] rank 1: \[train\] $common\$"
once "^\[weave\] ranks 0, 2, 3 raised no error"
echo "PASS: every error printed once, ranks named"
