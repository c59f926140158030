#!/usr/bin/env bash
# End-to-end test of the docker compose bring-up (docker-compose.yml, deploy/Dockerfile):
# builds the images (the base image with deploy/build-base-image.sh where it cannot be pulled),
# `docker-compose up -d`, waits until the coordinator, the 8 workers and Prometheus are healthy,
# trains 50 steps of the main job from the host with `meshrun train --coordinator localhost:PORT`,
# checks the loss fell, asks Prometheus inside the compose network for the step counter and for
# all 9 meshrun targets up, runs a job through two losses of worker3 (a crash its restart policy
# restarts, then `docker-compose kill` and `start`), then `docker-compose down -v`.
#
# Usage: compose_test.sh BIN_DIR    (BIN_DIR holds the host's `meshrun` CLI)
# Exit 77 (CTest: skipped) only when this machine has no Docker engine or no docker-compose.
set -euo pipefail

bin="$(cd "$1" && pwd)"
cd "$(dirname "$0")/../.."

if ! command -v docker-compose >/dev/null || ! docker info >/dev/null 2>&1; then
  echo "SKIP: no Docker engine or no docker-compose on this machine"
  exit 77
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export COMPOSE_PROJECT_NAME="meshrun-e2e-$$"
export MESHRUN_COORDINATOR_PORT="$(free_port)"
export MESHRUN_PROMETHEUS_PORT="$(free_port)"
work="$(mktemp -d)"
compose() { docker-compose --ansi never "$@"; }

cleanup() {
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "--- docker-compose ps"; compose ps || true
    echo "--- logs (last 30 lines per service)"; compose logs --no-color --tail=30 || true
  fi
  compose down -v --remove-orphans >/dev/null 2>&1 || true
  rm -rf "$work"
  exit $rc
}
trap cleanup EXIT
# A command that fails outside an explicit check (set -e) names itself before the cleanup runs.
trap 'echo "FAIL: line $LINENO: \`$BASH_COMMAND\` exited with status $?"' ERR

step() { echo "[$(date +%T)] $*"; }

step "base image"
bash deploy/build-base-image.sh
step "docker-compose build"
compose build >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }
step "docker-compose up -d (project $COMPOSE_PROJECT_NAME, coordinator port $MESHRUN_COORDINATOR_PORT)"
compose up -d

step "waiting for every service to be healthy"
deadline=$((SECONDS + 180))
while :; do
  ids=$(for s in coordinator worker{0..7} prometheus; do compose ps -q "$s"; done)
  n=$(echo "$ids" | grep -c . || true)
  healthy=$(docker inspect -f '{{.State.Health.Status}}' $ids | grep -c '^healthy$' || true)
  [ "$n" -eq 10 ] && [ "$healthy" -eq 10 ] && break
  if [ $SECONDS -ge $deadline ]; then
    echo "FAIL: $healthy of $n services healthy after 180 s (expected 10 of 10)"
    docker inspect -f '{{.Name}} {{.State.Status}} {{.State.Health.Status}}' $ids
    exit 1
  fi
  sleep 2
done
step "10 of 10 services healthy"
# TLS is on: the host's client takes the cluster's credentials from the volume.
docker cp "$(compose ps -q coordinator)":/var/lib/meshrun/tls "$work/tls"
export MESHRUN_TLS_DIR="$work/tls"
"$bin/meshrun" status --coordinator "127.0.0.1:$MESHRUN_COORDINATOR_PORT"

cat >"$work/job.json" <<JOB
{
  "mesh": {"data": 8},
  "model": {"name": "dp_classifier", "hidden_size": 512, "num_classes": 10, "dropout_rate": 0.1},
  "optimizer": {"name": "adamw", "learning_rate": 0.001, "num_minibatches": 4},
  "data": {"dataset": "fashion_mnist", "path": "/usr/share/datasets/fashion-mnist", "batch_size": 128},
  "train": {"max_steps": 50, "seed": 42, "log_every": 10, "evaluate": false}
}
JOB
step "meshrun train: 50 steps through the published coordinator port"
rc=0
"$bin/meshrun" train --config "$work/job.json" --coordinator "localhost:$MESHRUN_COORDINATOR_PORT" \
  > "$work/train.log" 2>&1 || rc=$?
cat "$work/train.log"
if [ "$rc" -ne 0 ]; then
  echo "FAIL: meshrun train exited with status $rc$([ "$rc" -gt 128 ] && echo " (signal $((rc - 128)))")"
  exit 1
