# Sourced by the multi-host tests: pretend hosts on this machine. `pretend_hosts_up N` makes N
# network namespaces joined by veth pairs and a bridge, host i at 10.78.0.i, and writes
# $PRETEND_MPIRUN, an mpirun that runs in host 1's namespace, starts remote ranks in the
# others' (instead of ssh) and speaks TCP between them: call it as you would mpirun, with -H or
# --hostfile naming 10.78.0.i. `pretend_host_down I` takes host I off the network and
# `pretend_host_up I` puts it back. pretend_hosts_up exits 77 (reported as skipped) where
# namespaces cannot be created (not root, no `ip`, a container without CAP_NET_ADMIN). The
# caller's EXIT trap must call pretend_hosts_cleanup.
pretend_prefix="wv$$"  # unique per run: parallel tests never share namespaces
pretend_count=0
pretend_work=""

pretend_skip() { echo "skipped: $*"; exit 77; }

pretend_hosts_cleanup() {
  local i
  set +e  # every step runs, whatever failed before or fails here (a caller's set -e included)
  # A process on an unreachable host outlives its job (as on a real lost host) and would hold
  # the caller's output open.
  for ((i = 1; i <= pretend_count; i++)); do
    ip netns pids "${pretend_prefix}_$i" 2>/dev/null | xargs -r kill -KILL 2>/dev/null
  done
  ip netns del "${pretend_prefix}_sw" 2>/dev/null
  for ((i = 1; i <= pretend_count; i++)); do ip netns del "${pretend_prefix}_$i" 2>/dev/null; done
  [ -z "$pretend_work" ] || rm -rf "$pretend_work"
}

pretend_hosts_up() {
  local count=$1 i ns bridge_ns="${pretend_prefix}_sw"
  [ "$(id -u)" -eq 0 ] || pretend_skip "creating network namespaces needs root"
  command -v ip >/dev/null || pretend_skip "no 'ip' command (iproute2)"
  ip netns add "$bridge_ns" 2>/dev/null || pretend_skip "cannot create network namespaces here"
  pretend_work=$(mktemp -d)
  ip -n "$bridge_ns" link add br0 type bridge && ip -n "$bridge_ns" link set br0 up || exit 1
  for ((i = 1; i <= count; i++)); do
    ns="${pretend_prefix}_$i"
    ip netns add "$ns" || exit 1
    pretend_count=$i
    ip link add "${pretend_prefix}h$i" type veth peer name "${pretend_prefix}b$i" || exit 1
    ip link set "${pretend_prefix}h$i" netns "$ns"
    ip link set "${pretend_prefix}b$i" netns "$bridge_ns"
    ip -n "$bridge_ns" link set "${pretend_prefix}b$i" master br0
    ip -n "$bridge_ns" link set "${pretend_prefix}b$i" up
    ip -n "$ns" addr add "10.78.0.$i/24" dev "${pretend_prefix}h$i"
    ip -n "$ns" link set "${pretend_prefix}h$i" up
    ip -n "$ns" link set lo up
  done
  # mpirun starts a remote rank through this agent instead of ssh: "ssh" into a namespace.
  cat > "$pretend_work/agent" <<AGENT
#!/bin/bash
while [[ "\$1" == -* ]]; do shift; done
host=\$1; shift
exec ip netns exec "${pretend_prefix}_\${host##*.}" bash -c "\$*"
AGENT
  PRETEND_MPIRUN="$pretend_work/mpirun"
  cat > "$PRETEND_MPIRUN" <<MPIRUN
#!/bin/bash
exec ip netns exec "${pretend_prefix}_1" env PATH="\$PATH" mpirun \\
  --mca plm_rsh_agent "$pretend_work/agent" --mca btl tcp,self \\
  --mca btl_tcp_if_include 10.78.0.0/24 --mca oob_tcp_if_include 10.78.0.0/24 --bind-to none "\$@"
MPIRUN
  chmod +x "$pretend_work/agent" "$PRETEND_MPIRUN"
}

pretend_host_down() { ip -n "${pretend_prefix}_$1" link set "${pretend_prefix}h$1" down; }
pretend_host_up() { ip -n "${pretend_prefix}_$1" link set "${pretend_prefix}h$1" up; }
