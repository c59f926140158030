#!/usr/bin/env bash
# `meshrun bench allreduce --netns`: each worker in a network namespace of its own on a bridge,
# over gRPC with TLS as deployed; the all-reduce runs, its row is printed, and nothing the bench
# made (namespaces, links) is left behind. Needs root and iproute2 (exit 77: skipped).
# Usage: netns_bench_test.sh BIN_DIR
set -euo pipefail
BIN=$1
if [ "$(id -u)" != 0 ] || ! command -v ip > /dev/null; then
  echo "skipped: needs root and iproute2"
  exit 77
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$BIN/meshrun" bench allreduce --workers 2,3 --sizes 4096 65536 --netns > "$TMP/out" 2>&1 &
pid=$!
wait "$pid" || { cat "$TMP/out"; echo "FAIL: bench --netns failed"; exit 1; }
tag=$((pid % 100000))  # the bench names what it makes after its pid (bench/netns_hosts.cc)
cat "$TMP/out"
grep -q "between network namespaces on a bridge.*mutual TLS" "$TMP/out" ||
  { echo "FAIL: no --netns header"; exit 1; }
for n in 2 3; do
  for size in "4 KiB" "64 KiB"; do
    grep -Eq "^ +$n +$size +by size +[0-9]+ +[0-9.]+ " "$TMP/out" ||
      { echo "FAIL: no row for $n workers, $size"; exit 1; }
  done
done
if ip netns list | grep -q "^mrbn$tag-"; then
  ip netns list
  echo "FAIL: the bench left network namespaces behind"
  exit 1
fi
if ip link | grep -Eq "mrbb$tag[:@]|mrbh$tag-"; then  # (not another bench's longer tag)
  echo "FAIL: the bench left links behind"
  exit 1
fi
echo "PASS"
