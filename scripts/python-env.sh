#!/usr/bin/env bash
# The Python environment the tests use (never the system Python): a venv in BUILD_DIR/venv with,
# from PyPI, numpy (the end-to-end tests write their .npy datasets with it), JAX, Flax, optax,
# grpcio and pytest (the Python SDK's tests, python/tests), and the SDK itself (python/, its gRPC
# stubs generated from proto/ by grpcio-tools while it installs).
# The versions are the ones the SDK is tested with (../shared/jaxpr-primitives-of-the-seeds.md).
# Usage: bash scripts/python-env.sh [BUILD_DIR]   (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-build}/venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
pip=("$venv/bin/pip" install --quiet --disable-pip-version-check)
"$venv/bin/python" -c "import numpy, jax, flax, optax, grpc, grpc_tools, pytest, setuptools" 2>/dev/null ||
  "${pip[@]}" "numpy>=1.24,<3" "jax==0.10.2" "flax==0.12.8" "optax==0.2.8" "grpcio>=1.51" \
    "grpcio-tools>=1.51" "protobuf>=4.21" "pytest>=7" "setuptools>=61"
bash scripts/python-sdk-install.sh "${1:-build}"
