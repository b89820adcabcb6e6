#!/usr/bin/env bash
# The roll call and the flight recorder: at 4 ranks, rank 2 sleeps before all_reduce #12 and the
# others wait in it (WEAVE_TIMEOUT_S=3). Within 4 s every waiting rank must report that rank 2
# has not arrived and that it last issued all_reduce #11 (op and shape named); each rank's
# flight recorder (WEAVE_FLIGHT_RECORDER=16) is written, and weave_trace_merge names the same
# divergence. Then rank 2 never reaches dist::realign: the others, inside it, name it.
# usage: roll_call_test.sh TIMEOUT_PROGRAM TRACE_MERGE MPIRUN...
set -uo pipefail
program=$1 merge=$2
shift 2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
WEAVE_TIMEOUT_S=3 WEAVE_FLIGHT_RECORDER=16 WEAVE_FLIGHT_RECORDER_FILE="$work/flight.json" \
  "$@" -np 4 "$program" late-rank > "$work/out.log" 2>&1 &
job=$!
# The reports' arrival, timed from the launch (mpirun's start-up included).
reported=""
for _ in $(seq 200); do
  if [ "$(grep -c "roll call: rank 2 has not arrived" "$work/out.log")" -ge 3 ]; then
    reported=$(date +%s%3N)
    break
  fi
  sleep 0.05
done
wait "$job" && fail "the job succeeded"
cat "$work/out.log"
[ -n "$reported" ] || fail "not every waiting rank reported the roll call"
for rank in 0 1 3; do
  grep -q "rank $rank: all_reduce(float32 \[4\], sum) #12 .*roll call: rank 2 has not arrived: it last issued all_reduce(float32 \[4\], sum) #11 on this group" "$work/out.log" ||
    fail "rank $rank did not name rank 2 and its last call #11"
done
waits_from=$(grep -o "late-rank: waits from [0-9]*" "$work/out.log" | awk '{print $4}')
[ -n "$waits_from" ] || fail "rank 0 did not say when it began to wait"
took=$((reported - waits_from))
[ "$took" -le 4000 ] || fail "the reports came $took ms after rank 0 began to wait (over 4 s)"
echo "every waiting rank named rank 2 and all_reduce #11 within $took ms of the wait's start"
for rank in 0 1 2 3; do
  [ -s "$work/flight.rank$rank.json" ] || fail "no flight recorder file from rank $rank"
done
"$merge" "$work"/flight.rank{0,1,2,3}.json > "$work/merged.json" 2> "$work/merge.log"
cat "$work/merge.log"
grep -q "first divergence: group \[0, 1, 2, 3\], call #12: ranks \[0, 1, 3\] issued all_reduce(float32 \[4\], sum) #12; rank 2 did not (its last: all_reduce(float32 \[4\], sum) #11" "$work/merge.log" ||
  fail "the merged flight recorder does not name the divergence"
# A rank that never reaches dist::realign: realign's rounds carry no number, so the ranks
# inside it must ask where the peer stands rather than count its calls.
WEAVE_TIMEOUT_S=3 "$@" -np 4 "$program" late-realign > "$work/realign.log" 2>&1 &&
  fail "the late-realign job succeeded"
cat "$work/realign.log"
for rank in 0 1 3; do
  grep -q "rank $rank: realign #0 .*roll call: rank 2 has not reached realign: it last issued all_reduce(float32 \[4\], sum) #11 on this group, .*; ranks \[0, 1, 3\] are in this call" "$work/realign.log" ||
    fail "rank $rank did not name rank 2 as outside realign"
done
echo "PASS: roll call and flight recorder"
