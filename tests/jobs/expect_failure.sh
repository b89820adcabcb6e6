#!/usr/bin/env bash
# expect_failure.sh MAX_SECONDS REGEX COMMAND...: passes if COMMAND exits non-zero within
# MAX_SECONDS and its output matches REGEX (so a hang or a silent failure is a test failure).
# REGEX may list several patterns separated by " &&& ": each must match a line of the output.
set -u
max=$1 regex=$2
shift 2
start=$(date +%s)
output=$(timeout --kill-after=5 "$((max + 30))" "$@" 2>&1)
code=$?
elapsed=$(( $(date +%s) - start ))
printf '%s\n' "$output"
echo "exit code $code after ${elapsed}s (limit ${max}s)"
[ "$code" -ne 0 ] || { echo "FAIL: expected a non-zero exit"; exit 1; }
[ "$elapsed" -le "$max" ] || { echo "FAIL: took ${elapsed}s"; exit 1; }
rest=$regex
while :; do
  pattern=${rest%% &&& *}
  printf '%s\n' "$output" | grep -Eq -- "$pattern" ||
    { echo "FAIL: output does not match: $pattern"; exit 1; }
  [ "$pattern" = "$rest" ] && break
  rest=${rest#* &&& }
done
echo "PASS"
