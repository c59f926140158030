#!/usr/bin/env bash
# `meshrun train --workload` with checkpoints, from the command line, against real clusters:
#  1. a run stopped at step 6 (saving every 3, keeping 1) and resumed to step 10 prints the same
#     losses, bit for bit (%.9g), as an uninterrupted 10-step run, as does a run of 4 steps per
#     call (--steps-per-call) that still saves every 3 steps;
#  2. `meshrun ckpt validate` accepts the checkpoint for another layout and rejects a mesh the
#     shapes do not divide over;
#  3. weights move between meshrun and Python: a safetensors file written by Python's safetensors
#     (numpy) starts a job (--init-from), `meshrun export` writes the checkpoint's parameters and
#     Python reads them back equal to what it wrote (0 steps: the parameters as initialised);
#  4. the main job (`meshrun train --config`) with the checkpoint policy in its config: stopped at
#     step 6 and resumed (--resume) to 10 prints the losses of an uninterrupted run; `meshrun ckpt
#     validate CKPT --config JOB` and `meshrun plan JOB`; Python's zero parameters as init_from
#     give a first loss of ln(10); `meshrun export` gives Python params/input_dense/kernel.
#  5. a derived train step from a job config resumes bit for bit;
#  6. `meshrun train --workload --coordinator` plans for the running cluster's mesh.
# Usage: ckpt_cli_test.sh BIN_DIR WORK_DIR   (a Python venv with safetensors + numpy is made there)
set -euo pipefail
bin="$(cd "$1" && pwd)"
work="$(cd "$2" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
run() { "$bin/meshrun" train --workload dot_relu_dot --layout 2d --mesh data=2,model=4 --log-dir "$tmp/logs" "$@"; }

run --steps 10 | grep '^step' > "$tmp/straight.txt"
run --steps 6 --ckpt-dir "$tmp/ckpt" --save-every 3 --keep 1 | grep '^step' > "$tmp/first.txt"
ls "$tmp/ckpt"
[ "$(ls "$tmp/ckpt")" = "step_00000006" ] || { echo "FAIL: expected only step_00000006 (keep 1)"; exit 1; }
run --steps 10 --ckpt-dir "$tmp/ckpt" --resume | grep '^step' > "$tmp/second.txt"
cat "$tmp/first.txt" "$tmp/second.txt" > "$tmp/resumed.txt"
if ! diff "$tmp/straight.txt" "$tmp/resumed.txt"; then echo "FAIL: resumed losses differ"; exit 1; fi
echo "resume: 10 losses identical"
# Four steps per call (steps_per_execution), saving every 3: calls stop at each save; same losses.
run --steps 10 --steps-per-call 4 --ckpt-dir "$tmp/ckpt4" --save-every 3 | tee "$tmp/per4_full.txt" \
  | grep '^step' > "$tmp/per4.txt"
if ! diff "$tmp/straight.txt" "$tmp/per4.txt"; then echo "FAIL: --steps-per-call 4 losses differ"; exit 1; fi
[ "$(ls "$tmp/ckpt4" | tr '\n' ' ')" = "step_00000003 step_00000006 step_00000009 step_00000010 " ] \
  || { ls "$tmp/ckpt4"; echo "FAIL: --steps-per-call skipped a save"; exit 1; }
echo "steps per call: 10 losses identical, every save taken"

"$bin/meshrun" ckpt validate "$tmp/ckpt/step_00000010" --workload dot_relu_dot --layout fsdp --mesh data=8
if "$bin/meshrun" ckpt validate "$tmp/ckpt/step_00000010" --workload dot_relu_dot --layout fsdp --mesh data=3 \
    > "$tmp/bad.txt" 2>&1; then
  echo "FAIL: validate accepted a 3-way data axis"; exit 1
