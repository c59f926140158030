#!/usr/bin/env bash
# Multi-host test without containers: the coordinator in the root network namespace and N workers,
# each in its own namespace with its own address on a private bridge (this test's own hosts,
# 10.213.77.0/24), train the main job across them. Needs root and iproute2 (exit 77: skipped).
# Usage: netns_test.sh BIN_DIR [N]
set -euo pipefail
BIN=$1
N=${2:-4}
if [ "$(id -u)" != 0 ] || ! command -v ip > /dev/null; then
  echo "skipped: needs root and iproute2"
  exit 77
fi
NET=10.213.77
TAG=mrt$(($$ % 1000000))
source "$(dirname "$0")/../../scripts/netns-hosts.sh"
TMP=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2> /dev/null || true; done
  sleep 0.5
  netns_hosts_down "$TAG" "$N"
  rm -rf "$TMP"
}
trap cleanup EXIT
# Worker i at $NET.$((10 + i)).
netns_hosts_up "$TAG" "$NET" "$N" 11

# TLS on, as by default: every process reads the credentials through MESHRUN_TLS_DIR.
"$BIN/meshrun" certs init "$TMP/tls" > /dev/null
export MESHRUN_TLS_DIR="$TMP/tls"
"$BIN/meshrun-coordinator" --mesh "data=$N" --host "$NET.1" --port 0 --port_file "$TMP/port" \
  --metrics_port -1 > "$TMP/coordinator.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 100); do [ -s "$TMP/port" ] && break; sleep 0.1; done
COORD="$NET.1:$(cat "$TMP/port")"
for i in $(seq 1 "$N"); do
  ip netns exec "${TAG}n$i" "$BIN/meshrun-worker" --coordinator "$COORD" --host "$NET.$((10 + i))" \
    --compute_threads 1 --metrics_port -1 --join_timeout 30s > "$TMP/worker$i.log" 2>&1 &
  PIDS+=($!)
done

cat > "$TMP/job.json" << JOB
{"mesh": {"data": $N}, "train": {"max_steps": 100, "log_every": 50, "evaluate": true}}
JOB
if ! "$BIN/meshrun" train --config "$TMP/job.json" --coordinator "$COORD" > "$TMP/train.log" 2>&1; then
  cat "$TMP/train.log" "$TMP"/*.log
  echo "FAIL: training across namespaces failed"
  exit 1
fi
cat "$TMP/train.log"
"$BIN/meshrun" status --coordinator "$COORD" > "$TMP/status.log"
cat "$TMP/status.log"
for i in $(seq 1 "$N"); do
  grep -q "$NET.$((10 + i)):" "$TMP/status.log" || { echo "FAIL: no worker at $NET.$((10 + i))"; exit 1; }
done
loss=$(grep "^step 100/100" "$TMP/train.log" | sed 's/.*loss \([0-9.]*\).*/\1/')
acc=$(grep "test accuracy" "$TMP/train.log" | sed 's/test accuracy \([0-9.]*\).*/\1/')
awk -v l="$loss" -v a="$acc" 'BEGIN { exit !(l < 0.8 && a > 0.7) }' ||
  { echo "FAIL: loss $loss / test accuracy $acc out of range"; exit 1; }
"$BIN/meshrun" shutdown --coordinator "$COORD"
for p in "${PIDS[@]}"; do
  for _ in $(seq 1 50); do kill -0 "$p" 2> /dev/null || break; sleep 0.1; done
  kill -0 "$p" 2> /dev/null && { echo "FAIL: pid $p still running after shutdown"; exit 1; }
done
PIDS=()
echo "PASS: $N workers in separate network namespaces trained across the bridge (loss $loss, test accuracy $acc)"
