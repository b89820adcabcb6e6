#!/usr/bin/env bash
# multihost_test.sh PROGRAM ARGS...: runs PROGRAM (a data-parallel training run) at 2 ranks on
# two pretend hosts -- network namespaces joined by veth pairs and a bridge, Open MPI over TCP
# between them -- and at 2 ranks on this host (shared memory), and checks that both print the
# same losses and accuracies. Exits 77 (reported as skipped) where namespaces cannot be
# created (not root, no `ip`, a container without CAP_NET_ADMIN).
set -u
skip() { echo "skipped: $*"; exit 77; }
[ "$(id -u)" -eq 0 ] || skip "creating network namespaces needs root"
command -v ip >/dev/null || skip "no 'ip' command (iproute2)"
prefix="wv$$"  # unique per run: parallel tests never share namespaces
bridge_ns="${prefix}_sw"
work=$(mktemp -d)
cleanup() {
  for ns in "$bridge_ns" "${prefix}_1" "${prefix}_2"; do ip netns del "$ns" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
ip netns add "$bridge_ns" 2>/dev/null || skip "cannot create network namespaces here"
ip -n "$bridge_ns" link add br0 type bridge && ip -n "$bridge_ns" link set br0 up || exit 1
for i in 1 2; do
  ns="${prefix}_$i"
  ip netns add "$ns" || exit 1
  ip link add "${prefix}h$i" type veth peer name "${prefix}b$i" || exit 1
  ip link set "${prefix}h$i" netns "$ns"
  ip link set "${prefix}b$i" netns "$bridge_ns"
  ip -n "$bridge_ns" link set "${prefix}b$i" master br0
  ip -n "$bridge_ns" link set "${prefix}b$i" up
  ip -n "$ns" addr add "10.78.0.$i/24" dev "${prefix}h$i"
  ip -n "$ns" link set "${prefix}h$i" up
  ip -n "$ns" link set lo up
done
# mpirun starts the remote rank through this agent instead of ssh: "ssh" into a namespace.
cat > "$work/agent" <<AGENT
#!/bin/bash
while [[ "\$1" == -* ]]; do shift; done
host=\$1; shift
exec ip netns exec "${prefix}_\${host##*.}" bash -c "\$*"
AGENT
chmod +x "$work/agent"
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  OMPI_MCA_mpi_yield_when_idle=1 WEAVE_TIMEOUT_S=120
echo "== two hosts over TCP (10.78.0.1, 10.78.0.2)"
ip netns exec "${prefix}_1" env PATH="$PATH" mpirun --mca plm_rsh_agent "$work/agent" \
  --mca btl tcp,self --mca btl_tcp_if_include 10.78.0.0/24 --mca oob_tcp_if_include 10.78.0.0/24 \
  --bind-to none -H 10.78.0.1:1,10.78.0.2:1 -np 2 "$@" > "$work/hosts.txt" 2>&1
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
