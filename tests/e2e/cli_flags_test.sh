#!/usr/bin/env bash
# Out-of-range flags are refused before anything starts, with the flag and its range named, by the
# meshrun CLI (CLI11 validators) and by the coordinator and worker binaries (core/config/flag_checks.h).
# Usage: cli_flags_test.sh BIN_DIR
set -u
bin=$1
fail=0
expect_refused() {  # expect_refused SUBSTRING COMMAND...
  local want=$1
  shift
  local out
  out=$(timeout 20 "$@" 2>&1)
  local rc=$?
  if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || ! grep -qF -- "$want" <<<"$out"; then
    echo "FAIL: '$*' exited $rc; expected a refusal saying '$want'; got: $out"
    fail=1
  else
    echo "ok: $* -> $(head -1 <<<"$out")"
  fi
}
expect_refused "--port: Value 70000 not in range 0 to 65535" "$bin/meshrun" up --port 70000
expect_refused "--steps: Value -5 not in range 0" "$bin/meshrun" train --workload mlp --steps -5
expect_refused "--steps-per-call: Value 0 not in range 1" "$bin/meshrun" train --workload mlp --steps-per-call 0
expect_refused "--keep: Value -1 not in range 0" "$bin/meshrun" train --workload mlp --keep -1
expect_refused "--precision: fp16 not in {f32,bf16}" "$bin/meshrun" train --workload mlp --precision fp16
expect_refused "--precision: fp16 not in {f32,bf16}" "$bin/meshrun" bench step --precision fp16
expect_refused "--minibatches: 3 not in {1,2,4,8}" "$bin/meshrun" bench train --minibatches 3
expect_refused "--reduce-precision: f16 not in {f32,bf16}" "$bin/meshrun" bench train --reduce-precision f16
expect_refused "--precisions: 'fp8'; expected f32 or bf16" "$bin/meshrun" bench kernels --precisions f32,fp8
expect_refused "--port 70000 is out of range; expected 0..65535" "$bin/meshrun-coordinator" --port 70000
expect_refused "--heartbeat_timeout -1s must be positive" "$bin/meshrun-coordinator" --heartbeat_timeout=-1s
expect_refused "--compute_threads -3 is out of range" "$bin/meshrun-worker" --compute_threads=-3
expect_refused "--memory_budget_bytes -1 is out of range" "$bin/meshrun-worker" --memory_budget_bytes=-1
expect_refused "--one_shot_max_bytes -1 is out of range" "$bin/meshrun-worker" --one_shot_max_bytes=-1
expect_refused "--ring_chunk_bytes 4 is out of range; expected 8..1073741824" "$bin/meshrun-worker" --ring_chunk_bytes=4
expect_refused "--shm_receive_spin 2s is out of range; expected 0..1s" "$bin/meshrun-worker" --shm_receive_spin=2s
expect_refused "--grpc_stripes 17 is out of range; expected 1..16" "$bin/meshrun-worker" --grpc_stripes=17
expect_refused "--grpc_stripe_bytes 4 is out of range" "$bin/meshrun-worker" --grpc_stripe_bytes=4
expect_refused "--grpc-stripes: Value 0 not in range" "$bin/meshrun" bench allreduce --grpc-stripes 0
# A worker process per device: a mesh past 4096 devices is refused before any process is forked.
expect_refused "mesh data=99999 has more than 4096 devices" "$bin/meshrun" up --mesh data=99999 --insecure
expect_refused "mesh data=99999 has more than 4096 devices" "$bin/meshrun-coordinator" --mesh=data=99999 --insecure
expect_refused "--workers: '9999': expected integers in [1, 4096]" "$bin/meshrun" bench allreduce --workers 2,9999
expect_refused "coordinator address '127.0.0.1:99999': port 99999 is out of range" "$bin/meshrun" status --coordinator 127.0.0.1:99999
exit $fail
