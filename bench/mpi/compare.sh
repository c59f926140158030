#!/usr/bin/env bash
# meshrun's all-reduce beside Open MPI's on this machine, in one run (f32 sum, p50, busbw as
# ../shared/REFERENCE.md defines it): MPI over TCP (--mca btl tcp,self) against meshrun's gRPC
# transport (--no-shm), and MPI's shared memory (vader) against meshrun's shared memory.
#
# Usage: bench/mpi/compare.sh [--netns] [BUILD_DIR] [WORKER_COUNTS] [SIZES]
#   e.g. bench/mpi/compare.sh build "2 4 8" "4096 16777216 67108864"
# --netns (root): both sides between hosts of their own instead: each rank in a network namespace
# joined by a veth pair to one bridge (as `meshrun bench allreduce --netns` builds them), MPI over
# TCP on the bridge against meshrun's gRPC transport (--no-shm --insecure).
# Needs Open MPI (apt-get install openmpi-bin libopenmpi-dev); meshrun itself does not.
set -euo pipefail
netns=0
if [ "${1:-}" = "--netns" ]; then
  netns=1
  shift
fi
build=${1:-build}
workers=${2:-"2 4 8"}
sizes=${3:-"4096 16777216 67108864"}
command -v mpicc > /dev/null || { echo "compare.sh: needs Open MPI (apt-get install openmpi-bin libopenmpi-dev)" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mpicc -O2 -o "$tmp/allreduce_mpi" "$here/allreduce_mpi.c"
if [ "$netns" = 1 ]; then
  [ "$(id -u)" = 0 ] || { echo "compare.sh --netns: network namespaces need root" >&2; exit 2; }
  tag="mrc$(($$ % 100000))"  # interface names stay within 15 characters
  net="10.216.$(($$ % 250))"
  max=$(printf '%s\n' $workers | sort -n | tail -1)
  teardown() {
    for r in $(seq 0 $((max - 1))); do
      ip link del "${tag}h$r" 2> /dev/null || true
      ip netns del "${tag}n$r" 2> /dev/null || true
    done
    iptables -D FORWARD -i "${tag}b" -o "${tag}b" -j ACCEPT 2> /dev/null || true
    ip link del "${tag}b" 2> /dev/null || true
    rm -rf "$tmp"
  }
  trap teardown EXIT
  ip link add "${tag}b" type bridge
  # Docker sets FORWARD's policy to DROP, which bridged traffic meets when br_netfilter is loaded.
  iptables -I FORWARD -i "${tag}b" -o "${tag}b" -j ACCEPT 2> /dev/null || true
  ip addr add "$net.1/24" dev "${tag}b"
  ip link set "${tag}b" up
  for r in $(seq 0 $((max - 1))); do
    ip netns add "${tag}n$r"
    ip link add "${tag}h$r" type veth peer name "${tag}p$r"
    ip link set "${tag}h$r" master "${tag}b" up
    ip link set "${tag}p$r" netns "${tag}n$r"
    ip netns exec "${tag}n$r" ip addr add "$net.$((r + 2))/24" dev "${tag}p$r"
    ip netns exec "${tag}n$r" ip link set "${tag}p$r" up
    ip netns exec "${tag}n$r" ip link set lo up
  done
  # Each rank runs in its own namespace. PMIx (rank <-> mpirun) listens on the bridge too, as
  # the ranks cannot reach this namespace's loopback.
  printf '#!/bin/sh\nexec ip netns exec %sn"$OMPI_COMM_WORLD_RANK" "$@"\n' "$tag" > "$tmp/in_netns"
  chmod +x "$tmp/in_netns"
  for n in $workers; do
    echo "== $n ranks: Open MPI over TCP between network namespaces (btl tcp,self)"
    PMIX_MCA_ptl_tcp_remote_connections=1 PMIX_MCA_ptl_tcp_if_include="$net.0/24" \
      mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl tcp,self \
      --mca btl_tcp_if_include "$net.0/24" -n "$n" "$tmp/in_netns" "$tmp/allreduce_mpi" $sizes |
      tail -n +2
  done
  echo "== meshrun over gRPC between network namespaces, TLS off as MPI's TCP (--netns --no-shm --insecure)"
  "$build/bin/meshrun" bench allreduce --netns --workers "${workers// /,}" --sizes $sizes --no-shm --insecure
  exit 0
fi
mpi() {  # $1: btl list, $2: ranks
  mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl "$1" -n "$2" \
    "$tmp/allreduce_mpi" $sizes | tail -n +2
}
for n in $workers; do
  echo "== $n ranks: Open MPI over TCP (btl tcp,self)"
  mpi tcp,self "$n"
  echo "== $n ranks: Open MPI shared memory (btl vader,self)"
  mpi vader,self "$n"
done
echo "== meshrun over gRPC, TLS off as MPI's TCP (--no-shm --insecure)"
"$build/bin/meshrun" bench allreduce --workers "${workers// /,}" --sizes $sizes --no-shm --insecure
echo "== meshrun over gRPC with mutual TLS, its default (--no-shm)"
"$build/bin/meshrun" bench allreduce --workers "${workers// /,}" --sizes $sizes --no-shm
echo "== meshrun over shared memory"
"$build/bin/meshrun" bench allreduce --workers "${workers// /,}" --sizes $sizes
