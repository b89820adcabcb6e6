#!/usr/bin/env bash
# multihost_test.sh PROGRAM ARGS...: runs PROGRAM (a data-parallel training run) at 2 ranks on
# two pretend hosts -- network namespaces joined by veth pairs and a bridge, Open MPI over TCP
# between them -- and at 2 ranks on this host (shared memory), and checks that both print the
# same losses and accuracies. Exits 77 (reported as skipped) where namespaces cannot be
# created (not root, no `ip`, a container without CAP_NET_ADMIN).
set -u
source "$(dirname "$0")/../support/pretend_hosts.sh"
trap pretend_hosts_cleanup EXIT
pretend_hosts_up 2
work="$pretend_work"
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  OMPI_MCA_mpi_yield_when_idle=1 WEAVE_TIMEOUT_S=120
echo "== two hosts over TCP (10.78.0.1, 10.78.0.2)"
"$PRETEND_MPIRUN" -H 10.78.0.1:1,10.78.0.2:1 -np 2 "$@" > "$work/hosts.txt" 2>&1
code=$?
cat "$work/hosts.txt"
[ "$code" -eq 0 ] || { echo "FAIL: the two-host run exited $code"; exit 1; }
echo "== one host (shared memory)"
mpirun --oversubscribe --bind-to none -np 2 "$@" > "$work/local.txt" 2>&1 ||
  { cat "$work/local.txt"; echo "FAIL: the one-host run failed"; exit 1; }
cat "$work/local.txt"
# Everything but the timings must agree, digit for digit.
strip() { grep -E "loss=|test_accuracy=" "$1" | sed -E 's/ time=[0-9.]+s//'; }
[ -n "$(strip "$work/local.txt")" ] || { echo "FAIL: no loss lines printed"; exit 1; }
if [ "$(strip "$work/hosts.txt")" != "$(strip "$work/local.txt")" ]; then
  echo "FAIL: the losses differ between two hosts and one host"
  diff <(strip "$work/hosts.txt") <(strip "$work/local.txt")
  exit 1
fi
echo "PASS: two hosts over TCP and one host give the same losses"
