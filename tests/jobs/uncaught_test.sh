#!/usr/bin/env bash
# An uncaught weave::Error in a world of one (no mpirun) ends as a multi-rank job's does: one
# "[weave] rank 0: uncaught exception: ..." line and status 1, not "terminate called" and SIGABRT.
#   uncaught_test.sh WEAVE_MPI_TIMEOUT
set -u
out=$(timeout 30 "$1" uncaught 2>&1)
code=$?
printf '%s\n' "$out"
[ "$code" -eq 1 ] || { echo "FAIL: exit status $code, expected 1"; exit 1; }
grep -qE '^\[weave\] rank 0: uncaught exception: \[train\] rank 0 failed on purpose, uncaught$' <<<"$out" ||
  { echo "FAIL: no [weave] report line"; exit 1; }
if grep -q 'terminate called' <<<"$out"; then echo "FAIL: the C++ runtime's terminate message"; exit 1; fi
echo "PASS: one process, uncaught error reported, status 1"
