# Hosts of their own on this machine, for tests and benchmarks between "hosts" (sourced by bash
# scripts; the shell twin of bench/netns_hosts.h): N network namespaces, each joined by a veth
# pair to one bridge in this namespace, so traffic between them crosses a veth, the bridge and a
# TCP stack per host instead of loopback. Needs root and iproute2.
#
#   netns_hosts_up TAG NET N [FIRST]  bridge ${TAG}b at NET.1/24; namespace ${TAG}n$i (i = 1..N)
#                                     at NET.$((FIRST + i - 1)) (FIRST defaults to 2), its veth
#                                     end ${TAG}p$i, the bridge's end ${TAG}h$i. TAG is at most 10
#                                     characters (interface names hold 15). Fails on the first
#                                     command that fails, leaving the rest to netns_hosts_down.
#   netns_hosts_down TAG N            removes all of it; safe to call more than once, or after a
#                                     partial netns_hosts_up.

netns_hosts_up() {
  local tag=$1 net=$2 n=$3 first=${4:-2} i
  ip link add "${tag}b" type bridge || return
  # A Docker engine sets the FORWARD policy to DROP, which bridged traffic meets when br_netfilter
  # is loaded: let this bridge forward between its own ports.
  if command -v iptables > /dev/null; then
    iptables -I FORWARD -i "${tag}b" -o "${tag}b" -j ACCEPT 2> /dev/null || true
  fi
  ip addr add "$net.1/24" dev "${tag}b" || return
  ip link set "${tag}b" up || return
  for i in $(seq 1 "$n"); do
    ip netns add "${tag}n$i" || return
    ip link add "${tag}h$i" type veth peer name "${tag}p$i" || return
    ip link set "${tag}h$i" master "${tag}b" up || return
    ip link set "${tag}p$i" netns "${tag}n$i" || return
    ip netns exec "${tag}n$i" ip addr add "$net.$((first + i - 1))/24" dev "${tag}p$i" || return
    ip netns exec "${tag}n$i" ip link set "${tag}p$i" up || return
    ip netns exec "${tag}n$i" ip link set lo up || return
  done
}

netns_hosts_down() {
  local tag=$1 n=$2 i
  for i in $(seq 1 "$n"); do
    # The pair first, by its bridge end: deleting the namespace alone can leave it behind while
    # a process still holds the namespace.
    ip link del "${tag}h$i" 2> /dev/null || true
    ip netns del "${tag}n$i" 2> /dev/null || true
  done
  if command -v iptables > /dev/null; then
    while iptables -D FORWARD -i "${tag}b" -o "${tag}b" -j ACCEPT 2> /dev/null; do :; done
  fi
  ip link del "${tag}b" 2> /dev/null || true
}
