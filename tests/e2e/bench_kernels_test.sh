#!/usr/bin/env bash
# `meshrun bench kernels` end to end, kept short: seed 003's DotReluDot on one worker in f32. The
# worker (started with --kernel_shape_labels) times each of the step's 4 GEMM signatures over
# whole steps, and each gets a row with positive GFLOP/s beside its standalone figures, then the
# step's total row.
# Usage: bench_kernels_test.sh BIN_DIR
set -u
bin=$1
out=$(timeout 280 "$bin/meshrun" bench kernels --workloads dot_relu_dot --precisions f32 --steps 3 \
  --min-seconds 0.001 2>&1)
rc=$?
echo "$out"
if [ "$rc" -ne 0 ]; then
  echo "FAIL: meshrun bench kernels exited $rc"
  exit 1
fi
rows=$(grep -c '^dot_relu_dot  *single  *f32 ' <<<"$out")
if [ "$rows" -ne 5 ]; then
  echo "FAIL: expected 4 GEMM rows and a total for dot_relu_dot; got $rows"
  exit 1
fi
# Every GEMM row: runs per step >= 1 and four positive GFLOP/s figures (worker, hot, L2-cold, cold).
bad=$(grep '^dot_relu_dot  *single  *f32 .*\]' <<<"$out" |
  awk '{n = NF; if ($(n-7) < 1 || $(n-6) <= 0 || $(n-5) <= 0 || $(n-4) <= 0 || $(n-3) <= 0) print}')
if [ -n "$bad" ]; then
  echo "FAIL: rows without runs or with non-positive GFLOP/s: $bad"
  exit 1
fi
if ! grep -q 'every GEMM of one step' <<<"$out"; then
  echo "FAIL: no total row"
  exit 1
fi
echo "PASS"