fi
grep -q "not divisible" "$tmp/bad.txt" || { cat "$tmp/bad.txt"; echo "FAIL: no reason given"; exit 1; }
# A flipped byte and a truncated shard: validate reads every block and names the damage.
for damage in flip truncate; do
  rm -rf "$tmp/damaged" && cp -r "$tmp/ckpt/step_00000010" "$tmp/damaged"
  shard=$(ls "$tmp/damaged"/shard-*.safetensors | head -1)
  if [ "$damage" = flip ]; then
    size=$(stat -c %s "$shard")
    byte=$(od -An -tu1 -j $((size - 100)) -N1 "$shard" | tr -d ' ')
    printf "$(printf '\\%03o' $(( (byte + 1) % 256 )))" | dd of="$shard" bs=1 seek=$((size - 100)) conv=notrunc 2>/dev/null
    want="does not match its checksum"
  else
    truncate -s -4096 "$shard"
    want="is truncated"
  fi
  if "$bin/meshrun" ckpt validate "$tmp/damaged" --workload dot_relu_dot --layout fsdp --mesh data=8 \
      > "$tmp/damaged.txt" 2>&1; then
    cat "$tmp/damaged.txt"; echo "FAIL: validate accepted a checkpoint with a $damage"; exit 1
  fi
  grep -q "$want" "$tmp/damaged.txt" || { cat "$tmp/damaged.txt"; echo "FAIL: $damage not named"; exit 1; }
  # By itself (no job or workload, as for the Python SDK's checkpoints): the same damage found.
  if "$bin/meshrun" ckpt validate "$tmp/damaged" > "$tmp/damaged.txt" 2>&1; then
    cat "$tmp/damaged.txt"; echo "FAIL: validate alone accepted a checkpoint with a $damage"; exit 1
  fi
  grep -q "$want" "$tmp/damaged.txt" || { cat "$tmp/damaged.txt"; echo "FAIL: $damage not named alone"; exit 1; }
done
"$bin/meshrun" ckpt validate "$tmp/ckpt/step_00000010" | grep -q "OK: every block is sound" \
  || { echo "FAIL: validate alone refused a sound checkpoint"; exit 1; }
"$bin/meshrun" ckpt validate "$tmp/ckpt/step_00000010" --mesh data=4,model=2 | grep -q "OK: restorable as saved on data=4,model=2" \
  || { echo "FAIL: validate alone with --mesh refused a sound checkpoint"; exit 1; }
echo "validate: a flipped byte and a truncated shard are found, with and without a workload"

# A full disk: a 40 MB tmpfs holds one checkpoint of this state (25 MB), not two. The second
# save fails with a clear error, and the first stays committed and valid.
if mkdir -p "$tmp/small" && mount -t tmpfs -o size=40m tmpfs "$tmp/small" 2>/dev/null; then
  trap 'umount "$tmp/small" 2>/dev/null || true; rm -rf "$tmp"' EXIT
  if "$bin/meshrun" train --workload dot_relu_dot --layout dp --mesh data=2 --steps 2 --save-every 1 \
      --ckpt-dir "$tmp/small" --log-dir "$tmp/logs" > "$tmp/full.txt" 2>&1; then
    cat "$tmp/full.txt"; echo "FAIL: a save onto a full disk succeeded"; exit 1
  fi
  grep -q "No space left" "$tmp/full.txt" || { cat "$tmp/full.txt"; echo "FAIL: no disk-full error"; exit 1; }
  [ "$(ls "$tmp/small")" = "step_00000001" ] || { ls -la "$tmp/small"; echo "FAIL: leftovers on the full disk"; exit 1; }
  "$bin/meshrun" ckpt validate "$tmp/small/step_00000001" --workload dot_relu_dot --layout dp --mesh data=2
  "$bin/meshrun" export "$tmp/small/step_00000001" "$tmp/small-export.safetensors"
  umount "$tmp/small"
  echo "full disk: save failed cleanly, the previous checkpoint is intact"
else
  echo "full disk: skipped (cannot mount a tmpfs here)"
fi

venv="$work/safetensors-venv"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import safetensors, numpy' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q safetensors==0.4.5 numpy==1.26.4
fi
"$venv/bin/python" - "$tmp/in.safetensors" <<'PY'
import sys, numpy as np
from safetensors.numpy import save_file
rng = np.random.default_rng(0)
save_file({"params/dot1/kernel": rng.standard_normal((1024, 1024), dtype=np.float32),
           "params/w2": rng.standard_normal((1024, 1024), dtype=np.float32)}, sys.argv[1])
PY
run --steps 0 --init-from "$tmp/in.safetensors" --ckpt-dir "$tmp/from_py" > /dev/null
"$bin/meshrun" export "$tmp/from_py/step_00000000" "$tmp/out.safetensors"
"$venv/bin/python" - "$tmp/in.safetensors" "$tmp/out.safetensors" <<'PY'
import sys, numpy as np
from safetensors.numpy import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
assert sorted(a) == sorted(b), (sorted(a), sorted(b))
for k in a:
    assert a[k].shape == b[k].shape and np.array_equal(a[k], b[k]), k
print("interop: %d arrays round-tripped through meshrun exactly" % len(a))
PY

