#!/usr/bin/env bash
# `meshrun bench allreduce` over the loopback gRPC ring with --ring-chunk-bytes: a cluster for each
# chunk size in turn, whose workers take it as --ring_chunk_bytes (a worker refusing the flag
# fails the bench), each printing its setting and a row per size.
# Usage: allreduce_bench_test.sh BIN_DIR
set -euo pipefail
BIN=$1
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
if ! "$BIN/meshrun" bench allreduce --workers 3 --sizes 4096 65536 --iters 3 --no-shm --insecure \
  --algorithm ring --ring-chunk-bytes 1024 65536 > "$TMP/out" 2>&1; then
  cat "$TMP/out"
  echo "FAIL: the bench failed"
  exit 1
fi
cat "$TMP/out"
for chunk in 1024 65536; do
  # The setting's header, then its two rows.
  grep -A2 "^# workers --ring_chunk_bytes=$chunk\$" "$TMP/out" > "$TMP/rows" ||
    { echo "FAIL: no cluster with --ring_chunk_bytes=$chunk"; exit 1; }
  for size in "4 KiB" "64 KiB"; do
    grep -Eq "^ +3 +$size +ring +3 +[0-9.]+ " "$TMP/rows" ||
      { echo "FAIL: no row for $size with --ring_chunk_bytes=$chunk"; exit 1; }
  done
done
echo "PASS"
