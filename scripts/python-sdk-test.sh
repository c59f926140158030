#!/usr/bin/env bash
# The Python SDK's pytest suite against real clusters (`meshrun up` from BIN_DIR), in the venv
# python-env.sh made; reinstalls the SDK from this checkout first. CTest runs it as
# e2e_python_sdk. Usage: bash scripts/python-sdk-test.sh BUILD_DIR [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
build="$(realpath "$1")"
shift
if [ ! -x "$build/venv/bin/python" ]; then
  echo "no venv in $build/venv: run bash scripts/python-env.sh $build first" >&2
  exit 1
fi
bash scripts/python-sdk-install.sh "$build"
cd python/tests  # not the repository root: `import meshrun` must find the installed package
MESHRUN_BIN_DIR="$build/bin" exec "$build/venv/bin/python" -m pytest -q -p no:cacheprovider "$@" .
