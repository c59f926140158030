#!/usr/bin/env bash
# The Python environment the tests use (never the system Python): a venv in BUILD_DIR/venv with
# numpy from PyPI, which the end-to-end tests write their .npy datasets with.
# Usage: bash scripts/python-env.sh [BUILD_DIR]   (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-build}/venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -c "import numpy" 2>/dev/null ||
  "$venv/bin/pip" install --quiet --disable-pip-version-check "numpy>=1.24,<3"
