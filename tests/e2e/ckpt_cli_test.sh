#!/usr/bin/env bash
# `meshrun train --workload` with checkpoints, from the command line, against real clusters:
#  1. a run stopped at step 6 (saving every 3, keeping 1) and resumed to step 10 prints the same
#     losses, bit for bit (%.9g), as an uninterrupted 10-step run;
#  2. `meshrun ckpt validate` accepts the checkpoint for another layout and rejects a mesh the
#     shapes do not divide over;
#  3. weights move between meshrun and Python: a safetensors file written by Python's safetensors
#     (numpy) starts a job (--init-from), `meshrun export` writes the checkpoint's parameters and
#     Python reads them back equal to what it wrote (0 steps: the parameters as initialised).
# Usage: ckpt_cli_test.sh BIN_DIR WORK_DIR   (a Python venv with safetensors + numpy is made there)
set -euo pipefail
bin="$1"
work="$2"
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

"$bin/meshrun" ckpt validate "$tmp/ckpt/step_00000010" --workload dot_relu_dot --layout fsdp --mesh data=8
if "$bin/meshrun" ckpt validate "$tmp/ckpt/step_00000010" --workload dot_relu_dot --layout fsdp --mesh data=3 \
    > "$tmp/bad.txt" 2>&1; then
  echo "FAIL: validate accepted a 3-way data axis"; exit 1
fi
grep -q "not divisible" "$tmp/bad.txt" || { cat "$tmp/bad.txt"; echo "FAIL: no reason given"; exit 1; }

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
echo PASS