# 4. The main job, its checkpoint policy in the config (a relative dir, made absolute by the CLI).
cd "$tmp"
job() { # job FILE MAX_STEPS EXTRA_CHECKPOINT_KEYS
  cat > "$1" <<JSON
{"mesh": {"data": 2}, "train": {"max_steps": $2, "log_every": 1, "evaluate": false},
 "checkpoint": {"dir": "job_ckpt", "save_every": 3, "keep": 2$3}}
JSON
}
losses() { sed -nE 's/^step ([0-9]+)\/[0-9]+ .*loss ([0-9.]+).*/\1 \2/p'; }
main() { "$bin/meshrun" train --log-dir "$tmp/logs" --config "$@"; }
job straight.json 10 ""
main straight.json --ckpt-dir straight_ckpt | losses > main_straight.txt
job first.json 6 ', "async": true'
main first.json | losses > main_first.txt
[ "$(ls job_ckpt)" = "$(printf 'step_00000003\nstep_00000006')" ] || { ls job_ckpt; echo "FAIL: keep 2"; exit 1; }
job second.json 10 ""
main second.json --resume | tee main_second_full.txt | losses > main_second.txt
grep -q "resumed from $tmp/job_ckpt/step_00000006 at step 6" main_second_full.txt \
  || { cat main_second_full.txt; echo "FAIL: not resumed"; exit 1; }
cat main_first.txt main_second.txt > main_resumed.txt
[ "$(wc -l < main_straight.txt)" = 10 ] || { cat main_straight.txt; echo "FAIL: expected 10 losses"; exit 1; }
if ! diff main_straight.txt main_resumed.txt; then echo "FAIL: the main job's resumed losses differ"; exit 1; fi
echo "main job resume: 10 losses identical"
"$bin/meshrun" ckpt validate job_ckpt/step_00000010 --config second.json
"$bin/meshrun" ckpt validate job_ckpt/step_00000010 --config second.json --mesh data=8 | grep -q "OK: restorable"
echo '{"model": {"hidden_size": 256}}' > narrow.json
if "$bin/meshrun" ckpt validate job_ckpt/step_00000010 --config narrow.json > narrow.txt 2>&1; then
  echo "FAIL: validate accepted a checkpoint of another hidden size"; exit 1
fi
grep -q "params/input_dense/kernel" narrow.txt || { cat narrow.txt; echo "FAIL: array not named"; exit 1; }
"$bin/meshrun" plan second.json | tee plan.txt
grep -q "pmean *over (data)" plan.txt && grep -q "opt_state/nu/params/input_dense/kernel" plan.txt \
  || { echo "FAIL: plan lacks the state or the collectives"; exit 1; }
"$venv/bin/python" - zeros.safetensors <<'PY'
import sys, numpy as np
from safetensors.numpy import save_file
save_file({"params/input_dense/kernel": np.zeros((784, 512), np.float32),
           "params/input_dense/bias": np.zeros((512,), np.float32),
           "params/output_dense/kernel": np.zeros((512, 10), np.float32),
           "params/output_dense/bias": np.zeros((10,), np.float32)}, sys.argv[1])
PY
cat > zeros.json <<JSON
{"mesh": {"data": 2}, "train": {"max_steps": 1, "log_every": 1, "evaluate": false},
 "checkpoint": {"init_from": "zeros.safetensors"}}
JSON
[ "$(main zeros.json | losses)" = "1 2.3026" ] || { echo "FAIL: zero params do not give ln(10)"; exit 1; }
# The non-finite guard: NaN parameters from init_from stop the job at step 1, naming the loss,
# and no checkpoint is committed (the main job and a derived step).
"$venv/bin/python" - zeros.safetensors nan.safetensors <<'PY'
import sys, numpy as np
from safetensors.numpy import load_file, save_file
t = load_file(sys.argv[1])
t["params/output_dense/bias"][3] = np.nan
save_file(t, sys.argv[2])
PY
cat > nan.json <<JSON
{"mesh": {"data": 2}, "train": {"max_steps": 4, "log_every": 2, "evaluate": false},
 "checkpoint": {"init_from": "nan.safetensors", "dir": "nan_ckpt", "save_every": 1}}
JSON
if main nan.json > nan.txt 2>&1; then cat nan.txt; echo "FAIL: a NaN loss trained on"; exit 1; fi
grep -q "non-finite loss nan at step 1" nan.txt || { cat nan.txt; echo "FAIL: step not named"; exit 1; }
[ -z "$(ls nan_ckpt 2>/dev/null)" ] || { ls nan_ckpt; echo "FAIL: a non-finite checkpoint"; exit 1; }
"$venv/bin/python" - "$tmp/in.safetensors" "$tmp/nan_in.safetensors" <<'PY'
import sys, numpy as np
from safetensors.numpy import load_file, save_file
t = load_file(sys.argv[1])
t["params/w2"][0, 0] = np.inf
save_file(t, sys.argv[2])
PY
if run --steps 3 --init-from "$tmp/nan_in.safetensors" --ckpt-dir "$tmp/nan_wl" --save-every 1 > nan_wl.txt 2>&1; then
  cat nan_wl.txt; echo "FAIL: a derived step trained on a non-finite loss"; exit 1
