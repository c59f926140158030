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
  tag="mrc$(($$ % 100000))"
  net="10.216.$(($$ % 250))"
  max=$(printf '%s\n' $workers | sort -n | tail -1)
  source "$here/../../scripts/netns-hosts.sh"
  trap 'netns_hosts_down "$tag" "$max"; rm -rf "$tmp"' EXIT
  netns_hosts_up "$tag" "$net" "$max"
  # Each rank runs in its own namespace. PMIx (rank <-> mpirun) listens on the bridge too, as
  # the ranks cannot reach this namespace's loopback.
  printf '#!/bin/sh\nexec ip netns exec %sn"$((OMPI_COMM_WORLD_RANK + 1))" "$@"\n' "$tag" > "$tmp/in_netns"
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
  # TCP on loopback, as meshrun's side: left to choose, MPI also tries the host's other interfaces
  # and hangs on one it cannot reach (a docker0 that is down).
  mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl "$1" \
    --mca btl_tcp_if_include lo -n "$2" "$tmp/allreduce_mpi" $sizes | tail -n +2
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