fi
losses=$(grep -o 'loss [0-9.]*' "$work/train.log" | awk '{print $2}')
first=${losses%%$'\n'*}  # (expansions, not `echo | head`: no pipe for SIGPIPE to break under pipefail)
last=${losses##*$'\n'}
steps=$(grep -c '^step ' "$work/train.log" || true)
echo "loss at the first progress line $first, at the last $last ($steps progress lines)"
[ "$steps" -ge 2 ] || { echo "FAIL: expected progress lines every 10 steps"; exit 1; }
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' || { echo "FAIL: the loss did not fall ($first -> $last)"; exit 1; }

# Prometheus scrapes every 5 s: wait for the coordinator's final counter value.
query() { compose exec -T prometheus promtool query instant http://prometheus:9090 "$1" | sed -n 's/.*=> \([^ ]*\) @.*/\1/p'; }
step "Prometheus, queried inside the compose network"
deadline=$((SECONDS + 60))
while :; do
  steps_total=$(query 'sum(meshrun_train_steps_total{job="meshrun-coordinator"})' || true)
  [ "$steps_total" = "50" ] && break
  if [ $SECONDS -ge $deadline ]; then echo "FAIL: meshrun_train_steps_total = '$steps_total', expected 50"; exit 1; fi
  sleep 2
done
up=$(query 'count(up{job=~"meshrun-.*"} == 1)')
echo "meshrun_train_steps_total = $steps_total; targets up = $up"
[ "$up" = "9" ] || { echo "FAIL: $up meshrun targets up, expected 9 (coordinator + 8 workers)"; exit 1; }

# Recovery (JobSpec.recovery) inside compose, with the state healed from the workers' memory (no
# checkpoint on disk). First worker3's process crashes (kill -9 from the host: its container's
# restart policy restarts it); then `docker-compose kill worker3`, which Docker counts as a manual
# stop (no restart policy applies after `docker kill`), so an operator starts it again.
cat >"$work/recover.json" <<JOB
{
  "mesh": {"data": 8},
  "model": {"name": "dp_classifier", "hidden_size": 512, "num_classes": 10, "dropout_rate": 0.1},
  "optimizer": {"name": "adamw", "learning_rate": 0.001, "num_minibatches": 4},
  "data": {"dataset": "fashion_mnist", "path": "/usr/share/datasets/fashion-mnist", "batch_size": 128},
  "train": {"max_steps": 1500, "seed": 42, "log_every": 10, "evaluate": false},
  "recovery": {"max_restarts": 2, "timeout_seconds": 120, "peer_state_every": 20}
}
JOB
wait_for() {  # PATTERN N: waits up to 180 s until N lines of the train log match PATTERN
  local deadline=$((SECONDS + 180))
  until [ "$(grep -cE "$1" "$work/recover.log" || true)" -ge "$2" ]; do
    if [ $SECONDS -ge $deadline ] || ! kill -0 "$train_pid" 2>/dev/null; then
      cat "$work/recover.log"; echo "FAIL: fewer than $2 lines matching '$1' in the train log"; exit 1
    fi
    sleep 0.2
  done
}
progress='^step [0-9]+/'
step "recovery: kill -9 of worker3's process, then docker-compose kill worker3, during a job"
restarts_before=$(docker inspect -f '{{.RestartCount}}' "$(compose ps -q worker3)")
"$bin/meshrun" train --config "$work/recover.json" --coordinator "localhost:$MESHRUN_COORDINATOR_PORT" \
  > "$work/recover.log" 2>&1 &
train_pid=$!
wait_for "$progress" 5  # step 50: the workers hold copies of step 40
kill -9 "$(docker inspect -f '{{.State.Pid}}' "$(compose ps -q worker3)")"
wait_for 'recovered at step' 1
# (A manual start resets Docker's RestartCount: read it now.)
restarts=$(( $(docker inspect -f '{{.RestartCount}}' "$(compose ps -q worker3)") - restarts_before ))
n=$(grep -cE "$progress" "$work/recover.log" || true)
wait_for "$progress" $((n + 3))
compose kill worker3
wait_for 'worker rank 3 .* lost after step' 2
sleep 2
compose start worker3
rc=0
wait "$train_pid" || rc=$?
cat "$work/recover.log"
[ "$rc" -eq 0 ] || { echo "FAIL: the job did not survive the two losses (exit $rc)"; exit 1; }
lost=$(grep -c 'worker rank 3 .* lost after step' "$work/recover.log" || true)
healed=$(grep -c "recovered at step [0-9]* from the peers' memory" "$work/recover.log" || true)
echo "worker3 lost $lost times, healed from peers' memory $healed times, restarted by its policy $restarts times"
[ "$lost" -eq 2 ] && [ "$healed" -eq 2 ] || { echo "FAIL: expected 2 losses of rank 3, each healed from the peers' memory"; exit 1; }
[ "$restarts" -ge 1 ] || { echo "FAIL: the restart policy did not restart worker3 after its crash"; exit 1; }
grep -q '^step 1500/1500' "$work/recover.log" || { echo "FAIL: the job did not reach step 1500"; exit 1; }

step "docker-compose down -v"
compose down -v --remove-orphans
left=$(docker volume ls -q --filter "name=${COMPOSE_PROJECT_NAME}_" | wc -l)
[ "$left" -eq 0 ] || { echo "FAIL: $left volumes left after down -v"; exit 1; }
echo "PASS"
