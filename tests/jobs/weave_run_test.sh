#!/usr/bin/env bash
# weave-run's supervision beyond restarts:
#   1. --hang-timeout: a job stuck silently at a step is ended and relaunched, and resumes
#      exactly; a job that trains silently, slower than the timeout, lives on its heartbeats;
#   2. usage errors are not relaunched: the program's status 2, mpirun's unknown option, a
#      program that does not exist;
#   3. a host discovery script that does not finish is cut off by --discovery-timeout;
#   4. SIGTERM stops the job and weave-run exits 143;
#   5. SIGKILL of weave-run itself still ends the job (no unsupervised ranks left);
#   6. --retry-wait and --mpirun are checked before anything runs.
# usage: weave_run_test.sh WEAVE_RUN ELASTIC_TRAIN MPIRUN...
set -euo pipefail
weave_run=$1 train=$2
shift 2
mpirun=("$@")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
run() { "$weave_run" --mpirun "${mpirun[0]}" --retry-wait 0 "$@"; }
steps=10

"${mpirun[@]}" -np 2 "$train" --steps $steps --out "$work/reference.txt" >/dev/null

# 1. Hung at step 3 on the first attempt; 700 ms a step, silent, against a 5 s hang timeout
# (weave-run notes signs of life to the second, and a step's checkpoint save on a busy disk,
# with the watcher's own scheduling, left a 3 s timeout too little room: a CI run ended the
# healthy second attempt).
# Each line stamped as it arrives: ending the hung attempt (every process of its tree found in
# one pass over /proc, then signalled) takes seconds, not the tens of seconds a cat per /proc
# entry and process took. 300 idle processes make /proc as busy as a shared node's (the old
# way took 32 s here, 7 s without them).
sleepers=()
for _ in $(seq 300); do sleep 600 & sleepers+=($!); done
trap 'kill "${sleepers[@]}" 2>/dev/null; rm -rf "$work"' EXIT
run --np 2 --max-restarts 1 --hang-timeout 5 --checkpoint-dir "$work/hung" "${mpirun[@]:1}" -- \
  "$train" --steps $steps --out "$work/hung.txt" --hang-at 3 --step-ms 700 2>&1 |
  while IFS= read -r line; do printf '%(%s)T %s\n' -1 "$line"; done | tee "$work/hung.log"
grep -q "attempt 1: no output and no heartbeat for 5 s" "$work/hung.log" ||
  fail "the hung attempt was not ended"
declared=$(grep -m1 "looks hung; ending it" "$work/hung.log" | cut -d' ' -f1)
relaunched=$(grep -m1 "attempt 2 of 2" "$work/hung.log" | cut -d' ' -f1)
[ $((relaunched - declared)) -le 8 ] ||
  fail "ending the hung attempt took $((relaunched - declared)) s"
echo "hang: ended and relaunched $((relaunched - declared)) s after it was declared hung"
kill "${sleepers[@]}" 2>/dev/null || true
sleepers=()
grep -q "attempt 2 succeeded" "$work/hung.log" || fail "no successful relaunch"
grep -q "resumed at step 3 with 2 ranks" "$work/hung.log" || fail "did not resume at step 3"
! grep -q "heartbeat\] rank" "$work/hung.log" || fail "heartbeats leaked into the output"
cmp "$work/hung.txt" "$work/reference.txt" || fail "the relaunched run differs"
echo "hang: ended after 5 s of silence, relaunched, resumed exactly; the slow run beat on"

# 2. Usage errors end weave-run at once, with their status.
status=0
run --np 1 --max-restarts 3 -- bash -c 'echo "unknown flag --lr" >&2; exit 2' \
  > "$work/usage.log" 2>&1 || status=$?
