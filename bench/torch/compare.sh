#!/usr/bin/env bash
# One meshrun worker beside PyTorch in one process on the main job's model, in one run on this
# machine (issue 22's peer): `meshrun bench train --workers 1` against bench/torch/main_job_torch.py,
# f32 and mixed precision (meshrun's precision.compute bf16 against torch.autocast bf16), for the
# main job's 4 minibatches of 32 and for the batch of 128 in one piece, each pair run back to back
# `rounds` times. TLS off (--insecure): one worker sends nothing over the network.
#
# Usage: bench/torch/compare.sh [BUILD_DIR] [STEPS] [ROUNDS]
#   e.g. bench/torch/compare.sh build 600 2
# Needs torch in $TORCH_PYTHON (default: python3), e.g. a venv with `pip install torch numpy`;
# meshrun itself does not depend on it.
set -euo pipefail
build=${1:-build}
steps=${2:-600}
rounds=${3:-2}
py=${TORCH_PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
"$py" -c "import torch" 2> /dev/null || {
  echo "compare.sh: $py cannot import torch (set TORCH_PYTHON to a Python that has it)" >&2
  exit 2
}
for mb in 4 1; do
  for precision in f32 bf16; do
    autocast=()
    [ "$precision" = bf16 ] && autocast=(--bf16)
    for ((r = 1; r <= rounds; r++)); do
      echo "== $precision, $mb minibatch(es), round $r"
      "$build/bin/meshrun" bench train --workers 1 --steps "$steps" --insecure \
        --precision "$precision" --minibatches "$mb" | tail -n 1 | awk '{print "meshrun 1 worker: " $3 " samples/s"}'
      "$py" "$here/main_job_torch.py" --steps "$steps" --minibatches "$mb" "${autocast[@]}"
      "$py" "$here/main_job_torch.py" --steps "$steps" --minibatches "$mb" --flush-denormal "${autocast[@]}"
    done
  done
done
