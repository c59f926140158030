#!/usr/bin/env bash
# Builds meshrun (Release) and runs every test with CTest. Usage: scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$(nproc)"
ctest --test-dir build --output-on-failure --timeout 600 -j 2