[ "$status" -eq 2 ] || fail "status 2 became $status"
grep -q "a usage error by convention: not restarting" "$work/usage.log" || fail "restarted on 2"
! grep -q "attempt 2" "$work/usage.log" || fail "a usage error was relaunched"
for launch in "--no-such-mpirun-option -- true" "-- $work/no-such-program"; do
  status=0
  # shellcheck disable=SC2086
  run --np 1 --max-restarts 3 "${mpirun[@]:1}" $launch > "$work/refused.log" 2>&1 || status=$?
  [ "$status" -ne 0 ] || fail "'$launch' succeeded"
  grep -q "mpirun refused the launch" "$work/refused.log" ||
    { cat "$work/refused.log"; fail "'$launch' was not seen as a usage error"; }
  ! grep -q "attempt 2" "$work/refused.log" || fail "'$launch' was relaunched"
done
# A count past bash's arithmetic: weave-run's own message, no shell error before it.
run --np 99999999999999999999 -- true > "$work/huge.log" 2>&1 && fail "--np 10^20 was taken"
grep -q "integer expression" "$work/huge.log" && fail "a shell error: $(cat "$work/huge.log")"
grep -q "\-\-np must be a positive count, found '99999999999999999999'" "$work/huge.log" ||
  fail "--np 10^20 was not refused clearly: $(cat "$work/huge.log")"
echo "usage errors: not relaunched"

# 3. A discovery script that hangs.
printf '#!/bin/sh\nsleep 60\n' > "$work/slow-hosts.sh"
chmod +x "$work/slow-hosts.sh"
start=$SECONDS
status=0
run --np 1 --max-restarts 1 --discovery-timeout 1 --host-discovery-script "$work/slow-hosts.sh" \
  -- true > "$work/discovery.log" 2>&1 || status=$?
[ "$status" -ne 0 ] || fail "no hosts, yet success"
grep -q "did not finish in 1 s (--discovery-timeout)" "$work/discovery.log" ||
  { cat "$work/discovery.log"; fail "the discovery script was not cut off"; }
[ $((SECONDS - start)) -lt 20 ] || fail "the discovery timeout took $((SECONDS - start)) s"
echo "discovery: cut off after 1 s"

# 4. SIGTERM: the job stops, weave-run exits 143 and relaunches nothing.
run --np 1 --max-restarts 3 "${mpirun[@]:1}" -- sleep 60 > "$work/term.log" 2>&1 &
supervisor=$!
for _ in $(seq 100); do grep -q "attempt 1 of" "$work/term.log" && break; sleep 0.1; done
sleep 0.5
kill -TERM "$supervisor"
status=0
wait "$supervisor" || status=$?
[ "$status" -eq 143 ] || { cat "$work/term.log"; fail "SIGTERM gave status $status, not 143"; }
! grep -q "attempt 2" "$work/term.log" || fail "relaunched after SIGTERM"
echo "SIGTERM: stopped with 143"

# 5. SIGKILL: no trap runs, yet the job must not outlive weave-run.
running() {  # whether a process runs with this exact command line
  local cmdline
  for cmdline in /proc/[0-9]*/cmdline; do
    [ "$( { tr '\0' ' ' < "$cmdline"; } 2>/dev/null)" = "$1 " ] && return 0
  done
  return 1
}
marker="sleep 61.25"
"$weave_run" --mpirun "${mpirun[0]}" --np 1 --max-restarts 3 "${mpirun[@]:1}" -- $marker \
  > "$work/kill.log" 2>&1 &
supervisor=$!
for _ in $(seq 100); do running "$marker" && break; sleep 0.1; done
running "$marker" || { cat "$work/kill.log"; fail "the job did not start"; }
kill -KILL "$supervisor"
for _ in $(seq 100); do running "$marker" || break; sleep 0.1; done
! running "$marker" || fail "the job outlived weave-run's SIGKILL by 10 s"
echo "SIGKILL of weave-run: the job ended with it"

# 6. Bad values of weave-run's own options.
for bad in "--retry-wait soon" "--retry-wait -1" "--mpirun $work/no-such-mpirun"; do
  status=0
  # shellcheck disable=SC2086
  run --np 1 $bad -- true > "$work/bad.log" 2>&1 || status=$?
  [ "$status" -eq 2 ] && grep -q -- "${bad%% *} .*must be\|is not a program" "$work/bad.log" ||
    { cat "$work/bad.log"; fail "'$bad' was not refused with status 2"; }
done
echo "bad option values: refused"
echo "PASS: weave-run supervision"
