#!/usr/bin/env bash
# The test command: installs what is missing (Debian packages), builds meshrun (Release) and runs
# every test with CTest. .ci/run calls exactly this. Usage: bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$(nproc)"
ctest --test-dir build --output-on-failure --timeout 600 -j 2
