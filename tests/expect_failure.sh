#!/usr/bin/env bash
# expect_failure.sh MAX_SECONDS REGEX COMMAND...: passes if COMMAND exits non-zero within
# MAX_SECONDS and its output matches REGEX (so a hang or a silent failure is a test failure).
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
printf '%s\n' "$output" | grep -Eq -- "$regex" || { echo "FAIL: output does not match: $regex"; exit 1; }
echo "PASS"
