#!/usr/bin/env bash
# Construction beats: FSDP drawing a deferred model does no communication for seconds, and a
# supervising `weave-run --hang-timeout` must still see the rank alive. With WEAVE_HEARTBEAT_S =
# 0.1, the draw's seconds must hold at least half the beats they have room for (the wrapper holds
# a KeepAlive, so weave's watchdog beats; without it only the few collectives around it would).
#   heartbeat_test.sh WEAVE_MPI_TIMEOUT WIDTH LAYERS
set -u
out=$(WEAVE_HEARTBEAT_S=0.1 timeout 120 "$1" deferred-draw "$2" "$3" 2>"${TMPDIR:-/tmp}/beats.$$")
code=$?
beats=$(grep -c '^\[weave-run heartbeat\] rank 0$' "${TMPDIR:-/tmp}/beats.$$")
rm -f "${TMPDIR:-/tmp}/beats.$$"
echo "$out; $beats heartbeats"
[ "$code" -eq 0 ] || { echo "FAIL: exit status $code"; exit 1; }
seconds=$(sed -n 's/^deferred-draw: \([0-9.]*\) s$/\1/p' <<<"$out")
[ -n "$seconds" ] || { echo "FAIL: no time printed"; exit 1; }
awk -v s="$seconds" 'BEGIN { exit !(s >= 1.0) }' ||
  { echo "FAIL: the draw took $seconds s, too short to tell (make the model larger)"; exit 1; }
awk -v s="$seconds" -v b="$beats" 'BEGIN { exit !(b >= s / 0.1 / 2) }' ||
  { echo "FAIL: $beats heartbeats in $seconds s of drawing"; exit 1; }
echo "PASS: the draw beat $beats times in $seconds s"
