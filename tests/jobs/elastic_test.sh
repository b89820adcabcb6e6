#!/usr/bin/env bash
# weave-run restarts a job one of whose ranks is SIGKILLed at a random step:
#   1. at the same world size: the final parameters equal an uninterrupted run's, bit for bit;
#   2. with --min-np, after a host (slot) is gone: the job goes on at fewer ranks, and ends
#      with the parameters of a run resharded at the same step by hand (bit for bit).
#   3. weave-ckpt info describes the checkpoint and verifies it; a flipped byte fails it.
# usage: elastic_test.sh WEAVE_RUN ELASTIC_TRAIN WEAVE_CKPT MPIRUN...
set -euo pipefail
weave_run=$1 train=$2 weave_ckpt=$3
shift 3
mpirun=("$@")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
steps=12
kill_at=$((2 + RANDOM % (steps - 3)))  # a step from 2 to steps - 2
echo "kill at step $kill_at"

"${mpirun[@]}" -np 2 "$train" --steps $steps --out "$work/reference.txt" >/dev/null

# 1. the same size: at the random step, and right after an epoch's last step (4 steps an epoch),
#    where the resumed loader must start the next epoch
boundary=$((4 * (1 + RANDOM % 2) + 1))
for at in $kill_at $boundary; do
  rm -rf "$work/same"
  "$weave_run" --mpirun "${mpirun[0]}" --np 2 --max-restarts 2 --retry-wait 0 \
    --checkpoint-dir "$work/same" "${mpirun[@]:1}" -- \
    "$train" --steps $steps --out "$work/same.txt" --kill-at $at 2>&1 | tee "$work/same.log"
  grep -q "attempt 1 ended by signal\|attempt 1 failed" "$work/same.log" ||
    { echo "FAIL: the first attempt did not fail"; exit 1; }
  grep -q "attempt 2 succeeded" "$work/same.log" || { echo "FAIL: no successful restart"; exit 1; }
  grep -q "resumed at step [0-9]* with 2 ranks" "$work/same.log" ||
    { echo "FAIL: the restart started afresh"; exit 1; }
  cmp "$work/same.txt" "$work/reference.txt" ||
    { echo "FAIL: same size differs (killed at step $at)"; exit 1; }
  echo "same size, killed at step $at: exact"
done

# 2. a host gone: 2 slots on the first attempt, 1 after
cat > "$work/hosts.sh" <<HOSTS
#!/bin/sh
if [ -e "$work/asked" ]; then echo localhost:1; else touch "$work/asked"; echo localhost:2; fi
HOSTS
chmod +x "$work/hosts.sh"
"$weave_run" --mpirun "${mpirun[0]}" --np 2 --min-np 1 --host-discovery-script "$work/hosts.sh" \
  --max-restarts 2 --retry-wait 0 --checkpoint-dir "$work/shrunk" "${mpirun[@]:1}" -- \
  "$train" --steps $steps --out "$work/shrunk.txt" --kill-at $kill_at 2>&1 | tee "$work/shrunk.log"
grep -q "attempt 2 of 3: 1 ranks" "$work/shrunk.log" || { echo "FAIL: not relaunched at 1 rank"; exit 1; }
resumed=$(grep -o "resumed at step [0-9]* with 1 ranks" "$work/shrunk.log" | grep -o "step [0-9]*" | grep -o "[0-9]*")
[ -n "$resumed" ] || { echo "FAIL: the second attempt did not resume"; exit 1; }
# by hand: 2 ranks up to that step, then 1 rank from its checkpoint
"${mpirun[@]}" -np 2 "$train" --steps "$resumed" --checkpoint "$work/by_hand" >/dev/null
"${mpirun[@]}" -np 1 "$train" --steps $steps --checkpoint "$work/by_hand" --out "$work/by_hand.txt" >/dev/null
cmp "$work/shrunk.txt" "$work/by_hand.txt" || { echo "FAIL: resharded restart differs"; exit 1; }

# 3. inspection
"$weave_ckpt" info "$work/shrunk" | tee "$work/info.txt"
grep -q "generation $steps (the newest complete), saved by 1 ranks" "$work/info.txt"
grep -q "optimizer/exp_avg/0.weight .*\[8, 5\]" "$work/info.txt"
grep -q "checksums: ok" "$work/info.txt"
file=$(ls "$work"/same/rank-00001-of-00002.g*.safetensors)
printf '\x5a' | dd of="$file" bs=1 seek=$(($(stat -c %s "$file") - 5)) conv=notrunc 2>/dev/null
if "$weave_ckpt" info "$work/same" > "$work/corrupt.txt" 2>&1; then
  echo "FAIL: weave-ckpt accepted a corrupt file"; exit 1
fi
grep -qE "fails its checksum|has CRC-32 [0-9a-f]+, but the index recorded" "$work/corrupt.txt" ||
  { cat "$work/corrupt.txt"; exit 1; }
echo "weave-ckpt: described, and refused a flipped byte"
echo "fewer ranks: resumed at step $resumed at 1 rank, exact"