fi
grep -q "non-finite loss .* at step 1" nan_wl.txt || { cat nan_wl.txt; echo "FAIL: step not named"; exit 1; }
[ -z "$(ls "$tmp/nan_wl" 2>/dev/null)" ] || { ls "$tmp/nan_wl"; echo "FAIL: a non-finite checkpoint"; exit 1; }
echo "non-finite guard: stopped at step 1, nothing committed"
"$bin/meshrun" export job_ckpt/step_00000010 main.safetensors
"$venv/bin/python" - main.safetensors <<'PY'
import sys
from safetensors.numpy import load_file
t = load_file(sys.argv[1])
assert sorted(t) == ["params/input_dense/bias", "params/input_dense/kernel",
                     "params/output_dense/bias", "params/output_dense/kernel"], sorted(t)
assert t["params/input_dense/kernel"].shape == (784, 512)
print("main job: init_from a Python file and export to Python")
PY

# 5. A derived train step from a job config: the model and its logical axis rules, the mesh, the
# steps and the checkpoint policy all in the config; resumed losses equal an uninterrupted run's.
derived() { # derived FILE MAX_STEPS
  cat > "$1" <<JSON
{"mesh": {"data": 2, "model": 4}, "model": {"name": "dot_relu_dot"},
 "sharding": {"rules": [["batch", "data"], ["hidden", "model"]], "fsdp_axis": "data"},
 "train": {"max_steps": $2, "log_every": 1}, "checkpoint": {"dir": "derived_ckpt", "save_every": 3}}
JSON
}
derived d_straight.json 8
main d_straight.json --ckpt-dir d_straight_ckpt | losses > d_straight.txt
derived d_first.json 5
main d_first.json | losses > d_first.txt
derived d_second.json 8
main d_second.json --resume | losses > d_second.txt
cat d_first.txt d_second.txt > d_resumed.txt
[ "$(wc -l < d_straight.txt)" = 8 ] || { cat d_straight.txt; echo "FAIL: expected 8 losses"; exit 1; }
if ! diff d_straight.txt d_resumed.txt; then echo "FAIL: the derived job's resumed losses differ"; exit 1; fi
"$bin/meshrun" plan d_second.json | tee d_plan.txt
grep -q "psum_scatter over (data)" d_plan.txt && grep -q "PartitionSpec('data', 'model')" d_plan.txt \
  || { echo "FAIL: the derived job's plan lacks FSDP"; exit 1; }
"$bin/meshrun" ckpt validate derived_ckpt/step_00000008 --config d_second.json | grep -q "OK: restorable"
echo "derived job from a config: 8 losses identical after resume"

# 6. `meshrun train --workload --coordinator` plans for the running cluster's mesh (here 1x8, not
# the embedded cluster's default 2x4), and refuses a --mesh that is not the cluster's.
"$bin/meshrun" up --mesh data=1,model=8 --port 0 --log-dir "$tmp/up" > up.txt 2>&1 &
up_pid=$!
for _ in $(seq 300); do grep -q "cluster up" up.txt && break; sleep 0.2; done
coord="$(sed -nE 's/^meshrun cluster up: coordinator ([0-9.:]+),.*/\1/p' up.txt)"
[ -n "$coord" ] || { cat up.txt; kill $up_pid; echo "FAIL: meshrun up did not come up"; exit 1; }
"$bin/meshrun" train --coordinator "$coord" --workload dot_relu_dot --layout tp --steps 2 > up_train.txt 2>&1 \
  || { cat up_train.txt; kill $up_pid; echo "FAIL: train on a running 1x8 cluster"; exit 1; }
grep -q '^step 2 loss' up_train.txt || { cat up_train.txt; kill $up_pid; echo "FAIL: no losses"; exit 1; }
if "$bin/meshrun" train --coordinator "$coord" --workload dot_relu_dot --layout tp --mesh data=2,model=4 \
    --steps 1 > up_bad.txt 2>&1; then
  kill $up_pid; echo "FAIL: a --mesh other than the cluster's was accepted"; exit 1
fi
grep -q "is not the mesh of the cluster at $coord (data=1,model=8)" up_bad.txt \
  || { cat up_bad.txt; kill $up_pid; echo "FAIL: the mesh mismatch is not named"; exit 1; }
"$bin/meshrun" shutdown --coordinator "$coord" > /dev/null
wait $up_pid
echo "train --coordinator: planned for the running cluster's mesh"
echo PASS
