#!/usr/bin/env bash
# weave-run across two pretend hosts (network namespaces, Open MPI over TCP; see
# pretend_hosts.sh), one rank each. Host 2 is lost in the middle of training and the host
# discovery script stops listing it: weave-run relaunches on host 1 alone, the program reshards
# the 2-rank checkpoint to 1 rank, and the final parameters equal a run resharded by hand at the
# same step (bit for bit). Host 2 is lost in two ways:
#   1. its rank is SIGKILLed (mpirun sees it die), then its network goes down;
#   2. its network goes down under a running job (nothing dies: weave's guard must notice, and
#      weave-run must end an mpirun that waits for the unreachable host).
# usage: elastic_multihost_test.sh WEAVE_RUN ELASTIC_TRAIN
set -euo pipefail
weave_run=$1 train=$2
source "$(dirname "$0")/../support/pretend_hosts.sh"
partitioner=""
trap '[ -z "$partitioner" ] || kill "$partitioner" 2>/dev/null || true; pretend_hosts_cleanup' EXIT
pretend_hosts_up 2
work="$pretend_work"
# The guard's timeout is short so that a lost host is noticed within seconds.
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  OMPI_MCA_mpi_yield_when_idle=1 WEAVE_TIMEOUT_S=5
local_mpirun=(mpirun --oversubscribe --bind-to none)

# lose_host CASE STEPS [TRAIN ARGS]: weave-run on both hosts, the discovery script listing host 2
# only on the first attempt; checks the relaunch at 1 rank and its result against a run
# resharded by hand at the step it resumed from.
lose_host() {
  local case=$1 steps=$2 resumed
  shift 2
  rm -f "$work/asked"
  pretend_host_up 2
  cat > "$work/hosts.sh" <<HOSTS
#!/bin/sh
if [ -e "$work/asked" ]; then
  ip -n ${pretend_prefix}_2 link set ${pretend_prefix}h2 down
  echo 10.78.0.1:1
else
  touch "$work/asked"
  printf '10.78.0.1:1\n10.78.0.2:1\n'
fi
HOSTS
  chmod +x "$work/hosts.sh"
  "$weave_run" --mpirun "$PRETEND_MPIRUN" --np 2 --min-np 1 \
    --host-discovery-script "$work/hosts.sh" --max-restarts 2 --retry-wait 0 --abort-grace 5 \
    --checkpoint-dir "$work/$case" -- "$train" --steps "$steps" --out "$work/$case.txt" "$@" \
    2>&1 | tee "$work/$case.log"
  grep -q "attempt 1 of 3: 2 ranks" "$work/$case.log" || { echo "FAIL: not started on 2 hosts"; exit 1; }
  grep -q "attempt 1 ended by signal\|attempt 1 failed" "$work/$case.log" ||
    { echo "FAIL: the first attempt did not fail"; exit 1; }
  grep -q "attempt 2 of 3: 1 ranks" "$work/$case.log" || { echo "FAIL: not relaunched at 1 rank"; exit 1; }
  grep -q "attempt 2 succeeded" "$work/$case.log" || { echo "FAIL: the relaunch failed"; exit 1; }
  resumed=$(grep -o "resumed at step [0-9]* with 1 ranks" "$work/$case.log" | grep -o "[0-9]*" | head -1)
  [ -n "$resumed" ] || { echo "FAIL: the relaunch did not resume"; exit 1; }
  # by hand, on this host: 2 ranks up to that step, then 1 rank from its checkpoint
  "${local_mpirun[@]}" -np 2 "$train" --steps "$resumed" --checkpoint "$work/$case.by_hand" >/dev/null
  "${local_mpirun[@]}" -np 1 "$train" --steps "$steps" --checkpoint "$work/$case.by_hand" \
    --out "$work/$case.by_hand.txt" >/dev/null
  cmp "$work/$case.txt" "$work/$case.by_hand.txt" ||
    { echo "FAIL: the relaunch on one host differs"; exit 1; }
  echo "$case: resumed at step $resumed on host 1 alone, exact"
}

# 1. host 2's rank is killed at a random step (mpirun sees it die)
kill_at=$((2 + RANDOM % 9))
echo "== host 2's rank killed at step $kill_at"
lose_host killed 12 --kill-at "$kill_at"

# 2. host 2's network goes down at a random generation while the job runs
down_at=$((3 + RANDOM % 8))
echo "== host 2's network down after generation $down_at"
(
  newest() { grep -so '"generation": *[0-9]*' "$work/partitioned/index.json" | grep -o '[0-9]*$'; }
  until [ "$(newest)" -ge "$down_at" ] 2>/dev/null; do sleep 0.02; done
  pretend_host_down 2
) &
partitioner=$!
lose_host partitioned 400
grep -q "tearing the job down" "$work/partitioned.log" ||
  { echo "FAIL: the guard did not notice the lost host"; exit 1; }
echo "PASS: a host lost both ways; resumed on host 1 alone, exact"
