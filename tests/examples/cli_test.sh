#!/usr/bin/env bash
# The examples' command lines (CLI11): a mistyped flag, a malformed value and a value out of
# range each exit 2 with an error that names the flag; --help lists the flags with their
# defaults and exits 0; values the run cannot use (a context longer than the text, absurd thread
# counts) exit 1 with weave's error.
# usage: cli_test.sh GPT FASHION_MNIST_DDP
set -uo pipefail
gpt=$1 fashion=$2
fail() { echo "FAIL: $*"; exit 1; }
expect_exit() {  # the exit status, what it must say, then the command
  local want_status=$1 want=$2 out status
  shift 2
  out=$("$@" 2>&1)
  status=$?
  [ "$status" -eq "$want_status" ] || fail "'$*' exited $status, expected $want_status: $out"
  # Here-strings, not pipes: under pipefail, grep -q leaving early fails the writer (SIGPIPE).
  grep -qF -- "$want" <<<"$out" || fail "'$*' did not say '$want': $out"
  echo "ok: $* -> $(grep -m1 -F -- "$want" <<<"$out")"
}
expect_usage_error() { expect_exit 2 "$@"; }
# Values the parser accepts but the run cannot: exit 1 with weave's error, not a crash.
expect_run_error() { expect_exit 1 "$@"; }
expect_usage_error "--stepz" "$gpt" --stepz 5
expect_usage_error "--steps: must be above 0, found -3" "$gpt" --steps -3
expect_usage_error "--lr: expected a number, found '1e-'" "$gpt" --lr 1e-
expect_usage_error "--lr: expected a finite number, found inf" "$gpt" --lr inf
expect_usage_error "--min-lr: expected a finite number, found nan" "$gpt" --min-lr nan
expect_usage_error "--steps: Value 99999999999999 not in range 1 to 1000000000" "$gpt" --steps 99999999999999

expect_usage_error "--strategy" "$gpt" --strategy zero9
expect_usage_error "--strategy: expected ddp, dist-opt" "$fashion" --strategy foo
expect_usage_error "--epochs" "$fashion" --epochs
expect_run_error "--context 100000000 needs more text" "$gpt" --context 100000000 --steps 1
expect_run_error "[set_num_threads] expected 1 to" "$gpt" --threads 100000 --steps 1
help=$("$gpt" --help) || fail "--help exited $?"
grep -q -- "--steps INT:POSITIVE:INT in \[1 - 1000000000\]=600" <<<"$help" || fail "--help lacks --steps: $help"
echo "PASS: command lines checked"
