#!/usr/bin/env bash
# meshrun's all-reduce beside Open MPI's on this machine, in one run (f32 sum, p50, busbw as
# ../shared/REFERENCE.md defines it): MPI over TCP (--mca btl tcp,self) against meshrun's gRPC
# transport (--no-shm), and MPI's shared memory (vader) against meshrun's shared memory.
#
# Usage: bench/mpi/compare.sh [BUILD_DIR] [WORKER_COUNTS] [SIZES]
#   e.g. bench/mpi/compare.sh build "2 4 8" "4096 16777216 67108864"
# Needs Open MPI (apt-get install openmpi-bin libopenmpi-dev); meshrun itself does not.
set -euo pipefail
build=${1:-build}
workers=${2:-"2 4 8"}
sizes=${3:-"4096 16777216 67108864"}
command -v mpicc > /dev/null || { echo "compare.sh: needs Open MPI (apt-get install openmpi-bin libopenmpi-dev)" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mpicc -O2 -o "$tmp/allreduce_mpi" "$here/allreduce_mpi.c"
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
