#!/usr/bin/env bash
# The test command: installs what is missing (Debian packages), builds meshrun (Release) and runs
# every test with CTest, then the Python SDK's pytest suite. .ci/run calls exactly this.
# Usage: bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$(nproc)"
# The fuzz targets (tests/fuzz): clang with libFuzzer, ASan and UBSan, in a tree of their own;
# each runs 2M inputs (MESHRUN_FUZZ_RUNS) with a fixed seed from its seed corpus.
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMESHRUN_FUZZ=ON \
  -DMESHRUN_WERROR=OFF -DMESHRUN_FUZZ_RUNS="${MESHRUN_FUZZ_RUNS:-2000000}" > /dev/null
cmake --build build-fuzz -j "$(nproc)" --target worker_fuzz coordinator_fuzz ring_fuzz
ctest --test-dir build-fuzz --output-on-failure -R _fuzz -j 2
bash scripts/python-env.sh build
# The Python SDK's pytest suite (CTest's e2e_python_sdk) runs after the rest, on its own.
ctest --test-dir build --output-on-failure --timeout 600 -j 2 -E '^e2e_python_sdk$'
bash scripts/python-sdk-test.sh build
