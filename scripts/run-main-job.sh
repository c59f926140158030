#!/usr/bin/env bash
# Sets up and runs the main job: installs dependencies, builds, brings up a local cluster
# (1 coordinator + 8 worker processes on loopback, mesh ('data': 8)) and trains the seed's
# DPClassifier on Fashion-MNIST, then evaluates on the test set.
# Usage: bash scripts/run-main-job.sh [CONFIG]   (default examples/main_job.json, 1 epoch;
#        examples/main_job_5_epochs.json for 5)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build -j "$(nproc)"
exec build/bin/meshrun train --config "${1:-examples/main_job.json}"
