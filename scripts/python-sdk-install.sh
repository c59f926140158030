#!/usr/bin/env bash
# (Re)installs the Python SDK (python/) into BUILD_DIR/venv from this checkout: its stubs are
# generated from proto/ as it builds. Run by python-env.sh and before the SDK's tests, so they
# always test the checkout. Usage: bash scripts/python-sdk-install.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(realpath "${1:-build}")/venv"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# Built from a copy, so the checkout gets no build/ or egg-info of setuptools'.
cp -r python "$tmp/python"
MESHRUN_PROTO_DIR="$PWD/proto" "$venv/bin/pip" install --quiet --disable-pip-version-check \
  --no-build-isolation --no-deps --force-reinstall "$tmp/python"
